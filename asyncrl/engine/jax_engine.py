"""JaxEngine: continuously batched, jitted KV-cache sampling behind the InferenceEngine protocol.

Threads
-------
``generate``/``submit`` (any thread) validate the request on the caller's thread and put
it on a queue. One daemon scheduler thread owns every device call: it installs published
weights, admits waiting requests into free slots (prefill + copy), decodes one chunk of
tokens for all slots, hands finished requests back through their futures, and repeats.
``update_weights`` (the trainer's thread) hands the new parameters to the scheduler and
waits until they are installed, which happens between two chunks (at once when idle).

Device state and programs (:mod:`asyncrl.engine.jax_programs`)
---------------------------------------------------------------
A fixed number of batch slots (``engine.slots``) over one model KV cache of fixed capacity
(``engine.kv_capacity``; :mod:`asyncrl.model.transformer` documents the slot protocol),
plus one random key per slot (:class:`~asyncrl.engine.jax_programs.SlotState`). A request
with ``n`` samples prefills ``prompt[:-1]`` once into one row of a small cache whose capacity
is the smallest prefill bucket that holds it, and that row is copied into ``n`` free slots;
the requests admitted at one chunk boundary are prefilled together, ``PREFILL_ROWS`` prompts
of one bucket per program call (a fixed row count, so a prompt's KV is bitwise the same
whatever is prefilled beside it). The
last prompt token is fed by the first decode step, so every sampled token (the first one
included) comes out of the same decode program: the model's own KV-cache forward, one step
for all slots, then sampling. What each slot asks for (temperature, top-k/top-p, stops,
limits, its last token) is a :class:`~asyncrl.engine.jax_programs.SlotControls` the
scheduler keeps on the host and hands to every chunk. Finished slots are refilled from the
queue at the next chunk boundary (continuous batching); a chunk ends early once a slot
finished in it and enough slots are free for the next waiting request and, with 8 slots or
more, for two prompts (with none waiting: callers typically submit again at once). So a freed
slot idles for at most the steps until the next finish rather than the rest of a chunk plus a
whole one, and refills come in pairs, prefilled in one call that costs about what one prompt
alone costs (small prefills read all the weights for few tokens). The programs are
module-level jits shared by every engine with the same model shapes: one prefill per bucket
and two decode variants per attention bucket (``engine.attention_buckets``:
:mod:`asyncrl.engine.attention_buckets`) (:func:`compile_count`, reported as
``engine/compiles``). The sampler (``engine.sampler``), the XLA flags and the decode steps per
iteration of a chunk's loop (``engine.decode_inner_steps``: 8 on GPUs, where the host reads the
loop's exit test, so a chunk's early exit comes at most 7 steps late there; 1 elsewhere) are
chosen per platform (:mod:`asyncrl.engine.platform`).

Sampling and randomness (docs/design.md "Randomness", "Log-probabilities")
-----------------------------------------------------------------
:mod:`asyncrl.engine.jax_programs` documents the sampling rule. The slot key is
``fold_in(fold_in(fold_in(PRNGKey(seed), sample_id), index_in_group + j), turn)`` for sample
``j``: it never depends on the slot, the batch or the arrival order, and the batch shape is
fixed, so a seeded request draws the same tokens whatever runs beside it. The reported
log-prob is ``log_softmax(logits / T)[token]`` of the untruncated, unmasked logits (T = 1
for greedy), i.e. what :func:`~asyncrl.model.per_token_logprobs` gives on the full sequence;
under a trie constraint (``GenerationRequest.constraint``, docs/decoding.md) it is the log-prob
of the masked distribution the token was drawn from. Each running trie is in one pool of
tables (:class:`~asyncrl.engine.constraints.TriePool`) and each slot carries its node, so
constrained and free requests share a batch. A beam-search request (``beam=True``) takes no
slots: the scheduler runs it as one program call between two chunks
(:func:`~asyncrl.engine.beam_search._beam_search`), so running samples wait that long.
Stop ids end a sample on device; stop sequences are matched on the host after each chunk
(tokens a slot drew past the match are discarded).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.cluster.placement import slots_for_replicas
from asyncrl.config import EngineConfig
from asyncrl.engine.attention_buckets import attention_buckets
from asyncrl.engine.constraints import TokenTrie, TriePool
from asyncrl.engine.device_copy import serving_copy
from asyncrl.engine.jax_programs import (
    PrefillPlan,
    SlotControls,
    SlotState,
    compile_count,
    decode_chunk_jit,
    graphdef_config,
    idle_controls,
    init_slot_state,
    prefill_insert_jit,
    prefill_rows,
    slot_state_shardings,
)
from asyncrl.engine.jax_scheduler import EngineScheduler
from asyncrl.engine.layouts import kv_cache_layout, serving_formats
from asyncrl.engine.platform import resolve_inner_steps, resolve_sampler
from asyncrl.engine.prefix_cache import PrefixStore
from asyncrl.engine.prefix_programs import CopyPlan, ExtendPlan, copy_prefix_jit, extend_jit
from asyncrl.engine.protocol import GenerationRequest, GenerationResponse
from asyncrl.engine.requests import EngineStats, Pending, Update
from asyncrl.errors import EngineClosed, EngineCrashed, EngineRequestError
from asyncrl.model.attention import KernelTarget, device_platform
from asyncrl.model.compute_copy import needs_compute_copy
from asyncrl.model.sharding import check_tensor_parallel, param_shardings
from asyncrl.registry import register

__all__ = ["JaxEngine"]

logger = logging.getLogger("asyncrl.engine")


@register("engine", "jax")
class JaxEngine(EngineScheduler):
    """The :class:`~asyncrl.engine.protocol.InferenceEngine` on a Flax NNX decoder.

    Args:
        graphdef, params: from :func:`asyncrl.model.split_params` (params: a pure dict of
            arrays or an ``nnx.State``). Without ``mesh``, params already on devices keep
            their shardings (the engine serves the trainer's own arrays: the placement of one
            device) and others go to the first device. Later ``update_weights`` params are
            put on the same shardings.
        mesh: the engine's own device mesh (axes ``data``, ``fsdp``, ``tensor``: replicas x 1 x
            tensor-parallel degree; :func:`asyncrl.cluster.placement.engine_mesh` builds it). Params
            are placed on it by the model's partition rules, the KV cache is split by KV heads
            over ``tensor`` and by slots over the replicas (:func:`slot_state_shardings`), and
            published params are laid out on it device to device (:func:`serving_copy`: the
            engine keeps only that compute-dtype copy, made at the next chunk boundary after the
            previous one is dropped).
        stop_token_ids: the default stop ids (the model's ``generation_config`` EOS ids),
            used by requests whose ``stop_token_ids`` is None.
        config: the ``engine`` config section (slots, KV capacity, chunk, buckets, ...).
        seed: the run seed (``run.seed``), root of every sample key.
        version: the version of ``params`` (``k`` when resuming from step ``k``).
        warmup: compile every program now (otherwise each compiles on first use).
    """

    def __init__(
        self,
        graphdef: Any,
        params: Any,
        *,
        stop_token_ids: Sequence[int] = (),
        config: Optional[EngineConfig] = None,
        seed: int = 0,
        version: int = 0,
        warmup: bool = False,
        mesh: Any = None,
    ):
        self.config = cfg = config or EngineConfig()
        if not isinstance(cfg.slots, int):
            raise EngineRequestError("engine.slots: auto is sized by the training run (asyncrl.run.auto_slots); "
                                     "give the engine a number of slots")
        self.graphdef = graphdef
        if hasattr(params, "to_pure_dict"):
            params = params.to_pure_dict()
        self.model_config = nnx_cfg = _model_config(graphdef, params)
        self.mesh = mesh
        self._layout: Optional[SlotState] = None
        """The slot state's shardings on the engine's own mesh (a static argument of the programs); None without one."""
        if mesh is not None:
            check_tensor_parallel(int(mesh.shape["tensor"]), nnx_cfg)
            replicas = int(mesh.shape["data"]) * int(mesh.shape["fsdp"])
            if cfg.slots % replicas:
                raise EngineRequestError(f"engine.slots = {cfg.slots} is not a multiple of the engine's {replicas} replicas "
                                         f"(each decodes an equal share); use {slots_for_replicas(cfg.slots, replicas)}")
            self._shardings = param_shardings(nnx_cfg, params, mesh)
        elif (leaves := jax.tree.leaves(params)) and all(isinstance(x, jax.Array) for x in leaves):
            self._shardings = jax.tree.map(lambda x: x.sharding, params)
        else:
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            self._shardings = jax.tree.map(lambda _: device, params)
        self._treedef: Any = jax.tree.structure(params)  # (jax's PyTreeDef is untyped for mypy)
        self._avals = [(np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(params)]
        self.vocab_size = int(params["embed_tokens"]["embedding"].shape[0])
        self.default_stop_ids = tuple(int(t) for t in stop_token_ids)
        self.slots = cfg.slots
        self.capacity = cfg.kv_capacity
        self.chunk = cfg.decode_chunk
        self.buckets = tuple(sorted(b for b in set(cfg.prefill_buckets) if b <= cfg.kv_capacity))
        # PREFILL_ROWS prompts per replica and call: each replica prefills what one device alone would
        replicas = 1 if mesh is None else int(mesh.shape["data"]) * int(mesh.shape["fsdp"])
        self.prefill_rows = prefill_rows(cfg.slots, replicas)
        # the attention kernels' target: the engine's mesh (fused kernels run per device in a
        # shard_map over it), or its arrays' devices when it has none
        first = jax.tree.leaves(self._shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))[0]
        self.kernel = (KernelTarget(device_platform(mesh.devices.flat[0]), mesh=mesh) if mesh is not None
                       else KernelTarget(device_platform(next(iter(first.device_set))), devices=len(first.device_set)))
        self.platform = self.kernel.platform
        self.cache_layout = kv_cache_layout(self.platform)
        if mesh is not None:
            self._layout = slot_state_shardings(nnx_cfg, cfg.slots, mesh, self.cache_layout)
        self.sampler = resolve_sampler(cfg.sampler, self.platform)
        self.inner_steps = resolve_inner_steps(cfg.decode_inner_steps, self.platform)
        self._formats = serving_formats(nnx_cfg, self._shardings, self._layout or self._state_shardings(), slots=cfg.slots,
                                        capacity=cfg.kv_capacity, platform=self.platform,
                                        decode=self._decode_options(cfg.kv_capacity), max_stop_ids=cfg.max_stop_ids,
                                        layout=self._layout)
        """The serving copy's memory layouts where the decode program wants others than row-major (TPUs), else None."""
        self._params: Any = None
        self._serving: Any = None
        self._take(params)
        self.attention_buckets = attention_buckets(self.capacity, cfg.attention_buckets)
        reuse = cfg.prefix_cache
        self.extend_buckets = tuple(sorted({b for b in [*reuse.extend_buckets, *self.buckets] if b <= cfg.kv_capacity}))
        self._prefixes = (PrefixStore(cfg.slots, cfg.kv_capacity, replicas, reuse.min_tokens, reuse.across_versions)
                          if reuse.enabled else None)
        self._version_floor = [None] * cfg.slots
        self._flush = False  # flush_prefixes asked: done by the scheduler thread, which owns the store
        if not self.buckets:
            raise EngineRequestError(f"engine.prefill_buckets {cfg.prefill_buckets}: none fits engine.kv_capacity = {cfg.kv_capacity}")
        self._check_stop_ids(self.default_stop_ids, "stop_token_ids (the model's default)")
        self.seed = seed
        self._root_key = np.asarray(jax.random.PRNGKey(seed))
        self._version = int(version)

        # made in place on its shardings (a whole cache on one device first could not fit there)
        self._state = jax.jit(lambda: init_slot_state(nnx_cfg, self.slots, self.capacity, self.cache_layout),
                              out_shardings=self._state_shardings())()

        # The per-slot controls (host numpy arrays, owned by the scheduler thread).
        self._controls: SlotControls = idle_controls(self.slots, cfg.max_stop_ids)
        self._slot_owner: list[Optional[tuple[Pending, int]]] = [None] * self.slots
        self._tries = TriePool()  # the tries of the constrained requests admitted (scheduler thread)
        self._trie_tables: Any = None  # self._tries.tables on the device

        self._cond = threading.Condition()
        self._waiting: collections.deque[Pending] = collections.deque()
        self._running: set[Pending] = set()
        self._update: Optional[Update] = None
        self._aborts: list[threading.Event] = []
        self._closed = False
        self._crash: Optional[str] = None
        self._warned_truncation = False
        self._freed = 0  # slots the last decode chunk freed
        self._step_s = 0.0  # wall seconds per step of the last decode chunk
        self._stats = EngineStats()
        self._started = time.monotonic()
        if warmup:
            self.warmup()
        self._thread = threading.Thread(target=self._loop, name="asyncrl-jax-engine", daemon=True)
        self._thread.start()

    def _state_shardings(self) -> Any:
        if self._layout is not None:
            return self._layout
        first = jax.tree.leaves(self._shardings)[0]
        # Without an engine mesh the state (KV cache, keys) is replicated over the params' mesh;
        # a NamedSharding of a weight matrix would not fit its lower-rank arrays.
        if isinstance(first, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
        return first

    # ------------------------------------------------------------------ protocol

    @property
    def version(self) -> int:
        return self._version

    @property
    def served_params(self) -> Any:
        """The params of :attr:`version` in their own dtype (read-only: ``asyncrl serve`` reuses the
        leaves a new version leaves unchanged instead of reading them again), or None where the
        engine holds only its compute-dtype serving copy (a mesh of its own, weights stored wider
        than they are computed in)."""
        return self._params

    def _take(self, params: Any) -> None:
        """Install ``params`` (the structure and dtypes of the served model's): the previous copy is
        dropped first, then the serving copy is made (:func:`serving_copy`), so that a device never
        holds two serving copies at once (scheduler thread, between two chunks; or the constructor)."""
        self._params = self._serving = None
        dtype = self.model_config.compute_dtype
        if self.mesh is None:  # the given arrays (the trainer's, on one device), or host values put on a device
            leaves = jax.tree.leaves(params)
            placed = params if all(isinstance(x, jax.Array) for x in leaves) else jax.device_put(params, self._shardings)
            self._params, self._serving = placed, serving_copy(placed, self._shardings, dtype, self._formats)
        else:
            self._serving = serving_copy(params, self._shardings, dtype, self._formats)
            self._params = None if needs_compute_copy(params, dtype) else self._serving

    def generate(self, request: GenerationRequest) -> list[GenerationResponse]:
        return self.submit(request).result()

    def submit(self, request: GenerationRequest) -> "Future[list[GenerationResponse]]":
        stop_ids = self._validate(request)
        timeout = request.timeout_s if request.timeout_s is not None else self.config.request_timeout_s
        pending = Pending(request, stop_ids, None if timeout is None else time.monotonic() + timeout)
        with self._cond:
            self._raise_if_unusable()
            self._waiting.append(pending)
            self._cond.notify_all()
        return pending.future

    def update_weights(self, params: Any, version: int) -> None:
        if hasattr(params, "to_pure_dict"):
            params = params.to_pure_dict()
        with self._cond:
            self._raise_if_unusable()
            if self._update is not None:
                raise ValueError("update_weights: another update is still being installed (publish from one thread)")
            if version != self._version + 1:
                raise ValueError(f"update_weights: version must be {self._version + 1} (engine serves {self._version}), given {version}")
        if self._treedef != jax.tree.structure(params):
            raise ValueError("update_weights: params do not have the structure of the served model's params")
        avals = [(np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(params)]
        if avals != self._avals:
            bad = [i for i, (a, b) in enumerate(zip(avals, self._avals)) if a != b]
            raise ValueError(f"update_weights: {len(bad)} parameter(s) differ in shape or dtype from the served ones (first: leaf {bad[0]}: {avals[bad[0]]} vs {self._avals[bad[0]]})")
        update = Update(params, version)
        with self._cond:
            self._raise_if_unusable()
            if self._update is not None or version != self._version + 1:
                raise ValueError(f"update_weights: version {version} is no longer next (engine serves {self._version})")
            self._update = update
            self._cond.notify_all()
        while not update.done.wait(1.0):
            with self._cond:
                if (self._closed or self._crash is not None) and not update.done.is_set():
                    break
        if update.error is not None:
            raise update.error
        if not update.done.is_set():
            self._raise_if_unusable()

    def flush_prefixes(self) -> None:
        """Forget every kept prefix (``asyncrl serve``'s ``/flush_cache``): requests admitted from
        the next chunk boundary on prefill whole prompts, until their own KV is kept again."""
        with self._cond:
            self._flush = True
            self._cond.notify_all()

    def abort_all(self, timeout: float = 60.0) -> None:
        """End every waiting and running sample at the next chunk boundary, keeping the tokens it
        has (``stop_reason == "aborted"``); returns once done. ``asyncrl serve`` calls this on
        ``/pause_generation`` so that no request runs across a weight update."""
        done = threading.Event()
        with self._cond:
            self._raise_if_unusable()
            self._aborts.append(done)
            self._cond.notify_all()
        if not done.wait(timeout):
            self._raise_if_unusable()
            raise TimeoutError(f"JaxEngine.abort_all: not done within {timeout} s")

    # ------------------------------------------------------------------ lifecycle, metrics

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the scheduler: pending and running requests fail with :class:`EngineClosed`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._fail_all(EngineClosed("the inference engine was shut down"))

    close = shutdown

    def __enter__(self) -> "JaxEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    @property
    def prefill_calls(self) -> int:
        """Prefill program calls so far (one per ``prefill_rows`` prompts of one bucket admitted
        together). Not in :meth:`metrics`: how arrivals group into calls depends on timing."""
        return self._stats.prefill_calls

    @property
    def crashed(self) -> Optional[str]:
        """The scheduler thread's traceback if it died, else None."""
        return self._crash

    def warmup(self) -> int:
        """Compile every program (each prefill bucket, both decode variants per attention bucket, and
        with a prefix cache its copy and each extension bucket); returns the compile count."""
        for bucket in self.buckets:
            plan = PrefillPlan.empty(self.prefill_rows, bucket, self.slots)  # no destination: the state is unchanged
            self._state = prefill_insert_jit(self.graphdef, self._serving, self._state, plan, self._root_key, self._layout,
                                             self.kernel)
        if self._prefixes is not None:  # no destination rows either: nothing changes
            for cross in sorted({False, self._layout is not None and self._prefixes.replicas > 1}):
                self._state = copy_prefix_jit(self._state, CopyPlan.empty(self.slots), self._root_key, self._layout, cross)
            for bucket in self.extend_buckets:
                self._state = extend_jit(self.graphdef, self._serving, self._state,
                                         ExtendPlan.empty(self.prefill_rows, bucket, self.slots), self._layout, self.kernel)
        idle = idle_controls(self.slots, self.config.max_stop_ids)
        for filtered in (False, True):
            for attend in self.attention_buckets:
                self._state, *_ = decode_chunk_jit(self.graphdef, self._serving, self._state, idle, self.chunk, filtered,
                                                   self._layout, **self._decode_options(attend))
        jax.block_until_ready(self._state)
        return compile_count()

    def _decode_options(self, attend: int) -> dict[str, Any]:
        """The decode program's sampler, attended cache size (0: the whole cache, the same
        program as without attention buckets) and steps per loop iteration."""
        return {"sampler": self.sampler, "attend": 0 if attend >= self.capacity else attend, "inner": self.inner_steps,
                "kernel": self.kernel}

    def metrics(self) -> dict[str, float]:
        """Cumulative figures since start (``engine/...``). ``decode_s`` (wall time of decode
        chunks) splits into ``decode_wait_s`` (blocked on a chunk's results: device time not
        hidden by host work) and ``decode_host_s`` (dispatch, control upload, per-slot
        bookkeeping on the scheduler thread); ``refill_wait_s`` is the time spent after chunks
        that freed slots waiting (briefly) for callers to submit again."""
        s = self._stats
        slot_steps = s.decode_steps * self.slots
        return {
            "engine/version": float(self._version),
            "engine/compiles": float(compile_count()),
            "engine/requests": float(s.requests),
            "engine/samples_aborted": float(s.aborted),
            "engine/waiting": float(len(self._waiting)),
            "engine/slot_occupancy": s.decode_tokens / slot_steps if slot_steps else 0.0,
            "engine/queue_wait_s": s.queue_wait_s / s.admitted if s.admitted else 0.0,
            "engine/queue_wait_max_s": float(s.queue_wait_max_s),
            "engine/prefill_tokens": float(s.prefill_tokens),
            "engine/prefix_hit_tokens": float(s.prefix_hit_tokens),
            "engine/prefix_hit_rate": (s.prefix_hit_tokens / (s.prefix_hit_tokens + s.prefill_tokens)
                                       if s.prefix_hit_tokens + s.prefill_tokens else 0.0),
            "engine/prefill_s": float(s.prefill_s),
            "engine/prefill_tokens_per_s": s.prefill_tokens / s.prefill_s if s.prefill_s else 0.0,
            "engine/decode_tokens": float(s.decode_tokens),
            "engine/decode_tokens_per_s": s.decode_tokens / s.decode_s if s.decode_s else 0.0,
            "engine/decode_steps": float(s.decode_steps),
            "engine/decode_s": float(s.decode_s),
            "engine/decode_ms_per_step": 1e3 * s.decode_s / s.decode_steps if s.decode_steps else 0.0,
            "engine/decode_wait_s": float(s.decode_wait_s),
            "engine/decode_host_s": float(s.decode_host_s),
            "engine/refill_wait_s": float(s.refill_wait_s),
            "engine/beam_calls": float(s.beam_calls),
            "engine/beam_s": float(s.beam_s),
            "engine/swaps": float(s.swaps),
            "engine/swap_latency_s": s.swap_s / s.swaps if s.swaps else 0.0,
            "engine/swap_latency_max_s": float(s.swap_max_s),
        }

    # ------------------------------------------------------------------ validation (caller's thread)

    def _raise_if_unusable(self) -> None:
        if self._crash is not None:
            raise EngineCrashed("the inference engine's thread died", self._crash)
        if self._closed:
            raise EngineClosed("the inference engine was shut down")

    def _check_stop_ids(self, ids: Sequence[int], what: str) -> None:
        if len(ids) > self.config.max_stop_ids:
            raise EngineRequestError(f"{what}: {len(ids)} stop ids, more than engine.max_stop_ids = {self.config.max_stop_ids}")
        bad = [t for t in ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise EngineRequestError(f"{what}: ids {bad} are outside the vocabulary [0, {self.vocab_size})")

    def _check_constraint(self, request: GenerationRequest) -> None:
        trie = request.constraint
        if not isinstance(trie, TokenTrie):
            raise EngineRequestError(f"GenerationRequest.constraint: expected a TokenTrie, got {type(trie).__name__}")
        if trie.max_token >= self.vocab_size:
            raise EngineRequestError(f"GenerationRequest.constraint {trie.name}: token {trie.max_token} is outside the vocabulary [0, {self.vocab_size})")
        if request.beam and request.n > trie.num_sequences:
            raise EngineRequestError(f"GenerationRequest.n = {request.n} beams, but constraint {trie.name} has only "
                                     f"{trie.num_sequences} sequences: lower n")
        if request.max_new_tokens < trie.max_depth:
            raise EngineRequestError(f"GenerationRequest.max_new_tokens = {request.max_new_tokens} is shorter than the longest sequence of "
                                     f"constraint {trie.name} ({trie.max_depth} tokens): raise max_new_tokens")

    def _validate(self, request: GenerationRequest) -> tuple[int, ...]:
        if not isinstance(request, GenerationRequest):
            raise EngineRequestError(f"expected a GenerationRequest, got {type(request).__name__}")
        self._raise_if_unusable()
        prompt = request.prompt_ids
        length = len(prompt)
        if length + request.max_new_tokens > self.capacity:
            raise EngineRequestError(
                f"GenerationRequest: prompt ({length} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds "
                f"engine.kv_capacity = {self.capacity}"
            )
        if length - 1 > self.buckets[-1]:
            raise EngineRequestError(
                f"GenerationRequest: prompt of {length} tokens is longer than the largest engine.prefill_buckets entry + 1 ({self.buckets[-1] + 1})"
            )
        ids = np.asarray(prompt)
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.vocab_size:
            raise EngineRequestError(f"GenerationRequest.prompt_ids: need integer token ids in [0, {self.vocab_size})")
        if request.n > self.slots:
            raise EngineRequestError(f"GenerationRequest.n = {request.n} exceeds engine.slots = {self.slots}")
        if not request.greedy and not np.isfinite(request.temperature):
            raise EngineRequestError(f"GenerationRequest.temperature must be finite (given {request.temperature})")
        if request.top_k < 0:
            raise EngineRequestError(f"GenerationRequest.top_k must be >= 0 (0 is off; given {request.top_k})")
        if not 0.0 < request.top_p <= 1.0:
            raise EngineRequestError(f"GenerationRequest.top_p must be in (0, 1] (1 is off; given {request.top_p})")
        if request.timeout_s is not None and not request.timeout_s > 0:
            raise EngineRequestError(f"GenerationRequest.timeout_s must be > 0 (given {request.timeout_s})")
        stop_ids = self.default_stop_ids if request.stop_token_ids is None else tuple(int(t) for t in request.stop_token_ids)
        self._check_stop_ids(stop_ids, "GenerationRequest.stop_token_ids")
        for seq in request.stop_sequences:
            if any(not 0 <= int(t) < self.vocab_size for t in seq):
                raise EngineRequestError(f"GenerationRequest.stop_sequences: {list(seq)} has ids outside [0, {self.vocab_size})")
        if request.constraint is not None:
            self._check_constraint(request)
        if (request.top_k > 0 or request.top_p < 1.0) and not request.greedy and not self._warned_truncation:
            self._warned_truncation = True
            logger.warning(
                "a request uses top_k/top_p: its log-probs are of the untruncated distribution (docs/design.md), so tokens "
                "sampled this way are off-policy for training; keep top-k/top-p off for training rollouts"
            )
        return stop_ids


def _model_config(graphdef: Any, params: Any) -> Any:
    """The :class:`~asyncrl.model.DecoderConfig` the graphdef was built with."""
    cfg = graphdef_config(graphdef, params)
    if cfg is None:
        raise EngineRequestError("JaxEngine: the graphdef is not an asyncrl Decoder (no .cfg)")
    return cfg
