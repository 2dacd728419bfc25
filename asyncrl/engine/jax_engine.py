"""JaxEngine: continuously batched, jitted KV-cache sampling behind the InferenceEngine protocol.

Threads
-------
``generate``/``submit`` (any thread) validate the request on the caller's thread and put
it on a queue. One daemon scheduler thread owns every device call: it installs published
weights, admits waiting requests into free slots (prefill + copy), decodes one chunk of
tokens for all slots, hands finished requests back through their futures, and repeats.
``update_weights`` (the trainer's thread) hands the new parameters to the scheduler and
waits until they are installed, which happens between two chunks (at once when idle).

Device state
------------
A fixed number of batch slots (``engine.slots``) over one KV cache of fixed capacity
(``engine.kv_capacity``; :mod:`asyncrl.model.transformer` documents the slot protocol),
plus one random key per slot. A request with ``n`` samples prefills ``prompt[:-1]`` once
into a batch-1 cache whose capacity is the smallest prefill bucket that holds it, and that
row is copied into ``n`` free slots. The last prompt token is fed by the first decode step,
so every sampled token (the first one included) comes out of the same decode program.
Finished slots are refilled from the queue at the next chunk boundary (continuous batching).

Compiled programs (module-level jits, shared by every engine with the same model shapes)
--------------------------------------------------------------------------------------
* ``prefill_insert``: one per prefill bucket;
* ``decode_chunk``: up to ``engine.decode_chunk`` steps in a ``lax.while_loop`` (it exits
  early once every slot is done), in two variants: plain sampling, and sampling with
  top-k/top-p (two threshold searches over the vocabulary), used only for chunks in which
  some slot asks for it.

So at most ``len(prefill_buckets) + 2`` programs per model; :func:`compile_count` counts
traces (each trace is one compilation) and is reported as ``engine/compiles``.

Sampling and randomness (DESIGN "Randomness", "Log-probabilities")
-----------------------------------------------------------------
Per slot, on float32 logits: stop ids are masked while fewer than ``min_new_tokens`` tokens
were generated; greedy takes the argmax; otherwise the ``i``-th generated token is drawn from
``softmax(logits / T)`` (after top-k, then top-p, when asked) by inverting its CDF at
``uniform(fold_in(key, i))``. The slot key is
``fold_in(fold_in(fold_in(PRNGKey(seed), sample_id), index_in_group + j), turn)`` for sample
``j``: it never depends on the slot, the batch or the arrival order, and the batch shape is
fixed, so a seeded request draws the same tokens whatever runs beside it. The reported
log-prob is ``log_softmax(logits / T)[token]`` of the untruncated, unmasked logits (T = 1
for greedy), i.e. what :func:`~asyncrl.model.per_token_logprobs` gives on the full sequence.
Stop ids end a sample on device; stop sequences are matched on the host after each chunk
(tokens a slot drew past the match are discarded).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncrl.config import EngineConfig
from asyncrl.engine.protocol import GenerationRequest, GenerationResponse
from asyncrl.errors import EngineClosed, EngineCrashed, EngineRequestError
from asyncrl.model.transformer import KVCache, hidden_states, rope_cos_sin
from asyncrl.registry import register

logger = logging.getLogger("asyncrl.engine")

# Columns of the per-slot int32 control array passed to every decode chunk.
_LAST, _NGEN, _ACTIVE, _GREEDY, _TOPK, _MINNEW, _MAXNEW, _STOP0 = range(8)
# Columns of the per-slot float32 control array.
_TEMP, _TOPP = range(2)

_compiles: collections.Counter = collections.Counter()
_compiles_lock = threading.Lock()


def compile_count() -> int:
    """Programs compiled by engines in this process (a jit trace is a compilation)."""
    with _compiles_lock:
        return sum(_compiles.values())


def _count_trace(name: str) -> None:
    # Runs only while jax traces (i.e. on a cache miss, right before compiling).
    with _compiles_lock:
        _compiles[name] += 1


class SlotState(NamedTuple):
    """Device state of the slots (donated to every call).

    The KV cache follows :mod:`asyncrl.model.transformer`'s protocol, but is held as one
    array per layer: the model's stacked ``[layers, ...]`` cache would be sliced and
    re-stacked (copied whole) at every decode step, which costs more than the step's
    attention itself.
    """

    k: tuple  # per layer: [slots, capacity, kv_heads, head_dim] (compute dtype)
    v: tuple  # per layer: [slots, capacity, kv_heads, head_dim]
    valid: jax.Array  # bool [slots, capacity]: slot holds a real token
    write_pos: jax.Array  # int32 [slots]: where each slot's next token is written
    keys: jax.Array  # uint32 [slots, 2]: each slot's sample key (before the token fold)


def init_slot_state(cfg: Any, slots: int, capacity: int) -> SlotState:
    dtype = jnp.dtype(cfg.compute_dtype)
    shape = (slots, capacity, cfg.num_kv_heads, cfg.head_dim)
    return SlotState(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
        valid=jnp.zeros((slots, capacity), bool),
        write_pos=jnp.zeros((slots,), jnp.int32),
        keys=jnp.zeros((slots, 2), jnp.uint32),
    )


# --------------------------------------------------------------------------- device programs


def _prefill_insert(graphdef, params, state: SlotState, prompt_ids, prompt_mask, dst_rows, root_key, sample_id, turn, key_index):
    """Prefill one prompt and copy it into slots ``dst_rows``.

    ``prompt_ids``/``prompt_mask`` [1, bucket] (right-padded; the mask may be all false);
    ``dst_rows`` int32 [slots], entries ``>= slots`` are ignored; ``key_index`` uint32
    [slots]: the key index (``index_in_group + j``) of each destination row.
    """
    _count_trace("prefill_insert")
    slots, capacity, kv_heads, head_dim = state.k[0].shape
    layers = len(state.k)
    bucket = prompt_ids.shape[1]
    small = KVCache(
        k=jnp.zeros((layers, 1, bucket, kv_heads, head_dim), state.k[0].dtype),
        v=jnp.zeros((layers, 1, bucket, kv_heads, head_dim), state.v[0].dtype),
        valid=jnp.zeros((1, bucket), bool),
        write_pos=jnp.zeros((1,), jnp.int32),
    )
    _, small = hidden_states(graphdef, params, prompt_ids, None, prompt_mask, small)
    row_shape = (slots, bucket, kv_heads, head_dim)
    k = tuple(state.k[i].at[dst_rows, :bucket].set(jnp.broadcast_to(small.k[i], row_shape), mode="drop") for i in range(layers))
    v = tuple(state.v[i].at[dst_rows, :bucket].set(jnp.broadcast_to(small.v[i], row_shape), mode="drop") for i in range(layers))
    row_valid = jnp.zeros((capacity,), bool).at[:bucket].set(small.valid[0])
    valid = state.valid.at[dst_rows].set(jnp.broadcast_to(row_valid, (slots, capacity)), mode="drop")
    write_pos = state.write_pos.at[dst_rows].set(jnp.broadcast_to(small.write_pos[0], (slots,)), mode="drop")
    base = jax.random.fold_in(root_key, sample_id)
    new_keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(base, i), turn))(key_index)
    keys = state.keys.at[dst_rows].set(new_keys, mode="drop")
    return SlotState(k, v, valid, write_pos, keys)


def _decode_logits(model, tokens, active, k, v, valid, write_pos):
    """One decode step of every slot: the model's KV-cache forward with ``T = 1``
    (``asyncrl.model.transformer`` protocol) on per-layer cache arrays.

    ``tokens`` int32 [S] (each slot's last token), ``active`` bool [S] (idle slots write
    nothing valid). Returns float32 logits [S, V] and the updated ``k, v, valid, write_pos``.
    """
    cfg = model.cfg
    slots, capacity = valid.shape
    rows = jnp.arange(slots)[:, None]
    positions = valid.sum(axis=1).astype(jnp.int32)[:, None]  # real tokens so far
    write_idx = write_pos[:, None]  # [S, 1]
    valid = valid.at[rows, write_idx].set(active[:, None], mode="drop")
    mask = valid[:, None, :] & (jnp.arange(capacity, dtype=jnp.int32)[None, None, :] <= write_idx[:, :, None])
    cos, sin = rope_cos_sin(cfg, positions)
    x = model.embed_tokens(tokens[:, None])
    new_k, new_v = [], []
    for i, layer in enumerate(model.layers):
        x, (k_i, v_i) = layer(x, cos, sin, mask, k[i], v[i], write_idx)
        new_k.append(k_i)
        new_v.append(v_i)
    logits = model.logits(model.norm(x))[:, 0].astype(jnp.float32)
    return logits, tuple(new_k), tuple(new_v), valid, (write_pos + active.astype(jnp.int32)).astype(jnp.int32)


def _ordered_int(x: jax.Array) -> jax.Array:
    """int32 keys that order like the float32 values ``x`` (for exact bisection on floats)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _largest_threshold(keys: jax.Array, ok, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Per row, the largest int32 ``t`` in ``[lo, hi]`` with ``ok(keys, t)`` (monotone: true up to
    some point); ``lo`` when none. 32 halvings of the int32 range, each a pass over ``keys``."""

    def body(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1) + ((lo ^ hi) & 1)  # ceil((lo + hi) / 2) without overflow
        good = ok(keys, mid[:, None]) & (mid <= hi)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return lo


def _top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask ``scaled`` [S, V] to each row's top-k, then to the smallest set of its most likely
    remaining tokens with probability mass >= top-p (ties at a threshold are kept). Rows with
    ``top_k == 0`` / ``top_p >= 1`` are left exactly as they are.

    Thresholds are found by bisection over the float bit patterns rather than by sorting the
    vocabulary: a sort of [S, V] costs ~100x more than a sampling step on CPU.
    """
    rows = scaled.shape[0]
    int_min = jnp.full((rows,), jnp.iinfo(jnp.int32).min, jnp.int32)
    int_max = jnp.full((rows,), jnp.iinfo(jnp.int32).max, jnp.int32)
    keys = _ordered_int(scaled)
    kth = _largest_threshold(keys, lambda k, t: jnp.sum(k >= t, axis=-1) >= top_k, int_min, int_max)
    after_k = jnp.where((top_k[:, None] > 0) & (keys < kth[:, None]), -jnp.inf, scaled)
    probs = jax.nn.softmax(after_k, axis=-1)
    prob_keys = _ordered_int(probs)  # probs >= 0: keys are the bit patterns, in [0, inf bits]
    mass_ok = lambda k, t: jnp.sum(jnp.where(k >= t, probs, 0.0), axis=-1) >= top_p
    nucleus = _largest_threshold(prob_keys, mass_ok, jnp.zeros((rows,), jnp.int32), jnp.full((rows,), 0x7F800000, jnp.int32))
    return jnp.where((top_p[:, None] < 1.0) & (prob_keys < nucleus[:, None]), -jnp.inf, after_k)


def _sample(keys: jax.Array, scaled: jax.Array) -> jax.Array:
    """One draw per row from ``softmax(scaled)`` [S, V] by inverting its CDF at one uniform
    per row (one random number per token instead of V Gumbels: the RNG is most of a
    sampling step's cost on CPU). Zero-probability tokens are never drawn."""
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    cdf = jnp.cumsum(jax.nn.softmax(scaled, axis=-1), axis=-1)
    x = u * cdf[:, -1]
    return jnp.minimum(jnp.sum(cdf <= x[:, None], axis=-1), scaled.shape[-1] - 1).astype(jnp.int32)


def _decode_chunk(graphdef, params, state: SlotState, ints, floats, steps: int, filtered: bool):
    """Decode up to ``steps`` tokens for every active slot.

    ``ints`` int32 [S, 7 + max_stop_ids] and ``floats`` float32 [S, 2] are the per-slot
    controls (column constants above; stop ids padded with -1). Returns the new state and
    ``tokens`` int32, ``logprobs`` float32, ``emitted`` bool, each [S, steps]: ``emitted``
    marks the steps at which the slot was active and produced the token.
    """
    _count_trace("decode_chunk_topk_topp" if filtered else "decode_chunk")
    slots = ints.shape[0]
    rows = jnp.arange(slots)
    greedy = ints[:, _GREEDY].astype(bool)
    top_k, min_new, max_new = ints[:, _TOPK], ints[:, _MINNEW], ints[:, _MAXNEW]
    temp, top_p = floats[:, _TEMP], floats[:, _TOPP]
    vocab = params["embed_tokens"]["embedding"].shape[0]
    stop_vocab = jax.nn.one_hot(ints[:, _STOP0:], vocab, dtype=bool).any(axis=1)  # [S, V]; -1 pads hit nothing

    model = nnx.merge(graphdef, params)

    def body(carry):
        t, (k, v, valid, write_pos), last, n_gen, active, tokens, logprobs, emitted = carry
        logits, k, v, valid, write_pos = _decode_logits(model, last, active, k, v, valid, write_pos)
        masked = jnp.where((n_gen < min_new)[:, None] & stop_vocab, -jnp.inf, logits)
        scaled = masked / temp[:, None]
        if filtered:
            scaled = _top_k_top_p(scaled, top_k, top_p)
        step_keys = jax.vmap(jax.random.fold_in)(state.keys, n_gen)
        drawn = _sample(step_keys, scaled)
        token = jnp.where(greedy, jnp.argmax(masked, axis=-1), drawn).astype(jnp.int32)
        log_p = jax.nn.log_softmax(logits / temp[:, None], axis=-1)[rows, token]
        is_stop = stop_vocab[rows, token] & (n_gen >= min_new)
        n_next = n_gen + active.astype(jnp.int32)
        done = is_stop | (n_next >= max_new)
        tokens = tokens.at[:, t].set(token)
        logprobs = logprobs.at[:, t].set(log_p)
        emitted = emitted.at[:, t].set(active)
        last = jnp.where(active, token, last)
        return t + 1, (k, v, valid, write_pos), last, n_next, active & ~done, tokens, logprobs, emitted

    def cond(carry):
        return (carry[0] < steps) & jnp.any(carry[4])

    init = (
        jnp.int32(0),
        (state.k, state.v, state.valid, state.write_pos),
        ints[:, _LAST],
        ints[:, _NGEN],
        ints[:, _ACTIVE].astype(bool),
        jnp.zeros((slots, steps), jnp.int32),
        jnp.zeros((slots, steps), jnp.float32),
        jnp.zeros((slots, steps), bool),
    )
    _, (k, v, valid, write_pos), _, _, _, tokens, logprobs, emitted = jax.lax.while_loop(cond, body, init)
    return SlotState(k, v, valid, write_pos, state.keys), tokens, logprobs, emitted


prefill_insert_jit = jax.jit(_prefill_insert, static_argnums=0, donate_argnums=2)
decode_chunk_jit = jax.jit(_decode_chunk, static_argnums=(0, 5, 6), donate_argnums=2)


# --------------------------------------------------------------------------- host bookkeeping


class _Sample:
    __slots__ = ("tokens", "logprobs", "versions", "stop_reason", "slot")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.stop_reason: Optional[str] = None
        self.slot: Optional[int] = None


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
            )
            for s in self.samples
        ]


