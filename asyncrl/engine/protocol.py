"""The inference-engine contract: what workflows call and what the trainer publishes to.

This module imports no jax: workflows, the executor and :class:`~asyncrl.engine.fake.FakeEngine`
depend on it alone. The real engine (``asyncrl.engine.jax_engine.JaxEngine``) implements it.

An engine serves one set of weights at a time, tagged with a version ``v`` (the number of
completed trainer steps; see docs/design.md "Versions and the publish order"). Every generated token records the version
that produced it. Requests are independent: a request's tokens and log-probs depend only on
the weights and on its own random key, never on what else is batched with it.

Random key of one sample (docs/design.md "Randomness")::

    key = fold_in(fold_in(fold_in(PRNGKey(run.seed), sample_id), index_in_group + i), turn)

for sample ``i`` of a request with ``n`` samples, then folded with the token position. So
re-issuing an episode after a resume (same ``sample_id``, same ``turn``) draws the same tokens.

Log-probs are ``log_softmax(logits / temperature)`` of the chosen token, taken before any
top-k/top-p truncation, in float32 (docs/design.md "Log-probabilities"). A greedy request reports
log-probs at temperature 1 and is not trainable. Under a constraint (a trie, docs/decoding.md)
they are those of the masked distribution the token was drawn from.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any, Literal, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

StopReason = Literal["eos", "stop", "length", "aborted"]
"""Why a sample ended: an EOS/stop token id (``eos``), a stop sequence (``stop``),
``max_new_tokens`` (``length``), or the engine gave up on it (``aborted``: timeout, shutdown)."""

STOP_REASONS: tuple[str, ...] = ("eos", "stop", "length", "aborted")


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete ``n`` times (the ``n`` samples share one prefill).

    Only ``prompt_ids`` is required; the defaults sample at temperature 1 with the
    model's own stop tokens.
    """

    prompt_ids: Sequence[int]
    """Token ids of the prompt (chat template already applied), ``[P]``."""
    n: int = 1
    """Samples drawn from this prompt; sample ``i`` uses key index ``index_in_group + i``."""
    temperature: float = 1.0
    """Sampling temperature (> 0); log-probs are taken at this temperature."""
    top_k: int = 0
    """Keep only the ``top_k`` most likely tokens when sampling; 0 is off (training default)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 is off (training default)."""
    greedy: bool = False
    """Take the argmax; log-probs are then reported at temperature 1 (not trainable)."""
    max_new_tokens: int = 32
    """Most tokens generated per sample (the final EOS included)."""
    min_new_tokens: int = 0
    """Stop tokens are not sampled before this many tokens were generated."""
    stop_token_ids: Optional[Sequence[int]] = None
    """Token ids that end a sample (kept in the output, ``stop_reason == "eos"``);
    ``None``: the model's ``generation_config`` EOS ids."""
    stop_sequences: Sequence[Sequence[int]] = ()
    """Token-id sequences that end a sample once generated (kept in the output, ``stop_reason == "stop"``)."""
    sample_id: int = 0
    """The dataset draw this request belongs to (first fold of the random key)."""
    index_in_group: int = 0
    """Index of this request's first sample within its group (second fold of the key)."""
    turn: int = 0
    """Engine call number within the episode (third fold of the key): turn 1 of a multi-turn
    episode must not repeat turn 0's randomness."""
    timeout_s: Optional[float] = None
    """Give up after this long: the unfinished samples come back with ``stop_reason == "aborted"``."""
    constraint: Optional[Any] = None
    """A :class:`~asyncrl.engine.constraints.TokenTrie`: every sample is one of its sequences
    (tokens outside the trie are masked at every step, the log-probs are those of the masked
    distribution, stop ids and stop sequences are ignored, and a sample ends at a trie leaf,
    ``stop_reason == "stop"``, or at ``max_new_tokens``). In-process engine only
    (docs/decoding.md)."""
    beam: bool = False
    """Beam search of width ``n`` instead of sampling: the ``n`` best completions by
    ``sum of log-probs / length ** length_penalty`` (log-probs at temperature 1 of the masked
    distribution under a constraint), best first, each with its ``sequence_logprob``. Deterministic
    (no key); not trainable (the completions are not samples of the policy). In-process engine only."""
    length_penalty: float = 1.0
    """Beam search: a finished beam's score is its summed log-prob divided by ``length ** length_penalty``."""

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError("GenerationRequest.prompt_ids is empty: a prompt needs at least one token")
        if self.n < 1:
            raise ValueError(f"GenerationRequest.n must be >= 1 (given {self.n})")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"GenerationRequest.temperature must be > 0 (given {self.temperature}); use greedy=True")
        if self.beam and (self.top_k or self.top_p < 1.0 or self.min_new_tokens):
            raise ValueError("GenerationRequest: beam search takes no top_k, top_p or min_new_tokens")
        if self.constraint is not None and self.min_new_tokens > 0:
            raise ValueError("GenerationRequest: min_new_tokens must be 0 with a constraint (its trie decides where a sample ends)")
        if self.max_new_tokens < 1 or self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                "GenerationRequest: need 0 <= min_new_tokens <= max_new_tokens and max_new_tokens >= 1 "
                f"(given min {self.min_new_tokens}, max {self.max_new_tokens})"
            )


