"""Attention over several new tokens (training, scoring, prefill) by ``model.attention``'s kernel,
with the mask given to each kernel as its own structure, never as a dense ``[T, T]`` operand.

A cache-free attention (and a prefill into an empty cache, which attends only within its own
tokens) is described by :class:`SelfAttentionMask`: which keys are real (``key_valid [B, T]``),
packing's ``segment_ids [B, T]`` (or None), and Gemma 3's sliding ``window`` (static). Its rule is
the decoder's: query ``t`` attends key ``s`` iff ``s <= t``, key ``s`` is real, both lie in one
packed segment, and ``t - s < window``. The kernels:

* ``reference`` / ``xla``: the dense boolean mask built from the structure (:meth:`SelfAttentionMask.dense`),
  by asyncrl's einsum or ``jax.nn.dot_product_attention(implementation="xla")``, as before;
* ``cudnn`` (GPUs, bfloat16/float16 compute): cuDNN's flash attention through
  ``jax.nn.dot_product_attention(implementation="cudnn")`` in its causal mode with per-row sequence
  lengths (``key_valid.sum(-1)``: a row's real tokens are its first ones, as in every right-padded
  row asyncrl builds, training batches and prefill plans alike) and
  the window as ``local_window_size``. Packed rows have no lengths form there:
  cuDNN's own packed layout needs a static bound on segments per row, so packed rows give cuDNN
  the dense mask (its bias form), said once in the log;
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
:func:`compiled_for` (the train step enters it with its mesh; the engine's prefill with its
layout) names the devices, else this process's default backend. So compiling for a compile-only
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

log = logging.getLogger(__name__)

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
    mesh the kernel's ``shard_map`` runs on (None: no mesh known) and, without a mesh, how many
    devices the program spans (0: not known, taken as this process's device count)."""

    platform: str
    mesh: Any = None
    devices: int = 0


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


def kernel_target_of(array: Any) -> KernelTarget:
    """The target of a program over ``array``'s devices with no mesh of its own (the engine's
    prefill and beam search): their platform and count, compile-only devices included."""
    devices = array.sharding.device_set
    return KernelTarget(device_platform(next(iter(devices))), devices=len(devices))


@contextlib.contextmanager
def compiled_for(mesh: Any = None, platform: Optional[str] = None, devices: int = 0) -> Iterator[None]:
    """Within it, ``model.attention: auto`` picks the kernel of ``mesh``'s devices (or of
    ``platform``: ``cpu``, ``gpu``, ``tpu``, on ``devices`` devices), and the splash kernel runs
    on ``mesh``. Enter it inside the traced function, from its static arguments, so that a cached
    trace always saw the same target. Neither given: no change (this process's default backend)."""
    if mesh is not None:
        platform = device_platform(mesh.devices.flat[0])
    if platform is None:
        yield
        return
    token = _TARGET.set(KernelTarget(platform, mesh, devices))
    try:
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
                     target: Optional[KernelTarget] = None) -> str:
    """The kernel of ``model.attention`` (``choice``) for ``dtype`` activations: ``reference``,
    ``xla``, ``cudnn`` or ``splash``. ``auto``: cuDNN on CUDA GPUs with bfloat16/float16 compute,
    splash on TPUs, XLA's on the CPU (and wherever the kernel cannot take the model: one log line
    says why). An explicit ``cudnn`` or ``splash`` is checked, not second-guessed."""
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
                    mesh: Any = None) -> jax.Array:
    """cuDNN flash attention of ``q [B, T, heads, D]`` over ``k, v [B, T, kv_heads, D]``: causal with
    each row's length (real tokens first: right padding), the window as cuDNN's sliding window; packed rows
    with the dense mask (module docstring). ``mesh``: the program's (the trainer's), over which q, k
    and v are laid out alike (:func:`_alike_on`)."""
    q, k, v = _alike_on(mesh, q, k, v)
    if mask.segment_ids is not None:
        if "cudnn-packed" not in _LOGGED:
            _LOGGED.add("cudnn-packed")
            log.warning("model.attention: cudnn on packed rows takes the mask as a dense bias (cuDNN's packed layout "
                        "needs a static bound on segments per row)")
        return jax.nn.dot_product_attention(q, k, v, mask=mask.dense()[:, None], scale=scale, implementation="cudnn")
    # cuDNN's lengths count from position 0: a row's real tokens must be its first ones. Every
    # row asyncrl builds is right-padded (the TrainBatch contract, the engine's prefill plans), so
    # the lengths are exact and no per-layer gather is needed to move real tokens to the front.
    # At least 1: a padding row (no real token) attends its first position, never an empty set
    # (whose softmax a kernel may leave NaN, and NaN times a zero cotangent is NaN).
    lengths = jnp.maximum(mask.key_valid.sum(axis=1), 1).astype(jnp.int32)
    window = None if mask.window is None else (mask.window - 1, 0)
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
