"""Attention over several new tokens (training, scoring, prefill) by ``model.attention``'s kernel,
with the mask given to each kernel as its own structure, never as a dense ``[T, T]`` operand.

A cache-free attention (and a prefill into an empty cache, which attends only within its own
tokens) is described by :class:`SelfAttentionMask`: which keys are real (``key_valid [B, T]``),
packing's ``segment_ids [B, T]`` (or None), and Gemma 3's sliding ``window`` (static). Its rule is
the decoder's: query ``t`` attends key ``s`` iff ``s <= t``, key ``s`` is real, both lie in one
packed segment, and ``t - s < window``. The kernels:

* ``reference`` / ``xla``: the dense boolean mask built from the structure (:meth:`SelfAttentionMask.dense`),
  by asyncrl's einsum or ``jax.nn.dot_product_attention(implementation="xla")``;
* ``cudnn`` (GPUs, bfloat16/float16 compute): cuDNN's flash attention through
  ``jax.nn.dot_product_attention(implementation="cudnn")`` in its causal mode with per-row sequence
  lengths (``key_valid.sum(-1)``: a row's real tokens are its first ones, as in every right-padded
  row asyncrl builds, training batches and prefill plans alike) and
  the window as ``local_window_size``. Packed rows go through cuDNN's packed layout
  (``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` with ``q_offsets`` /
  ``kv_offsets``): each row's runs of equal segment id (its sequences, and its padding as a run of
  its own) become cuDNN segments, at most a static bound per row (:class:`KernelTarget`'s
  ``segments``, the packing's bound, plus the padding run), each attended causally on its own
  (:func:`asyncrl.model.cudnn_packed.cudnn_segments`). A program that names no bound gives cuDNN packed rows as the dense
  mask (its bias form), said once in the log;
* ``splash`` (TPUs): Pallas' splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``)
  with a ``CausalMask`` (``LocalMask`` for a window) and ``SegmentIds``: the packed segment ids,
  or the padding mask as ids (real tokens 1, padding 0), so a real query sees exactly the real
  keys of its own segment before it. Its sequence length is padded to a multiple of the block
  (128) with keys of an id of their own. Under a mesh it runs per device in a ``shard_map``
  (rows over ``data x fsdp``, heads over ``tensor``): Mosaic kernels are not partitioned by XLA.
  On the CPU it runs in Pallas' interpret mode (tests).

Padding queries (``key_valid`` false) attend differently per kernel (uniform weights, their own
padding, or zeros); their outputs never reach a real token and are never scored.

``model.attention: auto`` picks the kernel of the platform the program is compiled for:
:func:`compiled_for` (the train step enters it with its mesh; the engine's programs with its
devices: its mesh, or their platform and count) names the devices, else this process's default backend. So compiling for a compile-only
``h100`` or ``v6e-8`` target on a CPU gets the target's kernel. A model or shape a kernel cannot
take falls back to ``xla`` with one log line naming why (:func:`attention_kernel`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp

from asyncrl.model.blocks import sliding_window_mask
from asyncrl.model.cudnn_packed import cudnn_checks_for, cudnn_packed_attention, cudnn_packed_unavailable
from asyncrl.model.decode_attention import kernel_block, pallas_decode_attention
from asyncrl.model.kv_cache import LayerKV

log = logging.getLogger(__name__)

_MASKED = -1e30  # finite, so fully masked rows (pads) give uniform weights, never NaN
_SIXTEEN_BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SPLASH_BLOCK = 128  # the splash kernel's lane width: sequence blocks are multiples of it
_CUDNN_MAX_HEAD_DIM = 128  # cuDNN flash attention's head_dim limit before Hopper (256 from Hopper on)
_ROW_AXES = ("data", "fsdp")  # the mesh axes batch rows are split over (asyncrl.cluster.mesh.ROW_AXES)


@dataclasses.dataclass(frozen=True)
class SelfAttentionMask:
    """The mask of attention among one call's own tokens, as structure (module docstring).

    ``key_valid`` bool ``[B, T]`` (the attention mask), ``segment_ids`` int32 ``[B, T]`` (packed
    rows, 0 = padding; None unpacked), ``window`` (static; None: no sliding window)."""

    key_valid: jax.Array
    segment_ids: Optional[jax.Array] = None
    window: Optional[int] = None

    def dense(self) -> jax.Array:
        """bool ``[B, T, T]``: causal, real keys, same segment, within the window."""
        t = self.key_valid.shape[1]
        index = jnp.arange(t)
        mask = (index[None, :, None] >= index[None, None, :]) & self.key_valid[:, None, :]
        if self.segment_ids is not None:
            mask = mask & (self.segment_ids[:, :, None] == self.segment_ids[:, None, :])
        if self.window is not None:
            mask = sliding_window_mask(mask, index[None, :], index, self.window)
        return mask

    def kernel_segments(self) -> jax.Array:
        """int32 ``[B, T]``: the ids a segment-aware kernel takes (packing's, or real 1 / padding 0)."""
        if self.segment_ids is not None:
            return self.segment_ids.astype(jnp.int32)
        return self.key_valid.astype(jnp.int32)

    def with_window(self, window: Optional[int]) -> "SelfAttentionMask":
        return dataclasses.replace(self, window=window)


jax.tree_util.register_dataclass(SelfAttentionMask, data_fields=["key_valid", "segment_ids"], meta_fields=["window"])


# --------------------------------------------------------------------------- the target


@dataclasses.dataclass(frozen=True)
class KernelTarget:
    """What the program is compiled for: the devices' platform (``cpu``, ``gpu``, ``tpu``), the
    mesh the kernel's ``shard_map`` runs on (None: no mesh known), without a mesh how many
    devices the program spans (0: not known, taken as this process's device count), and the bound
    on packed sequences per row of its batches."""

    platform: str
    mesh: Any = None
    devices: int = 0
    segments: int = 0
    """The most packed sequences one row of the program's batches holds (0: not known): the static
    bound cuDNN's packed layout needs (:mod:`asyncrl.model.cudnn_packed`)."""


_TARGET: contextvars.ContextVar[Optional[KernelTarget]] = contextvars.ContextVar("asyncrl_attention_target", default=None)


def device_platform(device: Any) -> str:
    """``cpu``, ``gpu`` (CUDA), ``rocm`` or ``tpu`` for a (possibly compile-only) device."""
    platform = str(device.platform).lower()
    if platform in ("cuda", "gpu"):
        try:
            version = str(device.client.platform_version).lower()
        except Exception:  # noqa: BLE001 - compile-only devices may have no client: CUDA is what they target
            version = ""
        return "rocm" if "rocm" in version else "gpu"
    return platform


@contextlib.contextmanager
def compiled_for(mesh: Any = None, platform: Optional[str] = None, devices: int = 0, segments: int = 0) -> Iterator[None]:
    """Within it, ``model.attention: auto`` picks the kernel of ``mesh``'s devices (or of
    ``platform``: ``cpu``, ``gpu``, ``tpu``, on ``devices`` devices), the splash kernel runs
    on ``mesh``, and packed rows hold at most ``segments`` sequences (cuDNN's packed layout; 0: not
    known). Enter it inside the traced function, from its static arguments, so that a cached
    trace always saw the same target. Neither given: no change (this process's default backend)."""
    if mesh is not None:
        platform = device_platform(mesh.devices.flat[0])
    if platform is None:
        yield
        return
    token = _TARGET.set(KernelTarget(platform, mesh, devices, segments))
    try:
        with cudnn_checks_for(mesh):
            yield
    finally:
        _TARGET.reset(token)


def current_target() -> KernelTarget:
    """The target of the innermost :func:`compiled_for`, else this process's default backend (no mesh)."""
    target = _TARGET.get()
    if target is not None:
        return target
    return KernelTarget(device_platform(jax.devices()[0]))


# --------------------------------------------------------------------------- the choice


_LOGGED: set[str] = set()


def _fallback(why: str) -> str:
    """``xla``, logging ``why`` once per process."""
    if why not in _LOGGED:
        _LOGGED.add(why)
        log.warning("model.attention: auto -> xla: %s", why)
    return "xla"


def attention_kernel(choice: str, dtype: Any, head_dim: int, *, packed: bool = False, window: Optional[int] = None,
                     target: Optional[KernelTarget] = None, decode: bool = False) -> str:
    """The one switch: the kernel of ``model.attention`` (``choice``) for ``dtype`` activations on the
    platform compiled for. Several new tokens: ``reference``, ``xla``, ``cudnn`` or ``splash``;
    ``auto`` is cuDNN on CUDA GPUs with bfloat16/float16 compute, splash on TPUs, XLA's on the CPU
    (and wherever the kernel cannot take the model: one log line says why); an explicit ``cudnn``
    or ``splash`` is checked, not second-guessed. One new token over a cache (``decode``):
    ``pallas`` (the GPU decode kernel, :mod:`asyncrl.model.decode_attention`, on CUDA lowerings; the
    einsum path on others) unless ``choice`` is ``xla`` or ``reference``, which decode by einsum
    everywhere (``einsum``). One switch for both caches: the contiguous one
    (:func:`cached_attention`) and the engine's pages (:mod:`asyncrl.model.paged_attention`, whose
    GPU kernel is the paged one); on TPUs the contiguous cache decodes by einsum over its
    positions-first layout, and the pages by JAX's ``ragged_paged_attention``."""
    if decode:
        return "einsum" if choice in ("xla", "reference") else "pallas"
    target = target or current_target()
    dtype = jnp.dtype(dtype)
    if choice == "cudnn" and dtype not in _SIXTEEN_BIT:
        raise ValueError(f"model.attention 'cudnn' needs bfloat16 or float16 compute (model.compute_dtype), "
                         f"not {dtype.name}; use 'xla' or 'auto'")
    if choice != "auto":
        return choice
    if target.platform == "gpu":
        if dtype not in _SIXTEEN_BIT:
            return _fallback(f"cuDNN flash attention needs bfloat16/float16 compute, not {dtype.name}")
        if head_dim % 8 or head_dim > _cudnn_max_head_dim():
            return _fallback(f"cuDNN flash attention takes head_dim <= {_cudnn_max_head_dim()} in multiples of 8, "
                             f"not {head_dim}")
        return "cudnn"
    if target.platform == "tpu":
        # The target's own count: compiling for 8 chips from a CPU process sees one local device.
        if target.mesh is None and (target.devices or jax.device_count()) > 1:
            return _fallback("splash attention runs per device in a shard_map, and this program names no mesh")
        return "splash"
    return "xla"


def _cudnn_max_head_dim() -> int:
    """256 where jax sees a Hopper or later GPU, else 128 (also when compiling for one elsewhere:
    jax checks the local device's compute capability)."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_compute_capability

        return 256 if check_compute_capability("9.0") else _CUDNN_MAX_HEAD_DIM
    except Exception:  # noqa: BLE001 - no CUDA backend here
        return _CUDNN_MAX_HEAD_DIM


# --------------------------------------------------------------------------- the kernels


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: SelfAttentionMask, scale: Optional[float],
                    mesh: Any = None, segments: int = 0) -> jax.Array:
    """cuDNN flash attention of ``q [B, T, heads, D]`` over ``k, v [B, T, kv_heads, D]``: causal with
    each row's length (real tokens first: right padding), the window as cuDNN's sliding window;
    packed rows in cuDNN's packed layout with at most ``segments`` sequences per row
    (:mod:`asyncrl.model.cudnn_packed`; 0: not known, the dense mask). ``mesh``: the program's (the trainer's),
    over which q, k and v are laid out alike (:func:`_alike_on`)."""
    q, k, v = _alike_on(mesh, q, k, v)
    window = None if mask.window is None else (mask.window - 1, 0)
    if mask.segment_ids is not None:
        why = cudnn_packed_unavailable(segments)
        if why is not None:
            if why not in _LOGGED:
                _LOGGED.add(why)
                log.warning("model.attention: cudnn on packed rows takes the mask as a dense bias: %s", why)
            return jax.nn.dot_product_attention(q, k, v, mask=mask.dense()[:, None], scale=scale, implementation="cudnn")
        rows = None
        if mesh is not None:
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            rows = NamedSharding(mesh, P(_ROW_AXES if row_shards_divide(mesh, q.shape[0]) else None, None))
        return cudnn_packed_attention(q, k, v, mask.segment_ids, mask.window, q.shape[-1] ** -0.5 if scale is None else scale,
                                      segments, rows)
    # cuDNN's lengths count from position 0: a row's real tokens must be its first ones. Every
    # row asyncrl builds is right-padded (the TrainBatch contract, the engine's prefill plans), so
    # the lengths are exact and no per-layer gather is needed to move real tokens to the front.
    # At least 1: a padding row (no real token) attends its first position, never an empty set
    # (whose softmax a kernel may leave NaN, and NaN times a zero cotangent is NaN).
    lengths = jnp.maximum(mask.key_valid.sum(axis=1), 1).astype(jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, query_seq_lengths=lengths,
                                        key_value_seq_lengths=lengths, local_window_size=window, implementation="cudnn")


def _alike_on(mesh: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``q, k, v`` constrained to one sharding on ``mesh`` (None: unchanged): rows over ``data x
    fsdp`` where they divide, heads over ``tensor`` where both head counts divide. cuDNN's
    partitioner refuses q, k and v sharded differently ("Query, key and value should have same
    sharding"), which XLA's propagation gives GQA's q and k/v under fsdp (8 GPUs, Qwen3-1.7B)."""
    if mesh is None:
        return q, k, v
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rows = _ROW_AXES if row_shards_divide(mesh, q.shape[0]) else None
    layout = NamedSharding(mesh, P(rows, None, _heads_axis(mesh, q.shape[2], k.shape[2]), None))
    constrain = functools.partial(jax.lax.with_sharding_constraint, shardings=layout)
    return constrain(q), constrain(k), constrain(v)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: SelfAttentionMask, scale: Optional[float],
                     mesh: Any = None, interpret: bool = False) -> jax.Array:
    """Splash attention of ``q [B, T, heads, D]`` over ``k, v [B, T, kv_heads, D]`` with the mask's
    causal (or local) structure and segment ids; ``mesh``: run per device in a ``shard_map``
    (rows over ``data x fsdp``, heads over ``tensor`` where they divide). ``interpret``: Pallas'
    interpret mode (CPU)."""
    b, t, heads, d = q.shape
    scale = d**-0.5 if scale is None else scale
    segments = mask.kernel_segments()
    padded = -(-t // _SPLASH_BLOCK) * _SPLASH_BLOCK
    if padded != t:  # keys past T get an id no real query has
        pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        segments = jnp.pad(segments, ((0, 0), (0, padded - t)), constant_values=-1)
    q = (q * jnp.asarray(scale, q.dtype)).swapaxes(1, 2)  # [B, heads, T, D]: the kernel's layout
    k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)

    def per_device(q, k, v, segments):
        kernel = _splash_kernel(q.shape[1], padded, mask.window, interpret)
        from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

        return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=SegmentIds(s, s)))(q, k, v, segments)

    if mesh is None:
        out = per_device(q, k, v, segments)
    else:
        from jax.sharding import PartitionSpec as P

        qkv, rows = P(_ROW_AXES, _heads_axis(mesh, heads, k.shape[1]), None, None), P(_ROW_AXES, None)
        out = jax.shard_map(per_device, mesh=mesh, in_specs=(qkv, qkv, qkv, rows), out_specs=qkv,
                            check_vma=False)(q, k, v, segments)
    return out.swapaxes(1, 2)[:, :t]


