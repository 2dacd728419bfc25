"""LoRA: low-rank adapters on frozen base weights, built on Flax NNX's own LoRA pieces.

Each targeted ``nnx.Linear`` of a decoder layer (``q_proj`` ... ``down_proj``) becomes a
:class:`LoRALinear`, a subclass of ``nnx.LoRALinear`` whose ``lora`` submodule is NNX's
``nnx.LoRA`` holding ``lora_a [in, r]`` and ``lora_b [r, out]`` as ``nnx.LoRAParam``. The
subclass adds the two things ``nnx.LoRALinear`` lacks and PEFT has: the ``alpha / r`` output
scale and dropout on the adapter's input::

    y = x @ W (+ bias) + (alpha / r) * (dropout(x) @ A) @ B        # PEFT: lora_B(lora_A(dropout(x))) * scaling

The model's forward stays the pure function of :mod:`asyncrl.model.transformer` over a
params pytree (``forward(graphdef, params, ...)``): the LoRA graphdef simply has the
adapters in its tree. The trainer keeps the tree in three parts (pure dicts, nested like
the model; :func:`partition_params` splits, :func:`combine_params` joins):

* ``frozen``: the base weights, exactly the dict the base model was loaded into (shared,
  never copied, never differentiated), plus a zero ``dropout_key`` per adapter when dropout
  is on (a zero key means "no dropout": pi_prox, pi_ref, eval);
* ``adapters``: ``{...: {"lora": {"lora_a", "lora_b"}}}``, the only trained leaves;
* dropout keys for one training forward (:func:`dropout_keys`), overriding the zeros.

The engine serves the merged weights ``W + (alpha / r) * A @ B`` (:func:`merge_lora_jit`, a
jitted, sharded function of the base and adapters), in the base model's structure, so
generation costs exactly what it costs without LoRA.

Why subclass and not use ``nnx.LoRALinear`` as is: it has no scale (``alpha`` would be
folded into ``B``, changing what a learning rate means against PEFT) and no dropout.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import ConfigDict, Field

from asyncrl import pytree
from asyncrl.config import LORA_TARGET_MODULES, LoraConfig, LoraTarget
from asyncrl.model.config import DecoderConfig

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTER_KEY = "lora"
"""The key of an adapter's ``{lora_a, lora_b}`` under its linear layer in the params tree."""
DROPOUT_KEY = "dropout_key"


class LoraSpec(LoraConfig):
    """Hashable form of ``model.lora`` (a jit static argument): a frozen subclass of the section,
    so it carries every field (and ``scale``) without a copy; ``target_modules`` is a tuple."""

    model_config = ConfigDict(frozen=True)

    target_modules: tuple[LoraTarget, ...] = Field(default=LORA_TARGET_MODULES, min_length=1)  # type: ignore[assignment]

    @classmethod
    def from_config(cls, section: Any) -> "LoraSpec":
        """From the ``model.lora`` section (a :class:`~asyncrl.config.LoraConfig`)."""
        return cls(**dict(section))


class LoRADropoutKey(nnx.Variable):
    """uint32 [2] raw PRNG key of one adapter's input dropout; all zeros: no dropout."""


class LoRALinear(nnx.LoRALinear):
    """``nnx.LoRALinear`` with PEFT's ``alpha / r`` scale and adapter-input dropout."""

    def __init__(self, base: nnx.Linear, spec: LoraSpec, rngs: nnx.Rngs):
        super().__init__(
            base.in_features, base.out_features, lora_rank=spec.rank, use_bias=base.use_bias,
            dtype=base.dtype, param_dtype=base.param_dtype, lora_dtype=base.dtype,
            lora_param_dtype=base.param_dtype, rngs=rngs,
        )
        self.scale = spec.scale
        self.dropout_rate = spec.dropout
        if spec.dropout > 0:
            self.dropout_key = LoRADropoutKey(jnp.zeros((2,), jnp.uint32))

    def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
        y = nnx.Linear.__call__(self, x, out_sharding=out_sharding)
        if self.dropout_rate > 0:
            x = _dropout(x, self.dropout_key[...], self.dropout_rate)
        return y + (self.lora(x) * self.scale).astype(y.dtype)


def _dropout(x: jax.Array, raw_key: jax.Array, rate: float) -> jax.Array:
    """Inverted dropout of ``x`` with ``raw_key`` (uint32 [2]); the identity when the key is zero."""
    keep = jax.random.bernoulli(jax.random.wrap_key_data(raw_key), 1.0 - rate, x.shape)
    dropped = jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)
    return jnp.where(jnp.any(raw_key != 0), dropped, x)


# --------------------------------------------------------------------------- building


