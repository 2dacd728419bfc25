"""Hugging Face interop: read a local checkpoint directory, export one back.

Resolving ``model.path`` (a hub id, ``tiny``, ``tiny-qwen3``) to such a directory is
:mod:`asyncrl.model.loading`'s (above this module and the built-in models, which write
their directories through :func:`export_hf`).

Loading imports no torch for ``config.json``, which is read as JSON and normalised the way
``transformers.AutoConfig`` does (class defaults; older layouts, e.g. top-level ``rope_theta`` +
``rope_scaling``, into ``rope_parameters``; :func:`~asyncrl.model.config.hf_config_from_dict`),
nor for the built-in models' tokenizers, loaded without ``AutoTokenizer`` (:func:`load_tokenizer`);
tensors are read through ``safetensors.safe_open(framework="np")``
(bfloat16 included), single-file or sharded (``model.safetensors.index.json``).
Every missing, unexpected or mis-shaped tensor is listed in one ModelError; a tied
head is not missing (and an ``lm_head.weight`` saved beside tied embeddings is
accepted and ignored).

Stop ids come from ``generation_config.json``'s ``eos_token_id`` (int or list), else
``config.json``'s, else the tokenizer's EOS. ``pad_token_id`` is the tokenizer's pad
when it has one, else the first stop id: padding is always described by masks, so
pad may equal EOS.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Collection, NamedTuple, Optional

from asyncrl.errors import ModelError
from asyncrl.model.config import DecoderConfig, from_hf_config, hf_config_from_dict, to_hf_config

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


class LoadedModel(NamedTuple):
    """A model read from an HF directory (what :func:`asyncrl.model.load_model` returns, and what
    :func:`export_hf` also accepts); unpack as ``model, tokenizer, stop_ids, *_``."""

    model: Any  # asyncrl.model.transformer.Decoder (NNX module)
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    stop_token_ids: tuple[int, ...]  # from generation_config.json eos_token_id
    pad_token_id: int  # tokenizer pad, else the first stop id (may equal EOS)
    path: Path  # the resolved local directory

    @property
    def config(self) -> DecoderConfig:
        return self.model.cfg

    def split(self) -> tuple[Any, dict]:
        """``(graphdef, params)`` with params a pure dict of jax.Array."""
        from asyncrl.model.transformer import split_params

        return split_params(self.model)


# --------------------------------------------------------------------------- reading


def read_hf_config(model_dir: Path) -> Any:
    """``config.json`` as the attributes ``transformers.AutoConfig`` would give it, read by
    :func:`~asyncrl.model.config.hf_config_from_dict` (errors name the file). Not through
    transformers itself: its config classes import torch whenever torch is installed, which
    was most of a small run's start-up."""
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        raise ModelError(f"{model_dir}: no config.json")
    return read_hf_config_file(cfg_file)


def read_hf_config_file(cfg_file: Path) -> Any:
    """:func:`read_hf_config` of an existing ``config.json`` file; errors name it."""
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelError(f"{cfg_file}: cannot read it as JSON ({err})") from err
    if not isinstance(raw, dict):
        raise ModelError(f"{cfg_file}: not a JSON object (found {type(raw).__name__})")
    return hf_config_from_dict(raw, source=str(cfg_file))


# --------------------------------------------------------------------------- tensors


def read_safetensors_index(index: Path) -> dict[str, Any]:
    """A sharded checkpoint's ``model.safetensors.index.json`` as JSON (its ``weight_map`` a
    mapping); errors name the file."""
    try:
        raw = json.loads(index.read_text())
        if not isinstance(raw["weight_map"], dict):
            raise TypeError(f"weight_map is a {type(raw['weight_map']).__name__}")
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ModelError(f"{index}: not a valid safetensors index ({err})") from err
    return raw