@functools.lru_cache(maxsize=64)
def _splash_kernel(heads: int, length: int, window: Optional[int], interpret: bool) -> Any:
    """The splash kernel for ``heads`` query heads over ``length`` tokens (a multiple of 128),
    causal or, with ``window``, local (``t - window < s <= t``); built once per shape (its mask
    tables are computed in numpy)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (length, length)
    one = splash.CausalMask(shape) if window is None else splash.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    block = max(size for size in (512, 256, 128) if length % size == 0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    with jax.ensure_compile_time_eval():  # its tables are constants, never tracers of the first trace
        return splash.make_splash_mha(splash.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=1,
                                      q_seq_shards=1, interpret=interpret)


def _heads_axis(mesh: Any, heads: int, kv_heads: int) -> Optional[str]:
    """``tensor`` where it divides both head counts (the fused kernels' q and k/v split alike), else None."""
    tensor = mesh.shape.get("tensor", 1)
    return "tensor" if heads % tensor == 0 and kv_heads % tensor == 0 else None


def row_shards_divide(mesh: Any, rows: int) -> bool:
    """Whether ``rows`` split evenly over the mesh's row axes (a ``shard_map`` needs it)."""
    if mesh is None:
        return True
    shards = 1
    for axis in _ROW_AXES:
        shards *= mesh.shape.get(axis, 1)
    return rows % shards == 0


# --------------------------------------------------------------------------- attention, over a cache or not


def einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, kv_spec: str,
                      scale: Optional[float] = None) -> jax.Array:
    """Grouped-query attention by einsum with keys and values laid out as ``kv_spec`` says:
    ``bskd`` (``[B, S, kv_heads, D]``) or ``bksd`` (the cache's ``[B, kv_heads, S, D]``); the
    same float32 scores and softmax, in the same order, either way. Scores scale by ``scale``
    (None: ``head_dim ** -0.5``)."""
    b, t, heads, d = q.shape
    kv_heads = k.shape[kv_spec.index("k")]
    q = q.reshape(b, t, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum(f"btkgd,{kv_spec}->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5 if scale is None else scale)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum(f"bkgts,{kv_spec}->btkgd", probs, v).reshape(b, t, heads, d)


def cached_attention(q, k, v, mask, cache: LayerKV, write_idx, choice: str,
                     scale: Optional[float] = None) -> tuple[jax.Array, LayerKV]:
    """Attention of ``q [B, T, heads, D]`` over a layer's cache after writing the new ``k, v``
    ``[B, T, kv_heads, D]`` into it at ``write_idx`` int32 [B, T] (indices past the capacity are
    dropped); ``mask`` bool [B, T, capacity], or a :class:`~asyncrl.model.attention.SelfAttentionMask`
    when the cache was empty before the call (a prefill: the new tokens attend only among
    themselves, by the fused kernel where there is one). Returns ``(out [B, T, heads, D], the updated
    LayerKV)``.

    One new token (a decode step) attends straight on the cache in its layout: by the GPU decode
    kernel where :func:`attention_kernel` picks it (``bksd``, :func:`_decode_kernel`), else by
    :func:`einsum_attention` (``bksd``: batch and head dims lead and head_dim is minor, the layout
    XLA's batched dot wants; ``bskd`` on TPUs: positions-first keys); no transposed copy of the cache
    is made per step. Several new tokens (prefill into a cache) go through
    ``model.attention``'s implementation (``choice``) on a transposed view, once per call.
    (A paged cache goes to :func:`asyncrl.model.paged_attention.paged_attention` instead.)
    """
    layout = cache.layout
    if isinstance(mask, SelfAttentionMask):  # an empty cache (prefill): the call's tokens attend among themselves
        cache_k, cache_v = _scatter(k, v, cache.k, cache.v, write_idx, layout)
        k, v = k.astype(cache.k.dtype).astype(q.dtype), v.astype(cache.v.dtype).astype(q.dtype)
        return attend(q, k, v, mask, choice, kv_spec="bskd", scale=scale), LayerKV(cache_k, cache_v, layout)
    reference = functools.partial(_scatter_and_attend, choice=choice, scale=scale, layout=layout)
    if q.shape[1] == 1 and layout == "bksd" and attention_kernel(choice, q.dtype, q.shape[-1], decode=True) == "pallas":
        out, cache_k, cache_v = _decode_kernel(q, k, v, cache.k, cache.v, write_idx[:, 0], mask, scale, reference)
        return out, LayerKV(cache_k, cache_v, layout)
    out, cache_k, cache_v = reference(q, k, v, cache.k, cache.v, write_idx, mask)
    return out, LayerKV(cache_k, cache_v, layout)


def _scatter(k, v, cache_k, cache_v, write_idx, layout: str = "bksd") -> tuple[jax.Array, jax.Array]:
    """The new ``k, v`` ``[B, T, kv_heads, D]`` written into a layer's caches (``layout``) at
    ``write_idx`` (int32 [B, T], or [B] for one token; indices past the capacity are dropped)."""
    if write_idx.ndim == 1:
        write_idx = write_idx[:, None]
    rows = jnp.arange(write_idx.shape[0])[:, None]
    # bksd: advanced indices around the head slice, so the indexed block is [B, T, kv_heads, D], as k is.
    where = (rows, slice(None), write_idx) if layout == "bksd" else (rows, write_idx)
    cache_k = cache_k.at[where].set(k.astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[where].set(v.astype(cache_v.dtype), mode="drop")
    return cache_k, cache_v


def _scatter_and_attend(q, k, v, cache_k, cache_v, write_idx, mask, choice: str = "reference",
                        scale: Optional[float] = None, layout: str = "bksd") -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`cached_attention` by XLA: the new ``k, v`` scattered into the cache (:func:`_scatter`),
    then attention over it. Returns ``(out, cache_k, cache_v)``."""
    cache_k, cache_v = _scatter(k, v, cache_k, cache_v, write_idx, layout)
    out = attend(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype), mask, choice, kv_spec=layout, scale=scale)
    return out, cache_k, cache_v


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: Any, choice: str, kv_spec: str,
            scale: Optional[float] = None) -> jax.Array:
    """Attention by ``model.attention``'s kernel (``choice``) for several query tokens, by einsum
    (:func:`einsum_attention`) for one; ``k, v`` laid out as ``kv_spec`` says (``bskd``, or the
    cache's ``bksd``, which ``jax.nn.dot_product_attention`` gets transposed). ``mask``: a
    :class:`~asyncrl.model.attention.SelfAttentionMask` (attention among the call's own tokens,
    ``bskd``), which the fused kernels take as their own mask structure, or a bool ``[B, T, S]``
    over a cache (the einsum and XLA paths)."""
    if q.shape[1] == 1:
        return einsum_attention(q, k, v, mask.dense() if isinstance(mask, SelfAttentionMask) else mask, kv_spec, scale)
    target = current_target()
    implementation = attention_kernel(choice, q.dtype, q.shape[-1], target=target)
    if isinstance(mask, SelfAttentionMask):
        packed = mask.segment_ids is not None
        if implementation == "cudnn":
            _seen(("cudnn dense bias" if cudnn_packed_unavailable(target.segments) else "cudnn packed layout") if packed
                  else "cudnn row lengths")
            return cudnn_attention(q, k, v, mask, scale, mesh=target.mesh, segments=target.segments)
        if implementation == "splash" and row_shards_divide(target.mesh, q.shape[0]):
            _seen("splash segment ids" if packed else "splash")
            return splash_attention(q, k, v, mask, scale, mesh=target.mesh, interpret=target.platform != "tpu")
        mask = mask.dense()
    if implementation == "reference":
        _seen("reference einsum")
        return einsum_attention(q, k, v, mask, kv_spec, scale)
    if kv_spec == "bksd":
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
    # Over a cache (a dense mask) splash has no form; cuDNN takes the mask as its bias.
    kernel: Any = "cudnn" if implementation == "cudnn" else "xla"
    _seen(f"{kernel} dense mask")
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation=kernel)


_KERNELS_SEEN: contextvars.ContextVar[Optional[set[str]]] = contextvars.ContextVar("asyncrl_attention_seen", default=None)


@contextlib.contextmanager
def kernels_seen() -> Iterator[set[str]]:
    """The kernels the several-token attention of the programs traced within it took, by name
    (``cudnn row lengths``, ``cudnn packed layout``, ``splash``, ``splash segment ids``, ``xla
    dense mask``, ...): what ``asyncrl plan --target`` reports for each program."""
    seen: set[str] = set()
    token = _KERNELS_SEEN.set(seen)
    try:
        yield seen
    finally:
        _KERNELS_SEEN.reset(token)


def _seen(kernel: str) -> None:
    seen = _KERNELS_SEEN.get()
    if seen is not None:
        seen.add(kernel)


def _decode_kernel(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k: jax.Array, v: jax.Array,
                   write_pos: jax.Array, mask: jax.Array, scale: Optional[float], reference: Any):
    """One query token per row: ``q [B, 1, heads, D]`` and its ``k_new, v_new [B, 1, kv_heads, D]``
    written into a layer's cache ``k, v [B, kv_heads, S, D]`` at ``write_pos`` int32 [B] (dropped
    past ``S``), then attended under ``mask`` bool ``[B, 1, S]``. Returns ``(out [B, 1, heads, D], k, v)``.
    ``reference`` (same arguments and result) is the scatter-and-einsum path, which other lowerings
    than CUDA's take (``jax.lax.platform_dependent`` picks when the program is lowered, so a program
    compiled for an H100 on a CPU-only machine gets the kernel); ``scale`` None is
    ``head_dim ** -0.5``. Under a mesh (:func:`compiled_for`: the engine's own) the kernel runs per
    device in a ``shard_map``, rows over ``data x fsdp`` and KV heads (with their query heads) over
    ``tensor``: XLA does not partition a Pallas call, it would gather the whole cache around it."""
    heads, d = q.shape[2], q.shape[3]
    kv_heads = k.shape[1]
    if kernel_block(k.shape[2], d) is None or heads % kv_heads:  # a shape the kernel does not take
        return reference(q, k_new, v_new, k, v, write_pos, mask)
    scale = d**-0.5 if scale is None else scale

    def kernel(q, k_new, v_new, k, v, write_pos, mask):
        out, k, v = pallas_decode_attention(q[:, 0], k_new[:, 0], v_new[:, 0], k, v, write_pos, mask[:, 0], scale)
        return out[:, None], k, v

    mesh = current_target().mesh
    if mesh is not None and mesh.size > 1:
        split = _split_specs(mesh, q.shape[0], heads, kv_heads)
        if split is None:
            return reference(q, k_new, v_new, k, v, write_pos, mask)
        tokens, cache, rows, row_mask = split
        kernel = jax.shard_map(kernel, mesh=mesh, in_specs=(tokens, tokens, tokens, cache, cache, rows, row_mask),
                               out_specs=(tokens, cache, cache), check_vma=False)
    return jax.lax.platform_dependent(q, k_new, v_new, k, v, write_pos, mask, cuda=kernel, default=reference)


def _split_specs(mesh, rows: int, heads: int, kv_heads: int):
    """The kernel's ``shard_map`` specs on ``mesh``: (the new tokens' ``[B, 1, heads, D]``, the cache's
    ``[B, kv_heads, S, D]``, the write positions' ``[B]``, the mask's ``[B, 1, S]``); None when the
    rows or the heads do not split evenly (the einsum path then)."""
    from jax.sharding import PartitionSpec as P

    replicas = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    tensor = mesh.shape.get("tensor", 1)
    if rows % replicas or heads % tensor or kv_heads % tensor:
        return None
    row = ("data", "fsdp") if replicas > 1 else None
    head = "tensor" if tensor > 1 else None
    return P(row, None, head, None), P(row, head, None, None), P(row), P(row, None, None)

