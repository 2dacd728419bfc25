"""The weights as the model computes with them: a copy in the compute dtype, made once.

Where ``model.param_dtype`` (the trainer's master weights, float32 in the GSM8K recipes) differs
from ``model.compute_dtype`` (bfloat16 on GPUs), every matmul of the model casts its weight to
the compute dtype first, in every call. Two places cast once instead:

* the engine, when weights are installed (at start and at each ``update_weights``):
  its prefill and decode programs run on that copy (:func:`compute_copy`);
* the train step, once per optimizer update rather than once per micro-batch: each
  micro-batch's forward and backward run on the copy, and the gradient, taken with respect to
  the copy, is accumulated in float32 (:func:`cast_for_compute`, traceable). The cast's own
  gradient is a cast back, so the accumulated gradient is the same number.

Exact: only leaves of two or more dimensions are cast (matmul kernels, embedding tables, MoE
expert stacks), but never a mixture-of-experts router's kernel (read in float32:
:func:`asyncrl.model.moe.is_router_weight`, so the engine routes as the trainer does), and the
model uses the others only through a cast to the compute dtype (``nnx.Linear``/``nnx.Embed``
with ``dtype=compute``, the tied lm head's ``astype``, the experts' ``astype``), so every
program sees the same values (tested bitwise on a decode chunk and on a train step's
gradients). One-dimensional leaves (norm weights, biases: a few KB) are left as they are,
whatever a model does with them in float32 (Gemma's ``1 + w`` norms read them in float32).
Trees with LoRA adapters are left alone (an adapter's own dtype rules apply).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from asyncrl.model.moe import is_router_weight


def needs_compute_copy(params: Any, compute_dtype: Any) -> bool:
    """Whether any leaf :func:`compute_copy` would cast exists (and the tree has no LoRA adapters)."""
    paths = jax.tree_util.tree_leaves_with_path(params)
    if any("lora" in jax.tree_util.keystr(path) for path, _ in paths):
        return False
    return any(_cast_leaf(path, x, jnp.dtype(compute_dtype)) for path, x in paths)


def _cast_leaf(path: tuple, x: Any, compute_dtype: Any) -> bool:
    return (jnp.ndim(x) >= 2 and jnp.issubdtype(jnp.result_type(x), jnp.floating) and jnp.result_type(x) != compute_dtype
            and not is_router_weight(path))


def cast_for_compute(params: Any, compute_dtype: Any) -> Any:
    """``params`` with the leaves the model only uses in ``compute_dtype`` cast to it, the others as
    they are (traceable: the train step calls it inside its jit)."""
    compute_dtype = jnp.dtype(compute_dtype)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(compute_dtype) if _cast_leaf(path, x, compute_dtype) else x, params)


_cast = jax.jit(cast_for_compute, static_argnums=1)


def compute_copy(params: Any, compute_dtype: Any) -> Any:
    """``params`` with every floating leaf of two or more dimensions in ``compute_dtype`` but a
    router's (new arrays on the same devices and shardings; the others are the same arrays), or
    ``params`` itself when nothing would change (:func:`needs_compute_copy`)."""
    compute_dtype = jnp.dtype(compute_dtype)
    if not needs_compute_copy(params, compute_dtype):
        return params
    return _cast(params, compute_dtype)
