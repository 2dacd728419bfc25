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
``engine/compiles``). The sampler (``engine.sampler``) and the XLA flags are chosen per
platform (:mod:`asyncrl.engine.platform`).

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
(:func:`~asyncrl.engine.jax_programs._beam_search`), so running samples wait that long.
Stop ids end a sample on device; stop sequences are matched on the host after each chunk
(tokens a slot drew past the match are discarded).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.config import EngineConfig
from asyncrl.engine.attention_buckets import attention_buckets, chunk_bucket
from asyncrl.engine.constraints import TokenTrie, TriePool
from asyncrl.engine.jax_programs import (
    PREFILL_ROWS,
    PrefillPlan,
    SlotControls,
    SlotState,
    beam_search_jit,
    compile_count,
    decode_chunk_jit,
    graphdef_config,
    idle_controls,
    init_slot_state,
    prefill_insert_jit,
    slot_state_shardings,
    snapshot,
)
from asyncrl.engine.platform import resolve_sampler
from asyncrl.engine.protocol import GenerationRequest, GenerationResponse, StopReason
from asyncrl.errors import EngineClosed, EngineCrashed, EngineRequestError
from asyncrl.model.attention import device_platform
from asyncrl.model.compute_copy import compute_copy
from asyncrl.model.sharding import check_tensor_parallel, param_shardings
from asyncrl.registry import register

logger = logging.getLogger("asyncrl.engine")

PAIRED_REFILL_MIN_SLOTS = 8
"""From this many slots a chunk ends early only once ``prefill_rows`` slots are free, so refills
are prefilled together; with fewer, one idle slot is too large a share to keep waiting."""

# --------------------------------------------------------------------------- host bookkeeping


class _Sample:
    __slots__ = ("tokens", "logprobs", "versions", "stop_reason", "slot", "node", "score")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.stop_reason: Optional[StopReason] = None
        self.slot: Optional[int] = None
        self.node = 0  # the trie node after the tokens so far (constrained requests only)
        self.score: Optional[float] = None  # beam search's ranking score


class _Pending:
    """A submitted request and its progress."""

    def __init__(self, request: GenerationRequest, stop_ids: tuple[int, ...], deadline: Optional[float]):
        self.request = request
        self.stop_ids = stop_ids
        self.stop_set = frozenset(stop_ids)
        self.stop_sequences = [list(map(int, s)) for s in request.stop_sequences if len(s) > 0]
        self.future: Future = Future()
        self.submitted = time.monotonic()
        self.deadline = deadline
        self.samples = [_Sample() for _ in range(request.n)]

    def response(self) -> list[GenerationResponse]:
        return [
            GenerationResponse(
                output_ids=np.asarray(s.tokens, dtype=np.int32),
                logprobs=np.asarray(s.logprobs, dtype=np.float32),
                versions=np.asarray(s.versions, dtype=np.int32),
                stop_reason=s.stop_reason or "aborted",
                score=s.score,
            )
            for s in self.samples
        ]


class _Update:
    def __init__(self, params: Any, version: int, compute_dtype: Any):
        self.params = params
        self.serving = compute_copy(params, compute_dtype)  # cast once here, not in every program call
        self.version = version
        self.requested = time.monotonic()
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


# --------------------------------------------------------------------------- the engine


@dataclasses.dataclass
class EngineStats:
    """The cumulative figures behind :meth:`JaxEngine.metrics`, updated by the scheduler thread
    (``requests`` and ``aborted`` also by callers, under the engine's condition). Fields, not
    string keys, so a misspelt counter is an error instead of a new key."""

    requests: int = 0  # generate/submit calls accepted
    aborted: int = 0  # samples ended by abort (timeout or cancel)
    admitted: int = 0  # requests given slots
    queue_wait_s: float = 0.0  # summed wait from submit to admission
    queue_wait_max_s: float = 0.0
    prefill_calls: int = 0  # prefill-insert program calls
    prefill_tokens: int = 0  # prompt tokens prefilled
    prefill_s: float = 0.0
    decode_steps: int = 0  # decode steps (every slot advances one token per step)
    decode_tokens: int = 0  # tokens emitted by decode steps
    decode_s: float = 0.0  # wall time of decode chunks = decode_wait_s + decode_host_s
    decode_wait_s: float = 0.0  # blocked on a chunk's results (device time not hidden by host work)
    decode_host_s: float = 0.0  # dispatch, control upload and per-slot bookkeeping
    refill_wait_s: float = 0.0  # after chunks that freed slots, waiting for callers to submit again
    beam_calls: int = 0  # beam-search requests run
    beam_s: float = 0.0  # their wall time
    swaps: int = 0  # weight versions installed
    swap_s: float = 0.0  # summed install latency (publish to installed)
    swap_max_s: float = 0.0


