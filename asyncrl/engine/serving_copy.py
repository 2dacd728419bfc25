"""The engine's serving copy of the weights in the compute dtype (issue 39).

Where ``model.param_dtype`` (the trainer's master weights, float32 in the GSM8K recipes) differs
from ``model.compute_dtype`` (bfloat16 on GPUs), every matmul of the model casts its weight to
the compute dtype first. Inside the engine's programs that cast ran on every call (and, where
XLA does not hoist it out of the decode loop, on every step): it reads the float32 weights and
writes a compute-dtype copy each time. The engine instead casts once, when weights are installed
(at start and at each ``update_weights``), and runs its programs on that copy.

Exact: only leaves of two or more dimensions are cast (matmul kernels, embedding tables), but
never a mixture-of-experts router's kernel (read in float32: :func:`asyncrl.model.moe.is_router_weight`,
so the engine routes as the trainer does), and the model uses the others only through a cast to
the compute dtype (``nnx.Linear``/``nnx.Embed`` with
``dtype=compute``, the tied lm head's ``astype``), so the programs see the same values; the
engine's log-probs stay the trainer's (tested bitwise on a decode chunk). One-dimensional leaves
(norm weights, biases: a few KB) are left as they are, whatever a model does with them in
float32. Trees with LoRA adapters are left alone (an adapter's own dtype rules apply).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from asyncrl.model.moe import is_router_weight


def needs_serving_copy(params: Any, compute_dtype: Any) -> bool:
    """Whether any leaf :func:`serving_copy` would cast exists (and the tree has no LoRA adapters)."""
    paths = jax.tree_util.tree_leaves_with_path(params)
    if any("lora" in jax.tree_util.keystr(path) for path, _ in paths):
        return False
    return any(_cast_leaf(path, x, compute_dtype) for path, x in paths)


def _cast_leaf(path: tuple, x: Any, compute_dtype: Any) -> bool:
    return (jnp.ndim(x) >= 2 and jnp.issubdtype(jnp.result_type(x), jnp.floating) and jnp.result_type(x) != compute_dtype
            and not is_router_weight(path))


@functools.partial(jax.jit, static_argnums=1)
def _cast(params: Any, compute_dtype: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(compute_dtype) if _cast_leaf(path, x, compute_dtype) else x, params)


def serving_copy(params: Any, compute_dtype: Any) -> Any:
    """``params`` with every floating leaf of two or more dimensions in ``compute_dtype`` (new
    arrays on the same devices and shardings; the others are the same arrays), or ``params``
    itself when nothing would change (:func:`needs_serving_copy`)."""
    compute_dtype = jnp.dtype(compute_dtype)
    if not needs_serving_copy(params, compute_dtype):
        return params
    return _cast(params, compute_dtype)