def _lora_decoder(cfg: DecoderConfig, spec: LoraSpec) -> Any:
    """A Decoder whose targeted linear layers are :class:`LoRALinear` (call under ``nnx.eval_shape``)."""
    from asyncrl.model.transformer import Decoder

    check_moe_targets(cfg, spec.target_modules)
    model = Decoder(cfg, nnx.Rngs(0))
    for layer in model.layers:
        for name in spec.target_modules:
            parent = layer.self_attn if name in ATTENTION_MODULES else layer.mlp
            setattr(parent, name, LoRALinear(getattr(parent, name), spec, nnx.Rngs(0)))
    return model


def check_moe_targets(cfg: DecoderConfig, target_modules: Any) -> None:
    """Mixture-of-experts models take adapters on attention only. PEFT (on transformers 5) reads
    ``gate_proj``/``up_proj``/``down_proj`` of a qwen3_moe model as the experts' fused weights,
    which asyncrl does not adapt, so an adapter on the dense layers' MLPs would not load as
    trained: refused, naming the option."""
    from asyncrl.errors import ModelError

    mlp = sorted(set(target_modules) - set(ATTENTION_MODULES))
    if getattr(cfg, "num_experts", 0) and mlp:
        raise ModelError(f"model.lora.target_modules: {', '.join(mlp)} on a mixture-of-experts model "
                         f"({cfg.model_type}): PEFT would read them as the experts' weights, which get no adapters; "
                         f"use attention targets only, e.g. [{', '.join(ATTENTION_MODULES)}]")


@dataclasses.dataclass
class LoraModel:
    """A base model with adapters attached: what the trainer needs (see the module docstring)."""

    graphdef: Any
    """The LoRA model's graphdef (adapters in the tree; :func:`~asyncrl.model.forward` takes it)."""
    frozen: dict
    """Base weights (+ zero dropout keys): never trained."""
    adapters: dict
    """``{...: {"lora": {"lora_a", "lora_b"}}}``: the trained leaves."""
    spec: LoraSpec


def attach_lora(cfg: DecoderConfig, base_params: dict, spec: LoraSpec, seed: int = 0) -> LoraModel:
    """Attach fresh adapters (PEFT's init: ``A`` kaiming-uniform, ``B = 0``, so the model is
    the base model exactly) to ``base_params`` (the base model's pure dict)."""
    abstract = nnx.eval_shape(lambda: _lora_decoder(cfg, spec))
    graphdef, state = nnx.split(abstract)
    template = nnx.to_pure_dict(state)
    _, adapter_shapes, key_shapes = partition_params(template)
    dtype = jax.tree.leaves(base_params)[0].dtype
    adapters = jax.tree_util.tree_map_with_path(lambda p, leaf: _init_adapter(p, leaf, seed, dtype), adapter_shapes)
    keys = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), key_shapes)
    return LoraModel(graphdef, combine_params(base_params, keys), adapters, spec)


def _init_adapter(path: Any, leaf: Any, seed: int, dtype: Any) -> jax.Array:
    """PEFT's default init from numpy's PCG64 seeded by (seed, path): deterministic, no compilation.
    ``lora_a [in, r]`` ~ U(+-1/sqrt(in)) (kaiming-uniform with a = sqrt(5)); ``lora_b`` zeros."""
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    if name.endswith("lora_b"):
        return jnp.zeros(leaf.shape, dtype)
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    rng = np.random.Generator(np.random.PCG64([seed, digest]))
    bound = 1.0 / np.sqrt(leaf.shape[0])
    return jnp.asarray(rng.uniform(-bound, bound, size=leaf.shape).astype(np.float32), dtype)


# --------------------------------------------------------------------------- params trees


def partition_params(params: dict) -> tuple[dict, dict, dict]:
    """``(frozen, adapters, dropout_keys)`` of a LoRA model's pure dict (leaves are shared)."""
    frozen: dict = {}
    adapters: dict = {}
    keys: dict = {}
    for key, value in params.items():
        if key == ADAPTER_KEY:
            adapters[key] = value
        elif key == DROPOUT_KEY:
            keys[key] = value
        elif isinstance(value, dict):
            parts = partition_params(value)
            for out, part in zip((frozen, adapters, keys), parts):
                if part:
                    out[key] = part
        else:
            frozen[key] = value
    return frozen, adapters, keys


def combine_params(*trees: Optional[dict]) -> dict:
    """Nested dicts merged (later trees win on equal leaves; None is empty). Keys that are
    digit strings (a checkpoint's spelling of list indices) match int keys."""
    out: dict = {}
    for tree in trees:
        if tree is None:
            continue
        for key, value in tree.items():
            key = _index_key(key)
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = combine_params(out[key], value)
            elif isinstance(value, dict):
                out[key] = combine_params(value)
            else:
                out[key] = value
    return out