@register("engine", "jax")
class JaxEngine:
    """The :class:`~asyncrl.engine.protocol.InferenceEngine` on a Flax NNX decoder.

    Args:
        graphdef, params: from :func:`asyncrl.model.split_params` (params: a pure dict of
            arrays or an ``nnx.State``). Without ``mesh``, params already on devices keep
            their shardings (the engine serves the trainer's own arrays: the colocated
            default) and others go to the first device. Later ``update_weights`` params are
            put on the same shardings.
        mesh: the engine's own device mesh (axes ``data``, ``fsdp``, ``tensor``: replicas x 1 x
            tensor-parallel degree; :func:`asyncrl.cluster.placement.engine_mesh` builds it). Params
            are placed on it by the model's partition rules, the KV cache is split by KV heads
            over ``tensor`` and by slots over the replicas (:func:`slot_state_shardings`), and
            published params are moved onto it device to device (:func:`move_params`).
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
            self._shardings = param_shardings(nnx_cfg, params, mesh)
            self._layout = slot_state_shardings(nnx_cfg, cfg.slots, mesh)
        elif (leaves := jax.tree.leaves(params)) and all(isinstance(x, jax.Array) for x in leaves):
            self._shardings = jax.tree.map(lambda x: x.sharding, params)
        else:
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            self._shardings = jax.tree.map(lambda _: device, params)
        self._params = move_params(params, self._shardings)
        self._serving = compute_copy(self._params, nnx_cfg.compute_dtype)  # what the programs run on
        self._treedef: Any = jax.tree.structure(self._params)  # (jax's PyTreeDef is untyped for mypy)
        self._avals = [(x.shape, x.dtype) for x in jax.tree.leaves(self._params)]
        embed = self._params["embed_tokens"]["embedding"]
        self.vocab_size = int(embed.shape[0])
        self.default_stop_ids = tuple(int(t) for t in stop_token_ids)
        self.slots = cfg.slots
        self.capacity = cfg.kv_capacity
        self.chunk = cfg.decode_chunk
        self.buckets = tuple(sorted(b for b in set(cfg.prefill_buckets) if b <= cfg.kv_capacity))
        self.prefill_rows = min(PREFILL_ROWS, cfg.slots)
        self.platform = device_platform(next(iter(embed.devices())))  # picks the prefill's attention kernel
        self.sampler = resolve_sampler(cfg.sampler, self.platform)
        self.attention_buckets = attention_buckets(self.capacity, cfg.attention_buckets)
        if not self.buckets:
            raise EngineRequestError(f"engine.prefill_buckets {cfg.prefill_buckets}: none fits engine.kv_capacity = {cfg.kv_capacity}")
        self._check_stop_ids(self.default_stop_ids, "stop_token_ids (the model's default)")
        self.seed = seed
        self._root_key = np.asarray(jax.random.PRNGKey(seed))
        self._version = int(version)

        self._state = jax.device_put(init_slot_state(nnx_cfg, self.slots, self.capacity), self._state_shardings())

        # The per-slot controls (host numpy arrays, owned by the scheduler thread).
        self._controls: SlotControls = idle_controls(self.slots, cfg.max_stop_ids)
        self._slot_owner: list[Optional[tuple[_Pending, int]]] = [None] * self.slots
        self._tries = TriePool()  # the tries of the constrained requests admitted (scheduler thread)
        self._trie_tables: Any = None  # self._tries.tables on the device

        self._cond = threading.Condition()
        self._waiting: collections.deque[_Pending] = collections.deque()
        self._running: set[_Pending] = set()
        self._update: Optional[_Update] = None
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
        """The params of :attr:`version` as placed on the engine's devices (read-only: ``asyncrl serve``
        reuses the leaves a new version leaves unchanged instead of reading them again)."""
        return self._params

    def generate(self, request: GenerationRequest) -> list[GenerationResponse]:
        return self.submit(request).result()

    def submit(self, request: GenerationRequest) -> "Future[list[GenerationResponse]]":
        stop_ids = self._validate(request)
        timeout = request.timeout_s if request.timeout_s is not None else self.config.request_timeout_s
        pending = _Pending(request, stop_ids, None if timeout is None else time.monotonic() + timeout)
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
        update = _Update(move_params(params, self._shardings), version, self.model_config.compute_dtype)
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
        """Compile every program (each prefill bucket, both decode variants per attention bucket); returns the compile count."""
        for bucket in self.buckets:
            plan = PrefillPlan.empty(self.prefill_rows, bucket, self.slots)  # no destination: the state is unchanged
            self._state = prefill_insert_jit(self.graphdef, self._serving, self._state, plan, self._root_key, self._layout,
                                             self.platform)
        idle = idle_controls(self.slots, self.config.max_stop_ids)
        for filtered in (False, True):
            for attend in self.attention_buckets:
                self._state, *_ = decode_chunk_jit(self.graphdef, self._serving, self._state, idle, self.chunk, filtered,
                                                   self._layout, **self._decode_options(attend))
        jax.block_until_ready(self._state)
        return compile_count()

    def _decode_options(self, attend: int) -> dict[str, Any]:
        """The decode program's sampler and attended cache size (0: the whole cache, the same
        program as without attention buckets)."""
        return {"sampler": self.sampler, "attend": 0 if attend >= self.capacity else attend}

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

    # ------------------------------------------------------------------ scheduler thread

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._closed or self._waiting or self._update is not None or self._running or self._aborts):
                        self._cond.wait(1.0)
                    if self._closed:
                        return
                    update, self._update = self._update, None
                    aborts, self._aborts = self._aborts, []
                if aborts:
                    self._abort_now(aborts)
                if update is not None:
                    self._install(update)
                self._expire()
                self._admit()
                if self._running:
                    self._decode()
                    self._await_refill()
        except BaseException:  # noqa: BLE001 - delivered to every caller
            tb = traceback.format_exc()
            logger.error("inference engine thread died:\n%s", tb)
            with self._cond:
                self._crash = tb
                update, self._update = self._update, None
            if update is not None:
                update.error = EngineCrashed("the inference engine's thread died", tb)
                update.done.set()
            self._fail_all(EngineCrashed("the inference engine's thread died", tb))

    def _install(self, update: _Update) -> None:
        self._params, self._serving = update.params, update.serving
        self._version = update.version
        latency = time.monotonic() - update.requested
        self._stats.swaps += 1
        self._stats.swap_s += latency
        self._stats.swap_max_s = max(self._stats.swap_max_s, latency)
        update.done.set()

    def _abort_now(self, aborts: list[threading.Event]) -> None:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        for p in waiting:
            self._running.add(p)
        for p in list(self._running):
            for j, s in enumerate(p.samples):
                if s.stop_reason is None:
                    self._end_sample(p, j, "aborted")
        for done in aborts:
            done.set()

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            pending = list(self._waiting) + list(self._running)
            self._waiting.clear()
            self._running.clear()
        self._slot_owner = [None] * self.slots
        for p in pending:
            if not p.future.done():
                p.future.set_exception(error)

    def _free_slots(self) -> list[int]:
        return [i for i, owner in enumerate(self._slot_owner) if owner is None]

    def _finish(self, pending: _Pending) -> None:
        self._running.discard(pending)
        self._stats.requests += 1
        pending.future.set_result(pending.response())

    def _end_sample(self, pending: _Pending, j: int, reason: StopReason) -> None:
        sample = pending.samples[j]
        sample.stop_reason = reason
        if reason == "aborted":
            self._stats.aborted += 1
        if sample.slot is not None:
            self._slot_owner[sample.slot] = None
            self._controls.active[sample.slot] = False
            sample.slot = None
        if all(s.stop_reason is not None for s in pending.samples):
            self._finish(pending)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._cond:
            expired = [p for p in self._waiting if p.deadline is not None and now > p.deadline]
            for p in expired:
                self._waiting.remove(p)
        for p in expired:
            self._running.add(p)
            for j in range(p.request.n):
                self._end_sample(p, j, "aborted")
        for p in [p for p in self._running if p.deadline is not None and now > p.deadline]:
            for j, s in enumerate(p.samples):
                if s.stop_reason is None:
                    self._end_sample(p, j, "aborted")

    def _admit(self) -> None:
        """Move waiting requests (in order) into free slots while the next one fits, and prefill
        them, ``PREFILL_ROWS`` prompts of one bucket per program call, so the weights are read
        once per call rather than once per request. Requests that arrive while the calls are
        dispatched are taken too (clients of a burst submit a moment apart)."""
        self._run_beams()
        started = time.monotonic()
        any_admitted = False
        while admitted := self._take_waiting():
            any_admitted = True
            taken_at = time.monotonic()  # a request taken on a later pass may have arrived after `started`
            by_bucket: dict[int, list[tuple[_Pending, list[int]]]] = {}
            for pending, rows in admitted:
                context = len(pending.request.prompt_ids) - 1  # the last prompt token is fed by the first decode step
                bucket = next(b for b in self.buckets if b >= max(context, 1))
                by_bucket.setdefault(bucket, []).append((pending, rows))
            for bucket in sorted(by_bucket):
                group = by_bucket[bucket]
                for first in range(0, len(group), self.prefill_rows):
                    self._prefill(bucket, group[first : first + self.prefill_rows], taken_at)
        if any_admitted:
            # Prefills run asynchronously: wait for them here so that their device time counts
            # as prefill_s, not as the next chunk's decode_s (engine/decode_ms_per_step).
            jax.block_until_ready(self._state)
            self._stats.prefill_s += time.monotonic() - started

    def _run_beams(self) -> None:
        """Run the waiting beam-search requests, one program call each (they take no slots: the
        running samples wait one call)."""
        with self._cond:
            beams = [p for p in self._waiting if p.request.beam]
            for p in beams:
                self._waiting.remove(p)
                self._running.add(p)
        for pending in beams:
            self._beam(pending)

    def _beam(self, pending: _Pending) -> None:
        """Beam search for ``pending`` (:func:`~asyncrl.engine.jax_programs._beam_search`); the
        ``n`` best beams become its samples, best first."""
        request = pending.request
        prompt = np.asarray(request.prompt_ids, np.int32)
        context = len(prompt) - 1
        bucket = next(b for b in self.buckets if b >= max(context, 1))
        ids = np.zeros(bucket, np.int32)
        ids[:context] = prompt[:context]
        stop_vocab = np.zeros(self.vocab_size, bool)
        stop_vocab[list(pending.stop_ids)] = True
        trie = request.constraint
        tries = None
        if trie is not None:
            root = self._trie_offset(trie)  # first: it may rebuild the pool's tables
            tries = (self._trie_tables, np.int32(root))
        started = time.monotonic()
        out = beam_search_jit(self.graphdef, self._serving, ids, np.arange(bucket) < context, np.int32(prompt[-1]), stop_vocab,
                              np.float32(request.length_penalty), tries, k=request.n, max_new=request.max_new_tokens,
                              capacity=bucket + request.max_new_tokens, max_branch=self._tries.max_branch if trie else 0,
                              platform=self.platform)
        tokens, logprobs, lengths, scores = (np.asarray(x) for x in out)
        self._stats.beam_calls += 1
        self._stats.beam_s += time.monotonic() - started
        for j, sample in enumerate(pending.samples):
            n = int(lengths[j])
            sample.tokens, sample.logprobs = tokens[j, :n].tolist(), logprobs[j, :n].tolist()
            sample.versions = [self._version] * n
            sample.score = float(scores[j])
            if trie is not None:
                sample.stop_reason = "stop" if trie.contains(sample.tokens) else "length"
            else:
                sample.stop_reason = "eos" if n and sample.tokens[-1] in pending.stop_set else "length"
        self._finish(pending)

    def _take_waiting(self) -> list[tuple[_Pending, list[int]]]:
        """Pop waiting requests in order while the next one fits in the free slots; each with
        the slots it will fill (not yet owned: :meth:`_prefill` takes them)."""
        admitted: list[tuple[_Pending, list[int]]] = []
        free = self._free_slots()
        with self._cond:
            while self._waiting and self._waiting[0].request.n <= len(free) and not self._waiting[0].request.beam:
                pending = self._waiting.popleft()
                self._running.add(pending)
                n = pending.request.n
                admitted.append((pending, free[:n]))
                free = free[n:]
        return admitted

    def _prefill(self, bucket: int, group: list[tuple[_Pending, list[int]]], admitted_at: float) -> None:
        """Prefill ``group`` (up to ``prefill_rows`` requests and their slots, prompts of ``bucket``
        tokens at most) in one call: prompt row ``r`` is request ``r``'s ``prompt[:-1]``,
        right-padded; rows past the group are all padding."""
        plan = PrefillPlan.empty(self.prefill_rows, bucket, self.slots)
        k = 0  # destinations filled so far
        for row, (pending, slots) in enumerate(group):
            request = pending.request
            wait = admitted_at - pending.submitted
            self._stats.admitted += 1
            self._stats.queue_wait_s += wait
            self._stats.queue_wait_max_s = max(self._stats.queue_wait_max_s, wait)
            prompt = np.asarray(request.prompt_ids, np.int32)
            context = len(prompt) - 1
            plan.prompt_ids[row, :context] = prompt[:context]
            plan.prompt_mask[row, :context] = True
            for j, slot in enumerate(slots):
                plan.src_rows[k], plan.dst_rows[k] = row, slot
                plan.sample_id[k], plan.turn[k] = request.sample_id % 2**32, request.turn % 2**32
                plan.key_index[k] = (request.index_in_group + j) % 2**32
                k += 1
                self._slot_owner[slot] = (pending, j)
                pending.samples[j].slot = slot
                self._start_slot(slot, request, pending.stop_ids, int(prompt[-1]))
            self._stats.prefill_tokens += context
        self._stats.prefill_calls += 1
        self._state = prefill_insert_jit(self.graphdef, self._serving, self._state, plan, self._root_key, self._layout,
                                             self.platform)

    def _start_slot(self, slot: int, request: GenerationRequest, stop_ids: tuple[int, ...], last_token: int) -> None:
        """Set a freshly prefilled slot's controls from its request."""
        c = self._controls
        c.last_token[slot], c.generated[slot], c.active[slot] = last_token, 0, True
        c.greedy[slot] = request.greedy
        c.temperature[slot] = 1.0 if request.greedy else request.temperature
        c.top_k[slot] = 0 if request.greedy else request.top_k
        c.top_p[slot] = 1.0 if request.greedy else request.top_p
        c.min_new_tokens[slot], c.max_new_tokens[slot] = request.min_new_tokens, request.max_new_tokens
        c.stop_ids[slot] = -1
        c.stop_ids[slot, : len(stop_ids)] = stop_ids
        c.node[slot] = -1
        if request.constraint is not None:
            c.node[slot] = self._trie_offset(request.constraint)

    def _trie_offset(self, trie: TokenTrie) -> int:
        """``trie``'s node offset in the engine's pool, adding it (with the tries still in use, whose
        slots' nodes are moved to their new offsets) when it is new."""
        offset = self._tries.offset(trie)
        if offset is not None:
            return offset
        live = [(owner[0].request.constraint, owner[0].samples[owner[1]], slot) for slot, owner in enumerate(self._slot_owner)
                if owner is not None and owner[0].request.constraint is not None and self._controls.node[slot] >= 0]
        self._tries.rebuild([t for t, _, _ in live] + [trie])
        for live_trie, sample, slot in live:
            self._controls.node[slot] = self._tries.require(live_trie) + sample.node
        assert self._tries.tables is not None
        replicated = (jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()) if self._layout is not None
                      else self._state_shardings())
        self._trie_tables = jax.device_put(self._tries.tables, replicated)
        return self._tries.require(trie)

    def _decode(self) -> None:
        started = time.monotonic()
        c = self._controls
        active = c.active.copy()
        filtered = bool(np.any(active & ((c.top_k > 0) | (c.top_p < 1.0))))
        constrained = bool(np.any(active & (c.node >= 0)))
        with self._cond:
            # A slot freed inside the chunk ends it early when the next waiting request fits and
            # (with PAIRED_REFILL_MIN_SLOTS or more) prefill_rows slots are free: two prompts
            # prefill in one call for about the price of one, while the first freed slot idles
            # only until the next finish. With none waiting the same holds: a client usually
            # submits again at once.
            pair = self.prefill_rows if self.slots >= PAIRED_REFILL_MIN_SLOTS else 1
            c.refill_free[...] = max(self._waiting[0].request.n if self._waiting else 1, pair)
        version = self._version
        contexts = (len(owner[0].request.prompt_ids) - 1 + int(c.generated[slot])
                    for slot, owner in enumerate(self._slot_owner) if active[slot] and owner is not None)
        self._state, tokens, logprobs, emitted = decode_chunk_jit(
            self.graphdef, self._serving, self._state, snapshot(c), self.chunk, filtered, self._layout,
            self._trie_tables if constrained else None, self._tries.max_branch if constrained else 0,
            **self._decode_options(chunk_bucket(self.attention_buckets, contexts, self.chunk)),
        )
        dispatched = time.monotonic()
        tokens, logprobs, emitted = np.asarray(tokens), np.asarray(logprobs), np.asarray(emitted)
        ready = time.monotonic()
        steps = int(emitted.any(axis=0).sum())
        self._stats.decode_steps += steps
        self._stats.decode_tokens += int(emitted.sum())
        for slot in map(int, np.flatnonzero(active)):
            owner = self._slot_owner[slot]
            assert owner is not None, f"active slot {slot} has no owner"
            pending, j = owner
            self._consume(pending, j, slot, tokens[slot], logprobs[slot], emitted[slot], version)
        finished = time.monotonic()
        self._freed = int(np.sum(active & ~c.active))
        self._step_s = (finished - started) / max(steps, 1)
        self._stats.decode_s += finished - started
        self._stats.decode_wait_s += ready - dispatched
        self._stats.decode_host_s += (dispatched - started) + (finished - ready)

    def _await_refill(self) -> None:
        """After a chunk that freed slots, give the callers whose requests just finished a moment
        to submit their next ones before the next chunk starts without them: until waiting
        samples cover the freed slots (so they are prefilled together, ``prefill_rows`` per
        call), at most a tenth of a decode step (an idle slot would otherwise wait for the next
        chunk boundary)."""
        if not self._freed:
            return
        started = time.monotonic()
        deadline = started + min(0.1 * self._step_s, 0.05)
        with self._cond:
            while not (sum(p.request.n for p in self._waiting) >= self._freed or self._closed
                       or self._update is not None or self._aborts):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        self._stats.refill_wait_s += time.monotonic() - started

    def _consume(self, pending: _Pending, j: int, slot: int, tokens, logprobs, emitted, version: int) -> None:
        """Append one slot's chunk output to its sample and end the sample when it stopped."""
        request = pending.request
        sample = pending.samples[j]
        trie = request.constraint
        for t in np.flatnonzero(emitted):
            token = int(tokens[t])
            sample.tokens.append(token)
            sample.logprobs.append(float(logprobs[t]))
            sample.versions.append(version)
            index = len(sample.tokens) - 1
            if trie is not None:  # the device followed the same trie: the token is allowed
                sample.node = trie.child(sample.node, token)
                if trie.is_leaf(sample.node):
                    return self._end_sample(pending, j, "stop")
            elif index >= request.min_new_tokens:
                if token in pending.stop_set:
                    return self._end_sample(pending, j, "eos")
                for seq in pending.stop_sequences:
                    if sample.tokens[-len(seq):] == seq:
                        return self._end_sample(pending, j, "stop")
            if len(sample.tokens) >= request.max_new_tokens:
                return self._end_sample(pending, j, "length")
        self._controls.last_token[slot] = sample.tokens[-1]
        self._controls.generated[slot] = len(sample.tokens)
        if trie is not None:
            self._controls.node[slot] = self._tries.require(trie) + sample.node