def read_safetensors(model_dir: Path, only: Optional[Collection[str]] = None) -> dict[str, Any]:
    """All tensors of a directory (or the names in ``only``; a shard holding none of them is not
    opened) as host numpy arrays (bf16 stays bf16, as ml_dtypes' bfloat16): sharded or single
    file. Read as numpy, not as jax arrays: safetensors' flax reader runs a jax program per tensor
    shape (a compile or cache load each at start-up)."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_safetensors_index(index)["weight_map"]
        files = sorted({f for n, f in weight_map.items() if only is None or n in only})
    elif (model_dir / SAFETENSORS_FILE).is_file():
        files = [SAFETENSORS_FILE]
    else:
        found = sorted(p.name for p in model_dir.iterdir())
        raise ModelError(
            f"{model_dir}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} (found: {', '.join(found) or 'nothing'}); "
            "only safetensors checkpoints are supported"
        )
    tensors: dict[str, Any] = {}
    for name in files:
        file = model_dir / name
        if not file.is_file():
            raise ModelError(f"{index}: names shard {name}, which does not exist")
        tensors.update(read_safetensors_file(file, only))
    return tensors


def read_safetensors_file(file: Path, only: Optional[Collection[str]] = None) -> dict[str, Any]:
    """The tensors of one safetensors file (or those named in ``only``) as host numpy arrays;
    a file safetensors cannot read (truncated, not safetensors) raises ModelError naming it."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="np") as f:
            return {key: f.get_tensor(key) for key in f.keys() if only is None or key in only}
    except Exception as err:
        raise ModelError(f"{file}: cannot read safetensors: {err}") from err


def param_layout(cfg: DecoderConfig, abstract: Any = None) -> dict[tuple, tuple[str, bool, tuple[int, ...]]]:
    """Our param path -> (HF tensor name, transposed?, our shape). ``abstract``: the
    ``nnx.eval_shape`` Decoder of ``cfg`` when the caller has one (tracing it again costs time)."""
    import jax
    from flax import nnx

    from asyncrl.model.transformer import Decoder

    if abstract is None:
        abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    pure = nnx.to_pure_dict(nnx.state(abstract))
    layout = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(pure)[0]:
        keys = tuple(k.key for k in path)
        parts = [str(k) for k in keys]
        last = parts[-1]
        transposed = last == "kernel"
        parts[-1] = "weight" if last in ("kernel", "embedding") else last
        prefix = "" if parts[0] == "lm_head" else "model."
        layout[keys] = (prefix + ".".join(parts), transposed, tuple(leaf.shape))
    return layout


def params_from_hf(cfg: DecoderConfig, tensors: dict[str, Any], source: str, abstract: Any = None,
                   keep: Optional[dict[str, Any]] = None) -> dict:
    """Our pure params dict from HF tensors; one ModelError lists every problem.

    ``keep``: ``{HF name: our leaf}`` already on the device in our layout and dtype (what a server
    serves), used as is for a name not in ``tensors`` (``asyncrl serve`` re-reads only changed tensors).

    Casts and transposes run in numpy on the host (bfloat16 through ml_dtypes), then each array
    is put on the device once: as jax operations each tensor shape was a program of its own to
    compile or load from the compilation cache, tens of them at every start-up (``jnp.asarray``
    of a numpy array too, in this jax; ``jax.device_put`` is a plain transfer)."""
    import jax
    import numpy as np

    from asyncrl.model.transformer import dtype_of

    layout = param_layout(cfg, abstract)
    if cfg.num_experts:  # per-expert HF tensors -> our stacked expert parameters
        from asyncrl.model.moe import stack_expert_tensors

        tensors = stack_expert_tensors(cfg, tensors)
    expected = {hf_name for hf_name, _, _ in layout.values()}
    missing, mis_shaped = [], []
    params: dict = {}
    for keys, (hf_name, transposed, shape) in layout.items():
        if hf_name not in tensors and keep is not None and hf_name in keep:
            node = params
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = keep[hf_name]
            continue
        if hf_name not in tensors:
            missing.append(hf_name)
            continue
        tensor = tensors[hf_name]
        hf_shape = tuple(shape[::-1]) if transposed else shape
        if tuple(tensor.shape) != hf_shape:
            mis_shaped.append(f"{hf_name}: file has {list(tensor.shape)}, config needs {list(hf_shape)}")
            continue
        value = np.asarray(tensor).astype(dtype_of(cfg.param_dtype), copy=False)
        node = params
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = jax.device_put(np.ascontiguousarray(value.T) if transposed else value)
    allowed_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(
        n for n in tensors if n not in expected and n not in allowed_extra and not n.endswith(_IGNORED_SUFFIXES)
    )
    if missing or unexpected or mis_shaped:
        lines = [f"{source}: the checkpoint does not match its config ({cfg.model_type}, {cfg.num_layers} layers)"]
        if missing:
            lines.append(f"  missing tensors ({len(missing)}): {', '.join(sorted(missing))}")
        if unexpected:
            lines.append(f"  unexpected tensors ({len(unexpected)}): {', '.join(unexpected)}")
        if mis_shaped:
            lines.append(f"  mis-shaped tensors ({len(mis_shaped)}): {'; '.join(mis_shaped)}")
        raise ModelError("\n".join(lines))
    return params