def _index_key(key: Any) -> Any:
    return int(key) if isinstance(key, str) and key.isdigit() else key


def dropout_keys(template: dict, key: jax.Array) -> dict:
    """Fresh raw dropout keys (uint32 [2]) for every ``dropout_key`` leaf of ``template``,
    each ``fold_in(key, i)`` in path order (jit-safe)."""
    paths, treedef = jax.tree_util.tree_flatten(template)
    fresh = [jax.random.key_data(jax.random.fold_in(key, i)).astype(jnp.uint32) for i in range(len(paths))]
    return jax.tree_util.tree_unflatten(treedef, fresh)


def adapter_modules(adapters: dict, prefix: tuple = ()) -> list[tuple[tuple, dict]]:
    """``[(path of the linear layer, {"lora_a", "lora_b"})]`` in a stable order."""
    out = []
    for key in sorted(adapters, key=lambda k: (str(type(k)), k)):
        value = adapters[key]
        if key == ADAPTER_KEY:
            out.append((prefix, value))
        elif isinstance(value, dict):
            out.extend(adapter_modules(value, prefix + (key,)))
    return out


def _get(tree: dict, path: tuple) -> Any:
    for key in path:
        tree = tree[_index_key(key)] if _index_key(key) in tree else tree[key]
    return tree


# --------------------------------------------------------------------------- merging


def merge_lora(base: dict, adapters: dict, scale: float) -> dict:
    """``base`` with every adapted kernel replaced by ``W + scale * A @ B`` (float32
    accumulate, cast back to W's dtype); the base model's structure, untouched leaves shared."""
    merged = combine_params(base)  # a new dict skeleton; leaves are the base's arrays
    for path, pair in adapter_modules(adapters):
        module = _get(merged, path)
        w = module["kernel"]
        delta = jnp.matmul(pair["lora_a"].astype(jnp.float32), pair["lora_b"].astype(jnp.float32))
        module["kernel"] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
    return merged


def _merge_sharded(base: dict, adapters: dict, *, scale: float, model_cfg: Any, mesh: Any) -> dict:
    from asyncrl.model.sharding import param_shardings

    merged = merge_lora(base, adapters, scale)
    if mesh is None:
        return merged
    return jax.lax.with_sharding_constraint(merged, param_shardings(model_cfg, merged, mesh))


merge_lora_jit = jax.jit(_merge_sharded, static_argnames=("scale", "model_cfg", "mesh"))
""":func:`merge_lora` jitted at module level; with ``mesh`` the result is placed by the base
model's partition rules (each kernel stays where the base kernel was)."""


# --------------------------------------------------------------------------- identity and sizes


def params_hash(params: dict) -> str:
    """sha256 (hex) of a params tree's paths, shapes, dtypes and bytes, in path order: the
    content identity of a base model that a LoRA checkpoint records."""
    digest = hashlib.sha256()
    for key, leaf in sorted(pytree.keyed_leaves(params, "params").items()):
        array = pytree.to_host(leaf)
        digest.update(f"{key}|{array.shape}|{array.dtype}|".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def tree_bytes(tree: Any) -> int:
    """Bytes held by the array leaves of ``tree`` (parameters, gradients, optimizer state)."""
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(tree)
                   if hasattr(x, "shape") and hasattr(x, "dtype")))


# --------------------------------------------------------------------------- PEFT export

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


def peft_tensors(adapters: dict) -> dict[str, np.ndarray]:
    """PEFT's tensor names and layout: ``base_model.model.model.<linear>.lora_A.weight [r, in]``
    (our ``lora_a [in, r]`` transposed) and ``lora_B.weight [out, r]``."""
    out = {}
    for path, pair in adapter_modules(adapters):
        name = "base_model.model.model." + ".".join(str(k) for k in path)
        out[f"{name}.lora_A.weight"] = np.ascontiguousarray(pytree.to_host(pair["lora_a"]).T)
        out[f"{name}.lora_B.weight"] = np.ascontiguousarray(pytree.to_host(pair["lora_b"]).T)
    return out