def _model_config(graphdef: Any, params: Any) -> Any:
    """The :class:`~asyncrl.model.DecoderConfig` the graphdef was built with."""
    cfg = graphdef_config(graphdef, params)
    if cfg is None:
        raise EngineRequestError("JaxEngine: the graphdef is not an asyncrl Decoder (no .cfg)")
    return cfg


# --------------------------------------------------------------------------- publishing across devices


def move_params(params: Any, shardings: Any) -> Any:
    """``params`` (a pytree of arrays, e.g. the trainer's, on any devices) put on ``shardings``
    (the engine's), device to device.

    ``jax.device_put`` copies a shard device to device only when the source array already
    holds a shard with the exact index range the target device needs (or lives on one
    device, which it slices there); otherwise (JAX 0.10's ``shard_sharded_device_array_slow_path``)
    it goes through ``np.asarray`` of the whole array on the host. So a leaf whose source
    shards do not cover the target's (the trainer's fsdp split vs the engine's tensor split)
    is first replicated over its own devices by a jitted identity (XLA's all-gather, on
    device), and the engine's shards are sliced from one replica on device. Host values
    (numpy) are simply ``device_put``.
    """
    leaves, treedef = jax.tree.flatten(params)
    targets = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    assert len(targets) == len(leaves), "shardings do not match the params' structure"
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
        raise ValueError("JaxEngine: params span other processes' devices; every process calls "
                         "asyncrl.engine.jax_engine.local_copy on them and process 0 hands its copies to the engine")
    gather = [i for i, (x, s) in enumerate(zip(leaves, targets)) if not _copies_directly(x, s)]
    for i, whole in zip(gather, local_copy([leaves[i] for i in gather])):
        leaves[i] = whole
    moved = jax.device_put(leaves, targets)
    return jax.tree.unflatten(treedef, moved)