class _Update:
    def __init__(self, params: Any, version: int):
        self.params = params
        self.version = version
        self.requested = time.monotonic()
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


# --------------------------------------------------------------------------- the engine


@register("engine", "jax")
class JaxEngine:
    """The :class:`~asyncrl.engine.protocol.InferenceEngine` on a Flax NNX decoder.

    Args:
        graphdef, params: from :func:`asyncrl.model.split_params` (params: a pure dict of
            arrays or an ``nnx.State``). Params already on devices keep their shardings;
            others go to the first device. Later ``update_weights`` params are put on the
            same shardings.
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
    ):
        self.config = cfg = config or EngineConfig()
        self.graphdef = graphdef
        if hasattr(params, "to_pure_dict"):
            params = params.to_pure_dict()
        leaves = jax.tree.leaves(params)
        if leaves and all(isinstance(x, jax.Array) for x in leaves):
            self._shardings = jax.tree.map(lambda x: x.sharding, params)
        else:
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            self._shardings = jax.tree.map(lambda _: device, params)
        self._params = jax.device_put(params, self._shardings)
        self._treedef = jax.tree.structure(self._params)
        self._avals = [(x.shape, x.dtype) for x in jax.tree.leaves(self._params)]
        embed = self._params["embed_tokens"]["embedding"]
        self.vocab_size = int(embed.shape[0])
        self.model_config = nnx_cfg = _model_config(graphdef, self._params)
        self.default_stop_ids = tuple(int(t) for t in stop_token_ids)
        self.slots = cfg.slots
        self.capacity = cfg.kv_capacity
        self.chunk = cfg.decode_chunk
        self.buckets = tuple(sorted(b for b in set(cfg.prefill_buckets) if b <= cfg.kv_capacity))
        if not self.buckets:
            raise EngineRequestError(f"engine.prefill_buckets {cfg.prefill_buckets}: none fits engine.kv_capacity = {cfg.kv_capacity}")
        self._check_stop_ids(self.default_stop_ids, "stop_token_ids (the model's default)")
        self.seed = seed
        self._root_key = np.asarray(jax.random.PRNGKey(seed))
        self._version = int(version)

        first = jax.tree.leaves(self._shardings)[0]
        # Engine state (KV cache, keys) is replicated over the params' mesh; a NamedSharding
        # of a weight matrix would not fit its lower-rank arrays.
        device = (
            jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
            if isinstance(first, jax.sharding.NamedSharding) else first
        )
        self._state = jax.device_put(init_slot_state(nnx_cfg, self.slots, self.capacity), device)

        # Host copies of the per-slot controls (owned by the scheduler thread).
        self._ints = np.zeros((self.slots, _STOP0 + cfg.max_stop_ids), np.int32)
        self._ints[:, _STOP0:] = -1
        self._floats = np.ones((self.slots, 2), np.float32)
        self._slot_owner: list[Optional[tuple[_Pending, int]]] = [None] * self.slots

        self._cond = threading.Condition()
        self._waiting: collections.deque[_Pending] = collections.deque()
        self._running: set[_Pending] = set()
        self._update: Optional[_Update] = None
        self._aborts: list[threading.Event] = []
        self._closed = False
        self._crash: Optional[str] = None
        self._warned_truncation = False
        self._stats = collections.Counter()
        self._started = time.monotonic()
        if warmup:
            self.warmup()
        self._thread = threading.Thread(target=self._loop, name="asyncrl-jax-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, loaded: Any, cfg: Any = None, *, version: int = 0, **kwargs: Any) -> "JaxEngine":
        """An engine for a :class:`~asyncrl.model.LoadedModel` with a run's :class:`~asyncrl.config.Config`
        (its ``engine`` section and ``run.seed``)."""
        graphdef, params = loaded.split()
        engine_cfg = cfg.engine if cfg is not None else None
        seed = cfg.run.seed if cfg is not None else 0
        return cls(graphdef, params, stop_token_ids=loaded.stop_token_ids, config=engine_cfg, seed=seed, version=version, **kwargs)

    # ------------------------------------------------------------------ protocol

    @property
    def version(self) -> int:
        return self._version

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
        if jax.tree.structure(params) != self._treedef:
            raise ValueError("update_weights: params do not have the structure of the served model's params")
        avals = [(np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(params)]
        if avals != self._avals:
            bad = [i for i, (a, b) in enumerate(zip(avals, self._avals)) if a != b]
            raise ValueError(f"update_weights: {len(bad)} parameter(s) differ in shape or dtype from the served ones (first: leaf {bad[0]}: {avals[bad[0]]} vs {self._avals[bad[0]]})")
        update = _Update(jax.device_put(params, self._shardings), version)
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
    def crashed(self) -> Optional[str]:
        """The scheduler thread's traceback if it died, else None."""
        return self._crash

    def warmup(self) -> int:
        """Compile every program (each prefill bucket, both decode variants); returns the compile count."""
        for bucket in self.buckets:
            ids = np.zeros((1, bucket), np.int32)
            self._state = prefill_insert_jit(
                self.graphdef, self._params, self._state, ids, ids.astype(bool), np.full((self.slots,), self.slots, np.int32),
                self._root_key, np.uint32(0), np.uint32(0), np.zeros((self.slots,), np.uint32),
            )
        idle = self._ints.copy()
        idle[:, _ACTIVE] = 0
        for filtered in (False, True):
            self._state, *_ = decode_chunk_jit(self.graphdef, self._params, self._state, idle, self._floats, self.chunk, filtered)
        jax.block_until_ready(self._state)
        return compile_count()

    def metrics(self) -> dict[str, float]:
        """Cumulative figures since start (``engine/...``)."""
        s = self._stats
        slot_steps = s["decode_steps"] * self.slots
        return {
            "engine/version": float(self._version),
            "engine/compiles": float(compile_count()),
            "engine/requests": float(s["requests"]),
            "engine/samples_aborted": float(s["aborted"]),
            "engine/waiting": float(len(self._waiting)),
            "engine/slot_occupancy": s["decode_tokens"] / slot_steps if slot_steps else 0.0,
            "engine/queue_wait_s": s["queue_wait_s"] / s["admitted"] if s["admitted"] else 0.0,
            "engine/queue_wait_max_s": float(s["queue_wait_max_s"]),
            "engine/prefill_tokens": float(s["prefill_tokens"]),
            "engine/prefill_tokens_per_s": s["prefill_tokens"] / s["prefill_s"] if s["prefill_s"] else 0.0,
            "engine/decode_tokens": float(s["decode_tokens"]),
            "engine/decode_tokens_per_s": s["decode_tokens"] / s["decode_s"] if s["decode_s"] else 0.0,
            "engine/decode_steps": float(s["decode_steps"]),
            "engine/decode_s": float(s["decode_s"]),
            "engine/decode_ms_per_step": 1e3 * s["decode_s"] / s["decode_steps"] if s["decode_steps"] else 0.0,
            "engine/swaps": float(s["swaps"]),
            "engine/swap_latency_s": s["swap_s"] / s["swaps"] if s["swaps"] else 0.0,
            "engine/swap_latency_max_s": float(s["swap_max_s"]),
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
        if (request.top_k > 0 or request.top_p < 1.0) and not request.greedy and not self._warned_truncation:
            self._warned_truncation = True
            logger.warning(
                "a request uses top_k/top_p: its log-probs are of the untruncated distribution (DESIGN), so tokens "
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
        self._params = update.params
        self._version = update.version
        latency = time.monotonic() - update.requested
        self._stats["swaps"] += 1
        self._stats["swap_s"] += latency
        self._stats["swap_max_s"] = max(self._stats["swap_max_s"], latency)
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
        self._stats["requests"] += 1
        pending.future.set_result(pending.response())

    def _end_sample(self, pending: _Pending, j: int, reason: str) -> None:
        sample = pending.samples[j]
        sample.stop_reason = reason
        if reason == "aborted":
            self._stats["aborted"] += 1
        if sample.slot is not None:
            self._slot_owner[sample.slot] = None
            self._ints[sample.slot, _ACTIVE] = 0
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
        while True:
            free = self._free_slots()
            with self._cond:
                if not self._waiting or self._waiting[0].request.n > len(free):
                    return
                pending = self._waiting.popleft()
                self._running.add(pending)
            self._prefill(pending, free[: pending.request.n])

    def _prefill(self, pending: _Pending, rows: list[int]) -> None:
        request = pending.request
        started = time.monotonic()
        wait = started - pending.submitted
        self._stats["admitted"] += 1
        self._stats["queue_wait_s"] += wait
        self._stats["queue_wait_max_s"] = max(self._stats["queue_wait_max_s"], wait)
        prompt = np.asarray(request.prompt_ids, np.int32)
        context = len(prompt) - 1  # the last prompt token is fed by the first decode step
        bucket = next(b for b in self.buckets if b >= max(context, 1))
        ids = np.zeros((1, bucket), np.int32)
        ids[0, :context] = prompt[:context]
        mask = np.zeros((1, bucket), bool)
        mask[0, :context] = True
        dst = np.full((self.slots,), self.slots, np.int32)
        dst[: len(rows)] = rows
        key_index = np.zeros((self.slots,), np.uint32)
        key_index[: len(rows)] = [(request.index_in_group + j) % 2**32 for j in range(len(rows))]
        self._state = prefill_insert_jit(
            self.graphdef, self._params, self._state, ids, mask, dst, self._root_key,
            np.uint32(request.sample_id % 2**32), np.uint32(request.turn % 2**32), key_index,
        )
        for j, slot in enumerate(rows):
            self._slot_owner[slot] = (pending, j)
            pending.samples[j].slot = slot
            c = self._ints[slot]
            c[_LAST], c[_NGEN], c[_ACTIVE] = prompt[-1], 0, 1
            c[_GREEDY] = int(request.greedy)
            c[_TOPK] = 0 if request.greedy else request.top_k
            c[_MINNEW], c[_MAXNEW] = request.min_new_tokens, request.max_new_tokens
            c[_STOP0:] = -1
            c[_STOP0 : _STOP0 + len(pending.stop_ids)] = pending.stop_ids
            self._floats[slot, _TEMP] = 1.0 if request.greedy else request.temperature
            self._floats[slot, _TOPP] = 1.0 if request.greedy else request.top_p
        self._stats["prefill_tokens"] += context
        self._stats["prefill_s"] += time.monotonic() - started

    def _decode(self) -> None:
        started = time.monotonic()
        active = self._ints[:, _ACTIVE].astype(bool)
        filtered = bool(np.any(active & ((self._ints[:, _TOPK] > 0) | (self._floats[:, _TOPP] < 1.0))))
        version = self._version
        self._state, tokens, logprobs, emitted = decode_chunk_jit(
            self.graphdef, self._params, self._state, self._ints.copy(), self._floats.copy(), self.chunk, filtered
        )
        tokens, logprobs, emitted = np.asarray(tokens), np.asarray(logprobs), np.asarray(emitted)
        steps = int(emitted.any(axis=0).sum())
        self._stats["decode_steps"] += steps
        self._stats["decode_tokens"] += int(emitted.sum())
        for slot in np.flatnonzero(active):
            pending, j = self._slot_owner[slot]
            self._consume(pending, j, slot, tokens[slot], logprobs[slot], emitted[slot], version)
        self._stats["decode_s"] += time.monotonic() - started

    def _consume(self, pending: _Pending, j: int, slot: int, tokens, logprobs, emitted, version: int) -> None:
        """Append one slot's chunk output to its sample and end the sample when it stopped."""
        request = pending.request
        sample = pending.samples[j]
        for t in np.flatnonzero(emitted):
            token = int(tokens[t])
            sample.tokens.append(token)
            sample.logprobs.append(float(logprobs[t]))
            sample.versions.append(version)
            index = len(sample.tokens) - 1
            if index >= request.min_new_tokens:
                if token in pending.stop_set:
                    return self._end_sample(pending, j, "eos")
                for seq in pending.stop_sequences:
                    if sample.tokens[-len(seq):] == seq:
                        return self._end_sample(pending, j, "stop")
            if len(sample.tokens) >= request.max_new_tokens:
                return self._end_sample(pending, j, "length")
        c = self._ints[slot]
        c[_LAST], c[_NGEN] = sample.tokens[-1], len(sample.tokens)


def _model_config(graphdef: Any, params: Any) -> Any:
    """The :class:`~asyncrl.model.DecoderConfig` the graphdef was built with."""
    from flax import nnx

    cfg = getattr(nnx.merge(graphdef, params), "cfg", None)
    if cfg is None:
        raise EngineRequestError("JaxEngine: the graphdef is not an asyncrl Decoder (no .cfg)")
    return cfg