def hf_tensors_from_params(cfg: DecoderConfig, params: dict) -> dict[str, Any]:
    """HF-named jax arrays from our pure params dict (inverse of :func:`params_from_hf`)."""
    out = {}
    for keys, (hf_name, transposed, _) in param_layout(cfg).items():
        value: Any = params
        for k in keys:
            value = value[k]
        out[hf_name] = value.T if transposed else value
    if cfg.num_experts:  # our stacked expert parameters -> the per-expert tensors transformers reads
        from asyncrl.model.moe import unstack_expert_tensors

        out = unstack_expert_tensors(cfg, out)
    return out


# --------------------------------------------------------------------------- load


def read_stop_token_ids(model_dir: Path, hf_config: Any = None, tokenizer: Any = None) -> tuple[int, ...]:
    """EOS ids from generation_config.json (int or list), else config.json, else the tokenizer."""
    gen_file = model_dir / "generation_config.json"
    candidates = []
    if gen_file.is_file():
        try:
            candidates.append(json.loads(gen_file.read_text()).get("eos_token_id"))
        except json.JSONDecodeError as err:
            raise ModelError(f"{gen_file}: not valid JSON ({err})") from err
    if hf_config is not None:
        candidates.append(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        candidates.append(tokenizer.eos_token_id)
    for value in candidates:
        if value is None:
            continue
        ids = [value] if isinstance(value, int) else list(value)
        if ids:
            return tuple(int(i) for i in ids)
    return ()


SAVED_TOKENIZER_CLASS = "TokenizersBackend"
"""The class transformers 5 saves a ``tokenizers``-library tokenizer as (the built-in models' kind)."""


def load_tokenizer(model_dir: Path, *, builtin: bool = False) -> Any:
    """The directory's tokenizer through ``transformers.AutoTokenizer``.

    ``builtin=True`` (a directory asyncrl built, :mod:`asyncrl.model.tiny` / ``tiny_qwen3``):
    the ``TokenizersBackend`` it was saved as is loaded directly, which is what AutoTokenizer
    picks for these directories too (tests/model/test_model_config_reader.py checks both give the
    same tokenizer) but without AutoTokenizer's import of transformers' config classes, which
    import torch whenever it is installed. Any other directory keeps AutoTokenizer's choice of
    class by model type."""
    try:
        if builtin and _saved_tokenizer_class(model_dir) == SAVED_TOKENIZER_CLASS:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            return TokenizersBackend.from_pretrained(str(model_dir))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as err:
        raise ModelError(f"{model_dir}: transformers cannot load the tokenizer: {err}") from err


def _saved_tokenizer_class(model_dir: Path) -> Optional[str]:
    """``tokenizer_class`` of ``tokenizer_config.json``, or None (absent or unreadable: AutoTokenizer decides)."""
    try:
        saved = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return saved.get("tokenizer_class") if isinstance(saved, dict) else None


def load_hf_directory(model_dir: Path, *, with_tokenizer: bool = True, builtin: bool = False,
                      **runtime: Any) -> LoadedModel:
    """Read the local HF directory ``model_dir`` into a :class:`LoadedModel`.

    ``runtime``: :func:`~asyncrl.model.loading.runtime_fields` of the :class:`DecoderConfig`
    (dtypes, remat, log-prob chunking), which no checkpoint records. ``with_tokenizer=False``
    skips the tokenizer (``tokenizer`` is then None), for bare checkpoints. ``builtin``: the
    directory is a built-in model's (:func:`load_tokenizer`).
    """
    from flax import nnx

    from asyncrl.model.transformer import Decoder

    hf_config = read_hf_config(model_dir)
    cfg = from_hf_config(hf_config, source=str(model_dir / "config.json"), **runtime)
    model = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    tensors = read_safetensors(model_dir)
    if getattr(hf_config, "multimodal", False):  # a gemma3 config without a vision tower
        tensors = text_model_tensors(tensors)
    params = params_from_hf(cfg, tensors, str(model_dir), abstract=model)
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    tokenizer = load_tokenizer(model_dir, builtin=builtin) if with_tokenizer else None
    stop_ids = read_stop_token_ids(model_dir, hf_config, tokenizer)
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is None:
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else (stop_ids[0] if stop_ids else 0)
    return LoadedModel(model, tokenizer, stop_ids, int(pad), model_dir)


_TEXT_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."))


def text_model_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """A ``gemma3`` checkpoint's language-model tensors under the text model's names
    (``model.language_model.layers.0...`` in transformers 5, ``language_model.model.layers.0...``
    before it, become ``model.layers.0...``); other names are kept, for the usual checks to list."""
    renamed = {}
    for name, value in tensors.items():
        for old, new in _TEXT_MODEL_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        renamed[name] = value
    return renamed


# --------------------------------------------------------------------------- export


def export_hf(
    model: Any,
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    params: Any = None,
    stop_token_ids: Optional[tuple[int, ...]] = None,
    overwrite: bool = False,
    exist_ok: bool = False,
) -> Path:
    """Write an HF directory that ``AutoModelForCausalLM.from_pretrained`` loads:
    ``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer.

    ``model`` is a Decoder, a LoadedModel, or a graphdef with ``params`` given. The
    directory is assembled in a temporary sibling and renamed into place, so readers
    never see half a checkpoint. An existing ``out_dir`` is an error unless
    ``overwrite`` (replace it) or ``exist_ok`` (keep it, e.g. a parallel builder won).
    """
    from flax import nnx
    from safetensors.flax import save_file

    from asyncrl.model.transformer import Decoder

    if isinstance(model, LoadedModel):
        stop_token_ids = stop_token_ids if stop_token_ids is not None else model.stop_token_ids
        tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        model = model.model
    if params is not None:
        model = nnx.merge(model if isinstance(model, nnx.GraphDef) else nnx.split(model)[0], params)
    if not isinstance(model, Decoder):
        raise TypeError(f"export_hf needs a Decoder, LoadedModel or graphdef + params, got {type(model).__name__}")
    cfg: DecoderConfig = model.cfg
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        if exist_ok:
            return out_dir
        raise ModelError(f"export_hf: {out_dir} already exists (pass overwrite=True to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write_hf_metadata(cfg, tokenizer, tmp, stop_token_ids)
        params_now = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        tensors = {k: _contiguous(v) for k, v in hf_tensors_from_params(cfg, params_now).items()}
        save_file(tensors, str(tmp / SAFETENSORS_FILE), metadata={"format": "pt"})
        _default_permissions(tmp)
        install_dir(tmp, out_dir, overwrite=overwrite, exist_ok=exist_ok)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
_ARCHITECTURES["qwen3_moe"] = "Qwen3MoeForCausalLM"
_ARCHITECTURES["gemma3_text"] = "Gemma3ForCausalLM"


def write_hf_metadata(cfg: DecoderConfig, tokenizer: Any, directory: Path,
                      stop_token_ids: Optional[tuple[int, ...]] = None) -> None:
    """Everything of an HF directory but its tensors, into the existing ``directory``:
    ``config.json`` (its ``dtype`` is ``cfg.param_dtype``), ``generation_config.json`` (stop ids:
    ``stop_token_ids``, else the config's, else the tokenizer's EOS) and the tokenizer, if any."""
    from transformers import GenerationConfig

    if stop_token_ids is None:
        stop_token_ids = cfg.eos_token_ids or ((tokenizer.eos_token_id,) if tokenizer is not None and tokenizer.eos_token_id is not None else ())
    pad = cfg.pad_token_id
    if pad is None and tokenizer is not None:
        pad = tokenizer.pad_token_id
    eos: Any = list(stop_token_ids) if len(stop_token_ids) != 1 else stop_token_ids[0]
    hf_cfg = to_hf_config(cfg.replace(eos_token_id=eos if isinstance(eos, int) or not eos else tuple(eos), pad_token_id=pad))
    hf_cfg.architectures = [_ARCHITECTURES[cfg.model_type]]
    hf_cfg.save_pretrained(str(directory))
    GenerationConfig(eos_token_id=eos or None, pad_token_id=pad, bos_token_id=cfg.bos_token_id).save_pretrained(str(directory))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


def _contiguous(x: Any) -> Any:
    import jax
    import jax.numpy as jnp

    return jnp.array(jax.device_get(x), copy=True)


def _default_permissions(directory: Path) -> None:
    """The permissions a plain ``mkdir``/``open`` would give (0777/0666 minus the umask): the
    temporary directory was made private (0700) by ``mkdtemp``, and an export is meant to be shared."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def install_dir(tmp: Path, out_dir: Path, *, overwrite: bool, exist_ok: bool) -> None:
    """Rename the finished ``tmp`` onto ``out_dir`` (atomic on one filesystem)."""
    if out_dir.exists() and overwrite:
        old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # Someone else installed it between our check and the rename (racing builders).
        if exist_ok and out_dir.exists():
            return
        raise ModelError(f"export_hf: {out_dir} appeared while exporting (pass overwrite=True to replace it)") from None
