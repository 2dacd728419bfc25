"""JaxEngine: continuously batched, jitted KV-cache sampling behind the InferenceEngine protocol.

Parts and threads
-----------------
:class:`JaxEngine` is the protocol's facade over three parts, each the owner of its state: the
scheduler (:mod:`asyncrl.engine.scheduler`: the waiting queue, admission, chunk boundaries, each
sample's record, :class:`~asyncrl.engine.requests.Sequence`; no device arrays), the KV cache
manager (:mod:`asyncrl.engine.kv_cache_manager`: where each sequence's KV lies and what a new
request can reuse) and the model runner (:mod:`asyncrl.engine.model_runner`: the device state,
the serving copy and its shardings, the jitted programs). ``generate``/``submit`` (any thread)
validate the request on the caller's thread and hand it to the scheduler's queue. The scheduler's
daemon thread makes every device call through the runner: it installs published weights, admits
waiting requests into free slots (their contexts prefilled into pages, less what they share),
decodes one chunk of tokens for all slots,
hands finished requests back through their futures, and repeats. ``update_weights`` (the
trainer's thread) hands the new parameters to the scheduler and waits until they are installed,
which happens between two chunks (at once when idle).

Device state and programs (:mod:`asyncrl.engine.jax_programs`)
---------------------------------------------------------------
Each engine replica owns one pool of KV pages (``engine.kv_pages`` pages of ``engine.page_size``
positions; :class:`~asyncrl.model.kv_cache.PagedKVCache`). A sequence holds the pages of its own
tokens and takes more page by page as it grows; sequences with a common prefix (a group's
samples, an episode's turns) hold that prefix's pages once, by reference, and a kept prefix stays
in the KV cache manager's radix tree until the pool needs its pages (least recently used first).
``engine.slots`` is the most sequences decoded together, ``engine.kv_capacity`` the longest
context one may reach. When the pool runs out, the most recently admitted sequence is preempted:
its pages go back, it is requeued with the tokens it has, and it later resumes with the same
keys, so it draws the same tokens (``engine/preemptions`` counts these). The requests admitted at
one chunk boundary are prefilled together, in chunks of at most the largest prefill bucket,
:data:`~asyncrl.engine.jax_programs.PREFILL_ROWS` rows per replica and call (a fixed row count,
so a prompt's KV is bitwise the same whatever is prefilled beside it); a request with ``n``
samples prefills ``prompt[:-1]`` once and its samples share those pages. The
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
module-level jits shared by every engine with the same model shapes, listed in
:mod:`asyncrl.engine.jax_programs` (:func:`compile_count`, reported as ``engine/compiles``). The sampler (``engine.sampler``), the XLA flags and the decode steps per
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
from asyncrl.engine.constraints import TokenTrie
from asyncrl.engine.jax_programs import compile_count
from asyncrl.engine.kv_cache_manager import KVCacheManager
from asyncrl.engine.model_runner import ModelRunner
from asyncrl.engine.protocol import GenerationRequest, GenerationResponse
from asyncrl.engine.requests import EngineStats, Pending, Update
from asyncrl.engine.scheduler import Scheduler
from asyncrl.errors import EngineClosed, EngineRequestError
from asyncrl.registry import register

__all__ = ["JaxEngine"]

logger = logging.getLogger("asyncrl.engine")


@register("engine", "jax")
class JaxEngine:
    """The :class:`~asyncrl.engine.protocol.InferenceEngine` on a Flax NNX decoder: the protocol's
    facade over three parts that each own their state (docs/design.md "The engine"): the
    scheduler (:class:`~asyncrl.engine.scheduler.Scheduler`: requests, admission, chunk
    boundaries; no device arrays), the KV cache manager
    (:class:`~asyncrl.engine.kv_cache_manager.KVCacheManager`: where each sequence's KV lies, what
    can be reused) and the model runner (:class:`~asyncrl.engine.model_runner.ModelRunner`: device
    state, shardings, the jitted programs).

    Args:
        graphdef, params: from :func:`asyncrl.model.split_params` (params: a pure dict of
            arrays or an ``nnx.State``). Without ``mesh``, params already on devices keep
            their shardings (the engine serves the trainer's own arrays: the placement of one
            device) and others go to the first device. Later ``update_weights`` params are
            put on the same shardings.
        mesh: the engine's own device mesh (axes ``data``, ``fsdp``, ``tensor``: replicas x 1 x
            tensor-parallel degree; :func:`asyncrl.cluster.placement.engine_mesh` builds it). Params
            are placed on it by the model's partition rules, each replica has a KV page pool of its
            own (pages split over the replicas, KV heads over ``tensor``), and published params are laid out on
            it device to device (:func:`~asyncrl.engine.device_copy.serving_copy`: the engine keeps
            only that compute-dtype copy, made at the next chunk boundary after the previous one
            is dropped).
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
        if hasattr(params, "to_pure_dict"):
            params = params.to_pure_dict()
        if mesh is not None:
            replicas = int(mesh.shape["data"]) * int(mesh.shape["fsdp"])
            if cfg.slots % replicas:
                raise EngineRequestError(f"engine.slots = {cfg.slots} is not a multiple of the engine's {replicas} replicas "
                                         f"(each decodes an equal share); use {slots_for_replicas(cfg.slots, replicas)}")
        self.graphdef = graphdef
        self.mesh = mesh
        self.slots = cfg.slots
        self.capacity = cfg.kv_capacity
        self.chunk = cfg.decode_chunk
        self.buckets = tuple(sorted(b for b in set(cfg.prefill_buckets) if b <= cfg.kv_capacity))
        if not self.buckets:
            raise EngineRequestError(f"engine.prefill_buckets {cfg.prefill_buckets}: none fits engine.kv_capacity = {cfg.kv_capacity}")
        self.runner = runner = ModelRunner(graphdef, params, cfg, mesh)
        self.model_config = runner.model_config
        self.vocab_size = runner.vocab_size
        self.page_size = runner.page_size
        self.kv_pages = runner.pages_per_replica
        """Pages in each replica's KV pool (``engine.kv_pages`` resolved)."""
        self.default_stop_ids = tuple(int(t) for t in stop_token_ids)
        self._check_stop_ids(self.default_stop_ids, "stop_token_ids (the model's default)")
        # the CPU's views of the pages a chunk reads: each row's first pages, or every active row's pages as one
        # list (a shared page once per row that reads it)
        self.view_sizes = attention_buckets(runner.pages_per_seq, cfg.attention_buckets)
        self.flat_sizes = attention_buckets(cfg.slots // runner.replicas * runner.pages_per_seq, cfg.attention_buckets)
        # and of the rows a chunk runs (a CPU step costs every row it runs, busy or not)
        self.row_sizes = attention_buckets(cfg.slots // runner.replicas, cfg.attention_buckets) if runner.flat_attention else ()
        reuse = cfg.prefix_cache
        self.extend_buckets = tuple(sorted({b for b in [*reuse.extend_buckets, *self.buckets] if b <= cfg.kv_capacity}))
        self.cache = KVCacheManager(runner.page_size, runner.pages_per_replica, runner.replicas, cfg.kv_capacity,
                                    reuse.enabled, reuse.across_versions)
        self.seed = seed
        self._root_key = np.asarray(jax.random.PRNGKey(seed))
        self._stats = EngineStats()
        self.scheduler = Scheduler(cfg, runner, self.cache, self._stats, self._root_key, int(version), self.buckets,
                                   self.extend_buckets, self.flat_sizes, self.view_sizes, self.row_sizes)
        self._warned_truncation = False
        self._started = time.monotonic()
        if warmup:
            self.warmup()
        self._thread = threading.Thread(target=self.scheduler.run, name="asyncrl-jax-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ protocol

    @property
    def version(self) -> int:
        return self.scheduler.version

    @property
    def served_params(self) -> Any:
        """The params of :attr:`version` in their own dtype (read-only: ``asyncrl serve`` reuses the
        leaves a new version leaves unchanged instead of reading them again), or None where the
        engine holds only its compute-dtype serving copy (a mesh of its own, weights stored wider
        than they are computed in)."""
        return self.runner.params

    @property
    def kernel(self) -> Any:
        """The attention kernels' target (the engine's mesh, or its devices' platform and count)."""
        return self.runner.kernel

    @property
    def platform(self) -> str:
        return self.runner.platform

    @property
    def sampler(self) -> str:
        """``engine.sampler`` resolved for the engine's platform."""
        return self.runner.sampler

    @property
    def inner_steps(self) -> int:
        """``engine.decode_inner_steps`` resolved for the engine's platform."""
        return self.runner.inner_steps

    @property
    def prefill_rows(self) -> int:
        return self.runner.prefill_rows

    def generate(self, request: GenerationRequest) -> list[GenerationResponse]:
        return self.submit(request).result()

    def submit(self, request: GenerationRequest) -> "Future[list[GenerationResponse]]":
        stop_ids = self._validate(request)
        timeout = request.timeout_s if request.timeout_s is not None else self.config.request_timeout_s
        pending = Pending(request, stop_ids, None if timeout is None else time.monotonic() + timeout)
        self.scheduler.submit(pending)
        return pending.future

    def update_weights(self, params: Any, version: int) -> None:
        if hasattr(params, "to_pure_dict"):
            params = params.to_pure_dict()
        scheduler = self.scheduler
        with scheduler.cond:
            scheduler.raise_if_unusable()
            if scheduler.update is not None:
                raise ValueError("update_weights: another update is still being installed (publish from one thread)")
            if version != scheduler.version + 1:
                raise ValueError(f"update_weights: version must be {scheduler.version + 1} (engine serves {scheduler.version}), "
                                 f"given {version}")
        if self.runner.treedef != jax.tree.structure(params):
            raise ValueError("update_weights: params do not have the structure of the served model's params")
        avals = [(np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(params)]
        if avals != self.runner.avals:
            bad = [i for i, (a, b) in enumerate(zip(avals, self.runner.avals)) if a != b]
            raise ValueError(f"update_weights: {len(bad)} parameter(s) differ in shape or dtype from the served ones (first: leaf "
                             f"{bad[0]}: {avals[bad[0]]} vs {self.runner.avals[bad[0]]})")
        update = Update(params, version)
        scheduler.post_update(update)
        while not update.done.wait(1.0):
            with scheduler.cond:
                if (scheduler.closed or scheduler.crash is not None) and not update.done.is_set():
                    break
        if update.error is not None:
            raise update.error
        if not update.done.is_set():
            scheduler.raise_if_unusable()

    def flush_prefixes(self) -> None:
        """Forget every kept prefix (``asyncrl serve``'s ``/flush_cache``): requests admitted from
        the next chunk boundary on prefill whole prompts, until their own KV is kept again."""
        self.scheduler.post_flush()

    def abort_all(self, timeout: float = 60.0) -> None:
        """End every waiting and running sample at the next chunk boundary, keeping the tokens it
        has (``stop_reason == "aborted"``); returns once done. ``asyncrl serve`` calls this on
        ``/pause_generation`` so that no request runs across a weight update."""
        done = threading.Event()
        self.scheduler.post_abort(done)
        if not done.wait(timeout):
            self.scheduler.raise_if_unusable()
            raise TimeoutError(f"JaxEngine.abort_all: not done within {timeout} s")

    # ------------------------------------------------------------------ lifecycle, metrics

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the scheduler: pending and running requests fail with :class:`EngineClosed`."""
        self.scheduler.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.scheduler.fail_all(EngineClosed("the inference engine was shut down"))

    close = shutdown

    def __enter__(self) -> "JaxEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    @property
    def prefill_calls(self) -> int:
        """Prefill program calls so far (one per ``prefill_rows`` context chunks of one bucket
        admitted together). Not in :meth:`metrics`: how arrivals group into calls depends on timing."""
        return self._stats.prefill_calls

    @property
    def crashed(self) -> Optional[str]:
        """The scheduler thread's traceback if it died, else None."""
        return self.scheduler.crash

    def warmup(self) -> int:
        """Compile every program (each prefill and extension bucket, the page copy, both decode
        variants per size class of the CPU's attention and rows); returns the compile count."""
        self.runner.warmup(self.buckets, self.extend_buckets, self.flat_sizes, self.view_sizes, self._root_key,
                           self.scheduler.row_sizes)
        return compile_count()

    def metrics(self) -> dict[str, float]:
        """Cumulative figures since start (``engine/...``). ``decode_s`` (wall time of decode
        chunks) splits into ``decode_wait_s`` (blocked on a chunk's results: device time not
        hidden by host work) and ``decode_host_s`` (dispatch, control upload, per-slot
        bookkeeping on the scheduler thread); ``refill_wait_s`` is the time spent after chunks
        that freed slots waiting (briefly) for callers to submit again."""
        s = self._stats
        slot_steps = s.decode_steps * self.slots
        return {
            "engine/version": float(self.version),
            "engine/compiles": float(compile_count()),
            "engine/requests": float(s.requests),
            "engine/samples_aborted": float(s.aborted),
            "engine/waiting": float(self.scheduler.waiting_samples()),
            "engine/slot_occupancy": s.decode_tokens / slot_steps if slot_steps else 0.0,
            "engine/queue_wait_s": s.queue_wait_s / s.admitted if s.admitted else 0.0,
            "engine/queue_wait_max_s": float(s.queue_wait_max_s),
            "engine/prefill_tokens": float(s.prefill_tokens),
            "engine/prefix_hit_tokens": float(s.prefix_hit_tokens),
            "engine/prefix_hit_rate": (s.prefix_hit_tokens / (s.prefix_hit_tokens + s.prefill_tokens)
                                       if s.prefix_hit_tokens + s.prefill_tokens else 0.0),
            "engine/kv_pages_used": self.cache.used_fraction(),
            "engine/kv_pages_kept": self.cache.kept_fraction(),
            "engine/preemptions": float(s.preemptions),
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
        self.scheduler.raise_if_unusable()
        prompt = request.prompt_ids
        length = len(prompt)
        if length + request.max_new_tokens > self.capacity:
            raise EngineRequestError(
                f"GenerationRequest: prompt ({length} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds "
                f"engine.kv_capacity = {self.capacity}"
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

