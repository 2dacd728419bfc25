"""cuDNN's packed layout for packed rows (sequence packing), beside :mod:`asyncrl.model.attention`,
which picks it: the layout of a row's segments (:func:`cudnn_segments`), the call
(:func:`cudnn_packed_attention`), when it is not available (:func:`cudnn_packed_unavailable`), and
jax's cuDNN capability check answering for compile-only GPUs (:func:`cudnn_checks_for`).

jax's cuDNN attention takes packed rows as ``q_offsets`` / ``kv_offsets`` with per-segment lengths
and a static bound on segments per row (``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``);
it needs a Hopper or later GPU. Each run of equal segment id in a row is one cuDNN segment: the
row's sequences, and its padding as a run of its own, so every position is attended and written.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp


def cudnn_packed_unavailable(segments: int) -> Optional[str]:
    """Why packed rows cannot take cuDNN's packed layout here (None: they can): the program names no
    bound on sequences per row (``segments`` 0), or the GPU compiled for is older than Hopper
    (jax's cuDNN packed layout needs compute capability 9.0)."""
    if not segments:
        return "the program names no bound on sequences per row (compiled_for(segments=...))"
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_compute_capability

        hopper = check_compute_capability("9.0")
    except Exception:  # noqa: BLE001 - no CUDA backend here and no compile-only GPU target
        hopper = False
    return None if hopper else "cuDNN's packed layout needs a Hopper or later GPU (compute capability 9.0)"


def cudnn_segments(segment_ids: jax.Array, segments: int) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed layout of ``segment_ids`` int32 ``[B, T]`` (packing's ids, 0 = padding):
    ``(lengths [B, M], offsets [B, M + 1])`` int32 with ``M = segments + 1``. Each run of equal ids
    is one cuDNN segment: a row's sequences, and its padding as a run of its own, so every position
    is attended and written (a padding run attends itself causally; its outputs never reach a real
    token), as in ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``: a row's
    segment offsets from its start, then ``-1``; lengths likewise. A row of more than ``M`` runs
    would lose the rest: the packer never puts more than ``segments`` sequences in a row
    (:func:`asyncrl.rollout.packing.first_fit_decreasing`'s ``max_items``)."""
    b, t = segment_ids.shape
    runs = segments + 1
    ids = segment_ids.astype(jnp.int32)
    previous = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), ids[:, :-1]], axis=1)
    starts = jax.vmap(lambda row: jnp.nonzero(row, size=runs, fill_value=-1)[0])(ids != previous).astype(jnp.int32)
    following = jnp.concatenate([starts[:, 1:], jnp.full((b, 1), -1, jnp.int32)], axis=1)
    ends = jnp.where(following < 0, t, following)
    lengths = jnp.where(starts >= 0, ends - starts, -1).astype(jnp.int32)
    offsets = jnp.concatenate([starts, jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return lengths, offsets


def cudnn_packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, window: Optional[int],
                           scale: float, segments: int, row_sharding: Any = None) -> jax.Array:
    """cuDNN flash attention of packed rows, ``q [B, T, heads, D]`` over ``k, v [B, T, kv_heads, D]``
    with ``segment_ids`` int32 ``[B, T]``: cuDNN's packed layout (:func:`cudnn_segments`), causal
    within each segment (and ``window``), no mask operand. ``row_sharding``: the lengths' and
    offsets' sharding (rows as q's), or None."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dot_product_attention

    lengths, offsets = cudnn_segments(segment_ids, segments)
    if row_sharding is not None:
        lengths, offsets = (jax.lax.with_sharding_constraint(x, row_sharding) for x in (lengths, offsets))
    return cudnn_dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
                                       scale=scale, mask_type=MaskType.PADDING_CAUSAL, sliding_window_length=window)


class _CapabilityOverride:
    """jax's cuDNN capability check answering for a compile-only target while programs for it are
    traced (nested and from several threads: the original is restored when the last one leaves)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._original: Any = None

    @contextlib.contextmanager
    def answering(self, capability: str) -> Iterator[None]:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn_checks

        target = tuple(int(x) for x in capability.split("."))
        with self._lock:
            if self._depth == 0:
                self._original = cudnn_checks.check_compute_capability
                cudnn_checks.check_compute_capability = lambda wanted: target >= tuple(int(x) for x in wanted.split("."))
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    cudnn_checks.check_compute_capability = self._original


_CAPABILITY = _CapabilityOverride()


@contextlib.contextmanager
def cudnn_checks_for(mesh: Any) -> Iterator[None]:
    """Where ``mesh``'s devices are compile-only GPUs (``asyncrl plan --target h100`` on a CPU),
    jax's cuDNN checks answer for their compute capability. Those checks read this process's own
    GPU (none here: packed layouts and head_dim 256 would be refused as pre-Hopper), while the
    program is compiled for the target's. A process with a GPU of its own is left as it is."""
    capability = _compile_only_capability(mesh)
    if capability is None:
        yield
        return
    with _CAPABILITY.answering(capability):
        yield


def _compile_only_capability(mesh: Any) -> Optional[str]:
    """The compute capability of ``mesh``'s GPUs when they are compile-only (this process has no
    GPU backend), else None."""
    if mesh is None:
        return None
    device = mesh.devices.flat[0]
    capability = getattr(device, "compute_capability", None)
    if str(device.platform).lower() not in ("cuda", "gpu") or not capability:
        return None
    try:
        local = jax.devices()[0].platform
    except RuntimeError:
        local = "cpu"
    return None if local in ("gpu", "cuda") else str(capability)