def peft_config(spec: LoraSpec, base_model: str) -> dict[str, Any]:
    """``adapter_config.json`` of a PEFT LoRA adapter for a causal LM."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def export_peft_adapter(adapters: dict, spec: LoraSpec, out_dir: Any, *, base_model: str,
                        overwrite: bool = False) -> Any:
    """Write a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
    that ``peft.PeftModel.from_pretrained(base, out_dir)`` loads; assembled in a temporary
    sibling and renamed into place (never half written)."""
    import json
    import os
    import shutil
    import tempfile
    import uuid
    from pathlib import Path

    from safetensors.numpy import save_file

    from asyncrl.errors import ModelError

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise ModelError(f"export_peft_adapter: {out_dir} already exists (pass overwrite=True to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(peft_tensors(adapters), str(tmp / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / PEFT_CONFIG_FILE).write_text(json.dumps(peft_config(spec, base_model), indent=2) + "\n")
        for name in (PEFT_WEIGHTS_FILE, PEFT_CONFIG_FILE):
            with open(tmp / name, "rb") as handle:
                os.fsync(handle.fileno())
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# --------------------------------------------------------------------------- a run's base model


def base_identity(model_path: Any, base_params: dict) -> dict[str, str]:
    """What a LoRA checkpoint records of its base: ``{"base_model_path", "base_hash"}``."""
    return {"base_model_path": str(model_path), "base_hash": params_hash(base_params)}


def check_same_base(saved: Optional[dict], current: dict[str, str], where: str) -> None:
    """Refuse adapters trained on another base model (a :class:`~asyncrl.errors.CheckpointError`
    naming both content hashes)."""
    from asyncrl.errors import CheckpointError

    if not saved or "base_hash" not in saved:
        raise CheckpointError(f"{where}: holds no LoRA base-model identity (state.json 'lora'); it was not written "
                              "by a model.lora run, so its params are not adapters")
    if saved["base_hash"] != current["base_hash"]:
        raise CheckpointError(
            f"{where}: its adapters were trained on base model {saved.get('base_model_path')} with content hash "
            f"{saved['base_hash']}, but model.path {current['base_model_path']} now has content hash "
            f"{current['base_hash']}; point model.path at the original base weights"
        )


# --------------------------------------------------------------------------- PEFT import (a server's adapter load)

PEFT_PREFIX = "base_model.model."


def adapters_from_peft(tensors: dict[str, Any], config: dict[str, Any], layout: dict, source: str) -> tuple[dict, float]:
    """``(adapters, scale)`` from a PEFT LoRA adapter (``adapter_model.safetensors`` tensors and
    ``adapter_config.json``) for the model whose :func:`~asyncrl.model.hf.param_layout` is
    ``layout``: the inverse of :func:`peft_tensors`, for a server applying an adapter to its base
    (``W + scale * A @ B``). One :class:`~asyncrl.errors.ModelError` names every tensor that names no
    linear layer of the model, lacks its A or B partner, or has the wrong shape."""
    from asyncrl.errors import ModelError

    for flag in ("use_rslora", "use_dora"):
        if config.get(flag):
            raise ModelError(f"{source}: adapter_config.json sets {flag}, which asyncrl does not apply (plain LoRA only)")
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as err:
        raise ModelError(f"{source}: adapter_config.json needs integer 'r' and number 'lora_alpha' ({err})") from None
    # "model.layers.0.self_attn.q_proj.weight" -> (our path of the linear layer, our kernel shape [in, out])
    linears = {hf_name[: -len(".weight")]: (keys[:-1], shape) for keys, (hf_name, transposed, shape) in layout.items()
               if transposed and keys[-1] == "kernel"}
    pairs: dict[str, dict[str, Any]] = {}
    problems = []
    for name, tensor in tensors.items():
        module, _, part = name.rpartition(".lora_")
        if not name.startswith(PEFT_PREFIX) or part not in ("A.weight", "B.weight"):
            problems.append(f"{name}: not a PEFT LoRA tensor name ({PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
            continue
        module = module[len(PEFT_PREFIX):]
        if module not in linears:
            problems.append(f"{name}: {module} is no linear layer of this model")
            continue
        pairs.setdefault(module, {})[part[0]] = tensor
    for module, pair in sorted(pairs.items()):
        in_features, out_features = linears[module][1]  # our kernel [in, out]
        wanted = {"A": (rank, in_features), "B": (out_features, rank)}
        for part, shape in wanted.items():
            name = f"{PEFT_PREFIX}{module}.lora_{part}.weight"
            if part not in pair:
                problems.append(f"{name}: missing (its lora_{'B' if part == 'A' else 'A'} partner is there)")
            elif tuple(pair[part].shape) != shape:
                problems.append(f"{name}: shape {list(pair[part].shape)}, the model with r={rank} needs {list(shape)}")
    if not pairs and not problems:
        problems.append("no LoRA tensors")
    if problems:
        raise ModelError(f"{source}: the adapter does not fit the served model:\n  " + "\n  ".join(problems))
    adapters: dict = {}
    for module, pair in pairs.items():
        node = adapters
        for key in linears[module][0]:
            node = node.setdefault(key, {})
        node[ADAPTER_KEY] = {"lora_a": np.asarray(pair["A"], np.float32).T, "lora_b": np.asarray(pair["B"], np.float32).T}
    return adapters, alpha / rank