@dataclasses.dataclass
class RequestUsage:
    """What one request cost the engine, in the units of its cumulative counters
    (``engine/requests``, ``engine/samples_aborted``, ``engine/prefill_tokens``,
    ``engine/prefix_hit_tokens``, ``engine/decode_tokens``): the request's own share of them, so that a caller can account for
    its requests apart from others that ran beside them (eval's, which a resumed run does not redo,
    asyncrl/run/run_state.py). Filled in as the engine works; final once the request is done."""

    requests: int = 0
    samples_aborted: int = 0
    prefill_tokens: int = 0
    prefix_hit_tokens: int = 0
    decode_tokens: int = 0

    def counters(self) -> dict[str, float]:
        """This usage under the engine's counter names."""
        return {"engine/requests": float(self.requests), "engine/samples_aborted": float(self.samples_aborted),
                "engine/prefill_tokens": float(self.prefill_tokens), "engine/prefix_hit_tokens": float(self.prefix_hit_tokens),
                "engine/decode_tokens": float(self.decode_tokens)}


@dataclasses.dataclass(frozen=True)
class GenerationResponse:
    """One generated sample. ``generate`` returns ``request.n`` of these, in sample order.

    All arrays are ``[N]`` for the ``N`` generated tokens (the ending EOS or stop token included).
    """

    output_ids: np.ndarray
    """int32 ``[N]``: the generated token ids, EOS included."""
    logprobs: np.ndarray
    """float32 ``[N]``: log-prob of each generated token under the serving policy at the
    request temperature (docs/design.md "Log-probabilities")."""
    versions: np.ndarray
    """int32 ``[N]``: the weights version that generated each token (changes mid-sample when
    weights are published during generation)."""
    stop_reason: StopReason
    """Why the sample ended: ``eos``, ``stop``, ``length`` or ``aborted``."""
    score: Optional[float] = None
    """Beam search only: the beam's ranking score, ``sum(logprobs) / len ** length_penalty``."""
    usage: Optional[RequestUsage] = None
    """The whole request's cost to the engine (one object shared by its ``n`` samples); None where
    the engine does not count it (the fake)."""
    cached_tokens: Optional[int] = None
    """This sample's prompt tokens whose KV the engine did not compute for it (a kept prefix it
    reused, or the pages it shares with its request's first sample), of ``len(prompt_ids) - 1``
    (the last is fed by the first decode step); None where the engine does not count it per sample
    (the fake, remote servers, beam search)."""


@runtime_checkable
class InferenceEngine(Protocol):
    """What workflows and the trainer need from an inference engine.

    Thread-safety: ``generate``/``submit`` are called concurrently from many rollout
    threads; ``update_weights`` from the trainer's thread.

    Failure: when the engine's own thread dies, every pending and later call raises
    :class:`asyncrl.errors.EngineCrashed` carrying that thread's traceback; the executor
    then stops training at once.
    """

    @property
    def version(self) -> int:
        """Version of the weights now being served (tokens generated from now on carry it)."""
        ...

    def generate(self, request: GenerationRequest) -> list[GenerationResponse]:
        """Complete ``request``; blocks until all ``request.n`` samples are done."""
        ...

    def submit(self, request: GenerationRequest) -> "Future[list[GenerationResponse]]":
        """Like ``generate`` but returns at once with a future of the same result."""
        ...

    def update_weights(self, params: Any, version: int) -> None:
        """Serve ``params`` (an immutable pytree of ``jax.Array``) as ``version``.

        Requires ``version == self.version + 1`` (``ValueError`` otherwise). Returns once
        installed (at the next chunk boundary, or at once when idle): every token generated
        after it returns carries ``version``. In-flight requests continue with the new weights.
        """
        ...
