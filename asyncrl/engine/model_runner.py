"""The model runner of :class:`~asyncrl.engine.jax_engine.JaxEngine`: everything on the devices.

It owns the engine's device state (the KV page pool, every replica's pages), the serving copy of
the weights and their shardings on the engine's mesh, and it calls the jitted programs
(:mod:`asyncrl.engine.jax_programs`, :mod:`asyncrl.engine.beam_search`) with host plans the
scheduler builds. It knows nothing of
requests: the scheduler (:mod:`asyncrl.engine.scheduler`) decides what runs, the KV cache manager
(:mod:`asyncrl.engine.kv_cache_manager`) where it lies, and this runs it.

Only the scheduler thread calls its programs; the constructor and :meth:`install` make the
serving copy (the previous one dropped first, so a device never holds two at once).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.config import EngineConfig
from asyncrl.engine.beam_search import beam_search_jit
from asyncrl.engine.device_copy import serving_copy
from asyncrl.engine.jax_programs import (
    PrefillPlan,
    SlotControls,
    copy_pages_jit,
    decode_chunk_jit,
    empty_flat,
    graphdef_config,
    idle_controls,
    init_pool,
    pool_shardings,
    prefill_jit,
    prefill_rows,
)
from asyncrl.engine.layouts import kv_cache_layout, kv_page_layout, page_size_for, serving_formats
from asyncrl.engine.platform import resolve_inner_steps, resolve_sampler
from asyncrl.errors import EngineRequestError
from asyncrl.model.attention import KernelTarget, device_platform
from asyncrl.model.compute_copy import needs_compute_copy
from asyncrl.model.kv_cache import FlatPages
from asyncrl.model.sharding import check_tensor_parallel, param_shardings


class ModelRunner:
    """The engine's device side: weights, KV cache, programs.

    Args:
        graphdef, params: the model (``params`` a pure dict of arrays or host values).
        config: the ``engine`` section.
        mesh: the engine's own mesh (replicas x 1 x tensor-parallel), or None (the given arrays'
            devices: the trainer's own on one device).
    """

    def __init__(self, graphdef: Any, params: Any, config: EngineConfig, mesh: Any = None):
        self.graphdef = graphdef
        self.config = cfg = config
        self.model_config = nnx_cfg = _model_config(graphdef, params)
        self.mesh = mesh
        self.slots = int(cfg.slots)
        self.capacity = cfg.kv_capacity
        self.layout: Optional[Any] = None
        """The pool's shardings on the engine's own mesh (a static argument of the programs); None without one."""
        if mesh is not None:
            check_tensor_parallel(int(mesh.shape["tensor"]), nnx_cfg)
            self.replicas = int(mesh.shape["data"]) * int(mesh.shape["fsdp"])
            self.shardings = param_shardings(nnx_cfg, params, mesh)
        else:
            self.replicas = 1
            if (leaves := jax.tree.leaves(params)) and all(isinstance(x, jax.Array) for x in leaves):
                self.shardings = jax.tree.map(lambda x: x.sharding, params)
            else:
                device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
                self.shardings = jax.tree.map(lambda _: device, params)
        self.treedef: Any = jax.tree.structure(params)  # (jax's PyTreeDef is untyped for mypy)
        self.avals = [(np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(params)]
        self.vocab_size = int(params["embed_tokens"]["embedding"].shape[0])
        # PREFILL_ROWS prompts per replica and call: each replica prefills what one device alone would
        self.prefill_rows = prefill_rows(self.slots, self.replicas)
        # the attention kernels' target: the engine's mesh (fused kernels run per device in a
        # shard_map over it), or its arrays' devices when it has none
        first = jax.tree.leaves(self.shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))[0]
        self.kernel = (KernelTarget(device_platform(mesh.devices.flat[0]), mesh=mesh) if mesh is not None
                       else KernelTarget(device_platform(next(iter(first.device_set))), devices=len(first.device_set)))
        self.platform = self.kernel.platform
        self.page_layout = kv_page_layout(self.platform)
        self.cache_layout = kv_cache_layout(self.platform)  # a beam search's own cache
        self.page_size = page_size_for(cfg.page_size, self.platform, cfg.kv_capacity)
        self.pages_per_seq = cfg.kv_capacity // self.page_size
        rows_per_replica = self.slots // self.replicas
        self.pages_per_replica = (cfg.kv_pages if isinstance(cfg.kv_pages, int) else rows_per_replica * self.pages_per_seq)
        if self.pages_per_replica < self.pages_per_seq:
            raise EngineRequestError(f"engine.kv_pages = {self.pages_per_replica}: a replica's pool holds less than one "
                                     f"sequence's longest context (engine.kv_capacity = {cfg.kv_capacity}: "
                                     f"{self.pages_per_seq} pages of {self.page_size}); give at least {self.pages_per_seq}")
        self.flat_attention = self.platform == "cpu"
        """Whether decode attention reads the flat list of the slots' pages (the CPU) or each slot's page table."""
        if mesh is not None:
            self.layout = pool_shardings(nnx_cfg, mesh, self.page_layout)
        self.sampler = resolve_sampler(cfg.sampler, self.platform)
        self.inner_steps = resolve_inner_steps(cfg.decode_inner_steps, self.platform)
        self.formats = serving_formats(nnx_cfg, self.shardings, self.layout or self.state_shardings(), slots=self.slots,
                                       pages=self.pages_per_replica * self.replicas, page_size=self.page_size,
                                       capacity=cfg.kv_capacity, platform=self.platform, decode=self.decode_options(),
                                       max_stop_ids=cfg.max_stop_ids, layout=self.layout)
        """The serving copy's memory layouts where the decode program wants others than row-major (TPUs), else None."""
        self.params: Any = None
        """The params of the served version in their own dtype, or None where only the serving copy is kept."""
        self.serving: Any = None
        """The compute-dtype copy every program runs on."""
        self.install(params)
        # made in place on its shardings (a whole pool on one device first could not fit there)
        pages = self.pages_per_replica * self.replicas
        self.pool = jax.jit(lambda: init_pool(nnx_cfg, pages, self.page_size, self.page_layout),
                            out_shardings=self.state_shardings())()

    # ------------------------------------------------------------------ weights

    def install(self, params: Any) -> None:
        """Serve ``params`` (the structure and dtypes of the served model's): the previous copy is
        dropped first, then the serving copy is made (:func:`serving_copy`), so that a device never
        holds two serving copies at once (the scheduler thread, between two chunks; or the constructor)."""
        self.params = self.serving = None
        dtype = self.model_config.compute_dtype
        if self.mesh is None:  # the given arrays (the trainer's, on one device), or host values put on a device
            leaves = jax.tree.leaves(params)
            placed = params if all(isinstance(x, jax.Array) for x in leaves) else jax.device_put(params, self.shardings)
            self.params, self.serving = placed, serving_copy(placed, self.shardings, dtype, self.formats)
        else:
            self.serving = serving_copy(params, self.shardings, dtype, self.formats)
            self.params = None if needs_compute_copy(params, dtype) else self.serving

    def state_shardings(self) -> Any:
        if self.layout is not None:
            return self.layout
        first = jax.tree.leaves(self.shardings)[0]
        # Without an engine mesh the pool is replicated over the params' mesh; a NamedSharding of a
        # weight matrix would not fit its arrays.
        if isinstance(first, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
        return first

    def replicated(self) -> Any:
        """The sharding of small arrays every engine device reads whole (trie tables)."""
        if self.layout is not None:
            return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return self.state_shardings()

    def decode_options(self) -> dict[str, Any]:
        """The decode program's sampler, steps per loop iteration and kernel target."""
        return {"sampler": self.sampler, "inner": self.inner_steps, "kernel": self.kernel}

    # ------------------------------------------------------------------ programs

    def copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Every layer's pages ``dst`` take pages ``src``' contents (host int32 [rows], each replica's
        rows in turn, page numbers local to it; ``dst`` the replica's pool size: no copy), by a
        program of its own, called only when some row has a copy to make and compiled once: each
        replica's copies go first in a block of a replica's slots."""
        src, dst = np.asarray(src, np.int32), np.asarray(dst, np.int32)
        if not np.any(dst < self.pages_per_replica):
            return
        per = self.slots // self.replicas
        blocks = np.zeros((2, self.replicas, per), np.int32)
        blocks[1] = self.pages_per_replica
        for r, (s, d) in enumerate(zip(np.split(src, self.replicas), np.split(dst, self.replicas))):
            copies = d < self.pages_per_replica
            blocks[:, r, : int(copies.sum())] = s[copies], d[copies]
        self.pool = copy_pages_jit(self.pool, blocks[0].reshape(-1), blocks[1].reshape(-1), self.layout)

    def prefill(self, plan: PrefillPlan, fresh: bool) -> None:
        """Write ``plan``'s tokens into their rows' pages (``fresh``: every row starts empty), after
        its page copies."""
        self.copy_pages(plan.copy_src, plan.copy_dst)
        self.pool = prefill_jit(self.graphdef, self.serving, self.pool, plan, self.layout, self.kernel, fresh)

    def prefill_chunks(self, chunks: Sequence[tuple[int, int, np.ndarray, np.ndarray, Optional[tuple[int, int]]]],
                       buckets: tuple[int, ...], fresh: bool) -> int:
        """Prefill ``chunks``, each ``(replica, start, tokens, page table, copy)`` (a copy: ``(source page,
        destination)`` made first): by the smallest of ``buckets`` holding their tokens, each
        replica's rows from its own chunks, ``prefill_rows`` per call. Returns the calls made."""
        per_replica = self.prefill_rows // self.replicas
        by_bucket: dict[int, list[list[Any]]] = {}
        for chunk in chunks:
            bucket = next(b for b in buckets if b >= len(chunk[2]))
            by_bucket.setdefault(bucket, [[] for _ in range(self.replicas)])[chunk[0]].append(chunk)
        calls = 0
        for bucket, queues in sorted(by_bucket.items()):
            while any(queues):
                plan = self.empty_plan(bucket)
                for replica, queue in enumerate(queues):
                    for k in range(min(per_replica, len(queue))):
                        _, start, tokens, table, copy = queue.pop(0)
                        row = replica * per_replica + k
                        plan.token_ids[row, : len(tokens)] = tokens
                        plan.token_mask[row, : len(tokens)] = True
                        plan.page_table[row], plan.lengths[row] = table, start
                        if copy is not None:
                            plan.copy_src[row], plan.copy_dst[row] = copy
                self.prefill(plan, fresh)
                calls += 1
        return calls

    def decode(self, controls: SlotControls, flat: Optional[FlatPages], root_key: Any, steps: int, filtered: bool,
               tries: Any, max_branch: int, view_pages: int = 0) -> tuple[Any, Any, Any]:
        """One decode chunk; returns its ``(tokens, logprobs, emitted)`` device arrays ``[slots, steps]``
        (the CPU's: over a view of each slot's first ``view_pages`` pages, else of ``flat``'s), after the
        controls' page copies."""
        self.copy_pages(controls.copy_src, controls.copy_dst)
        self.pool, tokens, logprobs, emitted = decode_chunk_jit(
            self.graphdef, self.serving, self.pool, controls, flat, root_key, steps, filtered, self.layout, tries,
            max_branch, **self.decode_options(), view_pages=view_pages)
        return tokens, logprobs, emitted

    def beam_search(self, *args: Any, **kwargs: Any) -> Any:
        return beam_search_jit(self.graphdef, self.serving, *args, kernel=self.kernel, cache_layout=self.cache_layout,
                               **kwargs)

    def put_tables(self, tables: Any) -> Any:
        """A trie pool's tables on the engine's devices (replicated)."""
        return jax.device_put(tables, self.replicated())

    def block(self) -> None:
        """Wait for every dispatched program (so that its time is counted where it ran)."""
        jax.block_until_ready(self.pool)

    def empty_plan(self, bucket: int) -> PrefillPlan:
        return PrefillPlan.empty(self.prefill_rows, bucket, self.pages_per_seq, self.pages_per_replica)

    def idle_controls(self) -> SlotControls:
        return idle_controls(self.slots, self.config.max_stop_ids, self.pages_per_seq, self.pages_per_replica)

    def warmup(self, buckets: tuple[int, ...], extend_buckets: tuple[int, ...], flat_sizes: tuple[int, ...],
               view_sizes: tuple[int, ...], root_key: Any, row_sizes: tuple[int, ...] = ()) -> None:
        """Compile every program with arguments that change nothing (each prefill and extension
        bucket, both decode variants per size class of the CPU's views and rows)."""
        for bucket in buckets:
            self.prefill(self.empty_plan(bucket), fresh=True)
        for bucket in extend_buckets:
            self.prefill(self.empty_plan(bucket), fresh=False)
        none = np.full((self.slots,), self.pages_per_replica, np.int32)
        self.pool = copy_pages_jit(self.pool, none, none, self.layout)  # (copies nothing)
        for rows in (*row_sizes, self.slots // self.replicas):
            idle = idle_controls(rows * self.replicas, self.config.max_stop_ids, self.pages_per_seq, self.pages_per_replica)
            views = [(None, size) for size in view_sizes] + [(empty_flat(size, rows, self.replicas), 0) for size in flat_sizes
                                                              if size < rows * view_sizes[-1]]
            for filtered in (False, True):
                for flat, pages in views if self.flat_attention else [(None, 0)]:
                    self.decode(idle, flat, root_key, self.config.decode_chunk, filtered, None, 0, pages)
        self.block()


def _model_config(graphdef: Any, params: Any) -> Any:
    """The :class:`~asyncrl.model.DecoderConfig` the graphdef was built with."""
    cfg = graphdef_config(graphdef, params)
    if cfg is None:
        raise EngineRequestError("JaxEngine: the graphdef is not an asyncrl Decoder (no .cfg)")
    return cfg