COPY_GROUP_BYTES = 128 << 20
"""Bytes :func:`local_copy` replicates per program: what a device holds beyond its own shards while
it runs (the model never is whole on every device at once)."""


def local_copy(arrays: list, group_bytes: int = COPY_GROUP_BYTES) -> list:
    """Each array (on a ``NamedSharding``) as one single-device array holding all of it, on one of
    this process's devices: replicated over its own mesh by a jitted identity (an all-gather on
    device), a group of at most ``group_bytes`` at a time, then one replica of each kept (the other
    replicas are freed before the next group). With several processes every process must call it
    (collectives over the params' mesh); process 0 then hands the copies to its engine."""
    by_mesh: dict[Any, list[int]] = {}
    for i, x in enumerate(arrays):
        by_mesh.setdefault(x.sharding.mesh, []).append(i)
    out = list(arrays)
    for mesh, indices in by_mesh.items():
        for group in _byte_groups(indices, [arrays[i].nbytes for i in indices], group_bytes):
            replicated = _replicate_jit(mesh)([arrays[i] for i in group])
            for i, full in zip(group, replicated):
                out[i] = full.addressable_shards[0].data
            del replicated
    return out


def _byte_groups(items: list, sizes: list[int], budget: int) -> list[list]:
    """``items`` in order, cut into runs of at most ``budget`` bytes (an item larger than it alone)."""
    groups: list[list] = []
    size = 0
    for item, nbytes in zip(items, sizes):
        if not groups or (size + nbytes > budget and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups


def _copies_directly(x: Any, target: Any) -> bool:
    """True when ``device_put(x, target)`` needs no host round trip: ``x`` is not a device
    array (host data is uploaded anyway), lives on one device, or holds every index range
    ``target`` asks for; also when it cannot be regathered here (not a ``NamedSharding``)."""
    if not isinstance(x, jax.Array) or len(x.sharding.device_set) == 1:
        return True
    if not isinstance(x.sharding, jax.sharding.NamedSharding):
        return True

    def ranges(sharding: Any) -> set:
        return {tuple(sl.indices(n) for sl, n in zip(idx, x.shape))
                for idx in sharding.addressable_devices_indices_map(x.shape).values()}

    return ranges(target) <= ranges(x.sharding)


_REPLICATORS: dict[Any, Any] = {}


def _replicate_jit(mesh: Any) -> Any:
    """A jitted identity whose outputs are replicated over ``mesh`` (one per mesh, so the
    program compiles once per parameter structure)."""
    if mesh not in _REPLICATORS:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        _REPLICATORS[mesh] = jax.jit(_identity, out_shardings=replicated)
    return _REPLICATORS[mesh]


def _identity(tree: Any) -> Any:
    return tree
