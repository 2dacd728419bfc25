"""Loading a policy model by name: ``model.path`` -> a local HF directory -> a :class:`LoadedModel`.

``model.path`` is a local Hugging Face directory, a built-in spec (``tiny[:options]``,
:mod:`asyncrl.model.tiny`; ``tiny-qwen3[:options]``, :mod:`asyncrl.model.tiny_qwen3`), or
a hub id ``org/name`` (downloaded with ``huggingface_hub`` only when no such directory
exists). This module sits above :mod:`asyncrl.model.hf` (the directory format) and the
built-in models (which write their directories through :func:`~asyncrl.model.hf.export_hf`);
none of them imports it, so the model package has no import cycle.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional, Union

from asyncrl.config import ModelConfig
from asyncrl.errors import ModelError
from asyncrl.model.config import DecoderConfig
from asyncrl.model.hf import LoadedModel, load_hf_directory
from asyncrl.model.tiny import ensure_tiny, is_tiny
from asyncrl.model.tiny_qwen3 import ensure_tiny_qwen3, is_tiny_qwen3

HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
"""Files of a hub repository :func:`resolve_model_dir` downloads (no torch ``.bin`` weights)."""


def runtime_fields() -> tuple[str, ...]:
    """The ``model`` section's fields that are :class:`DecoderConfig` runtime options (dtypes,
    remat, log-prob chunking): derived from both classes, so a new option is one field in each."""
    decoder = {field.name for field in dataclasses.fields(DecoderConfig)}
    return tuple(name for name in ModelConfig.model_fields if name in decoder)


def runtime_options(section: ModelConfig, backend: Optional[str] = None) -> dict[str, Any]:
    """The :class:`DecoderConfig` runtime options of a ``model`` section, its ``auto`` values
    (``compute_dtype``, ``scan_layers``) resolved for ``backend`` (default: this machine's)."""
    runtime = {name: getattr(section, name) for name in runtime_fields()}
    if runtime.get("compute_dtype") == "auto":
        runtime["compute_dtype"] = auto_compute_dtype(backend)
    if runtime.get("scan_layers") == "auto":
        runtime["scan_layers"] = auto_scan_layers(backend)
    return resolve_run_auto(runtime)


RUN_AUTO = {"remat_policy": "full", "logprob_chunk_size": None}
"""What ``model.remat_policy: auto`` and ``model.logprob_chunk_size: auto`` are where nothing chose
them: the memory-safe policy and the chunk chosen under ``logprob_chunk_budget_mb``. A training run
first chooses the policy from its devices' memory (:func:`asyncrl.run.auto_slots.resolve_auto_remat`:
``full`` on a CPU) and keeps this chunk; ``asyncrl plan --target`` chooses both per target from
XLA's figures (:mod:`asyncrl.plan.auto`)."""


def resolve_run_auto(runtime: dict[str, Any]) -> dict[str, Any]:
    """``runtime`` with the ``auto`` of :data:`RUN_AUTO`'s fields replaced by their run values."""
    return {name: RUN_AUTO[name] if name in RUN_AUTO and value == "auto" else value for name, value in runtime.items()}


def auto_scan_layers(backend: Optional[str] = None) -> bool:
    """``model.scan_layers: auto``: scanned layers on accelerators (GPU, TPU), where each layer
    unrolled is kernels to compile and tune; unrolled on CPU, where XLA compiled the scanned
    train step more slowly (docs/performance.md "Scanned layers")."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    return backend != "cpu"


def auto_compute_dtype(backend: Optional[str] = None) -> str:
    """``model.compute_dtype: auto``: bfloat16 on accelerators (GPU, TPU), float32 on CPU, where
    bfloat16 is no faster and less accurate. ``backend`` defaults to ``jax.default_backend()``."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    return "float32" if backend == "cpu" else "bfloat16"


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """A local HF directory for ``path``: an existing directory, a built ``tiny`` / ``tiny-qwen3``
    spec, or (only when no such directory exists) a hub id downloaded with huggingface_hub."""
    text = os.fspath(path)
    local = Path(text).expanduser()
    if local.is_dir():
        return local
    if is_tiny(text):
        return ensure_tiny(text)
    if is_tiny_qwen3(text):
        return ensure_tiny_qwen3(text)
    looks_local = text.startswith((".", "/", "~")) or text.count("/") != 1 or os.sep + os.sep in text
    if looks_local:
        raise ModelError(f"model.path {text!r}: no such directory (and not a hub id 'org/name', 'tiny' or 'tiny-qwen3')")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=HUB_PATTERNS))
    except Exception as err:  # network, auth, not found: all the user's to fix
        raise ModelError(f"model.path {text!r}: not a local directory, and downloading it from the hub failed: {err}") from err


def load_model(
    path: str | os.PathLike | ModelConfig = "tiny",
    *,
    param_dtype: Optional[str] = None,
    compute_dtype: Optional[str] = None,
    remat: Optional[bool] = None,
    remat_policy: Optional[str] = None,
    scan_layers: Optional[Union[bool, str]] = None,
    logprob_chunk_size: Optional[Union[int, str]] = None,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Load a policy model: ``path`` is a local HF directory, ``tiny[:options]``, ``tiny-qwen3[:options]``,
    a hub id, or a :class:`asyncrl.config.ModelConfig` (whose fields supply the keyword defaults).

    Returns :class:`LoadedModel` ``(model, tokenizer, stop_token_ids, pad_token_id, path)``;
    ``with_tokenizer=False`` skips the tokenizer (``tokenizer`` is then None), for bare
    checkpoints. The dtype/remat/chunking keywords override the ModelConfig's fields;
    ``compute_dtype="auto"`` resolves by :func:`auto_compute_dtype`.
    """
    runtime: dict[str, Any] = {}
    if isinstance(path, ModelConfig):
        runtime = runtime_options(path)
        path = path.path
    given = {"param_dtype": param_dtype, "compute_dtype": compute_dtype, "remat": remat, "remat_policy": remat_policy,
             "scan_layers": scan_layers, "logprob_chunk_size": logprob_chunk_size}
    runtime.update({name: value for name, value in given.items() if value is not None})
    if runtime.get("compute_dtype") == "auto":
        runtime["compute_dtype"] = auto_compute_dtype()
    if runtime.get("scan_layers") == "auto":
        runtime["scan_layers"] = auto_scan_layers()
    runtime = resolve_run_auto(runtime)
    model_dir = resolve_model_dir(path)
    return load_hf_directory(model_dir, with_tokenizer=with_tokenizer, builtin=is_builtin(path), **runtime)


def is_builtin(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a built-in model (``tiny``, ``tiny-qwen3``) rather than a directory
    (a local directory of that name wins, as in :func:`resolve_model_dir`)."""
    text = os.fspath(path)
    return (is_tiny(text) or is_tiny_qwen3(text)) and not Path(text).expanduser().is_dir()
