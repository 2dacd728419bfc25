"""The engine over its paged KV cache: prompts longer than the largest prefill bucket (chunked
prefill), preemption when the pool runs out (the same tokens as without it), the TPU's page layout
through the same programs on the CPU, and an agent's history kept while another episode runs.

References are independent of the paged decode: ``per_token_logprobs`` on the full sequences, and
engines that never preempt (a pool of every slot's longest context) or never reuse.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.config import EngineConfig
from asyncrl.engine.jax_engine import JaxEngine
from asyncrl.engine.protocol import GenerationRequest
from asyncrl.model import per_token_logprobs_jit

pytestmark = pytest.mark.timeout(180)

REF_LEN = 96


def prompt_of(i: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(2000 + i).integers(6, 28, size=length)]


def reference_logprobs(graphdef, params, prompt, response, temperature: float) -> np.ndarray:
    seq = np.concatenate([prompt, response.output_ids]).astype(np.int32)
    ids, mask = np.zeros((1, REF_LEN), np.int32), np.zeros((1, REF_LEN), bool)
    ids[0, : len(seq)], mask[0, : len(seq)] = seq, True
    ref = np.asarray(per_token_logprobs_jit(graphdef, params, ids, mask, jnp.float32(temperature))[0])[0]
    return ref[len(prompt) : len(seq)]


def engine(tiny_split, **config) -> JaxEngine:
    lm, graphdef, params = tiny_split
    cfg = EngineConfig.model_validate({"slots": 4, "kv_capacity": 96, "decode_chunk": 4, "prefill_buckets": [8, 32],
                                       **config})
    return JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=cfg, seed=3)


def test_a_prompt_longer_than_every_bucket_is_prefilled_in_chunks(tiny_split):
    """An 81-token prompt over buckets of at most 32 tokens (three chunks, the later two attending
    over the pages the earlier wrote): log-probs of per_token_logprobs on the whole sequence; a turn
    that extends it (89 tokens) is served too, reusing its pages."""
    _, graphdef, params = tiny_split
    prompt = prompt_of(0, 81)
    with engine(tiny_split) as eng:
        (sampled,) = eng.generate(GenerationRequest(prompt_ids=prompt, temperature=0.8, max_new_tokens=6, stop_token_ids=[],
                                                    sample_id=1))
        np.testing.assert_allclose(sampled.logprobs, reference_logprobs(graphdef, params, prompt, sampled, 0.8), atol=1e-5)
        assert sampled.usage.prefill_tokens == 80
        turn = prompt + sampled.output_ids.tolist() + [7, 8]
        (again,) = eng.generate(GenerationRequest(prompt_ids=turn, greedy=True, max_new_tokens=5, stop_token_ids=[]))
        np.testing.assert_allclose(again.logprobs, reference_logprobs(graphdef, params, turn, again, 1.0), atol=1e-5)
        assert again.usage.prefix_hit_tokens == 80 + 6 and again.usage.prefill_tokens == 2  # its 86 kept positions reused


def test_a_prompt_at_the_longest_context_is_prefilled_in_chunks_without_reuse(tiny_split):
    """``kv_capacity - 1`` prompt tokens (95 of 96) with prefix reuse off: every chunk after the
    first attends over the pages the earlier ones wrote, and the one new token's log-prob is the
    whole sequence's."""
    _, graphdef, params = tiny_split
    prompt = prompt_of(1, 95)
    with engine(tiny_split, prefix_cache={"enabled": False}) as eng:
        (sampled,) = eng.generate(GenerationRequest(prompt_ids=prompt, temperature=0.8, max_new_tokens=1, stop_token_ids=[],
                                                    sample_id=2))
        np.testing.assert_allclose(sampled.logprobs, reference_logprobs(graphdef, params, prompt, sampled, 0.8), atol=1e-5)
        assert len(sampled.output_ids) == 1 and sampled.usage.prefill_tokens == 94 and sampled.usage.prefix_hit_tokens == 0


def workload() -> list[GenerationRequest]:
    """Four sequences that reach 5 of the 6 pages of a 96-token context, sampled and greedy."""
    return [GenerationRequest(prompt_ids=prompt_of(10 + i, 18 + 3 * i), greedy=i % 2 == 1, temperature=0.9,
                              max_new_tokens=58, stop_token_ids=[], sample_id=40 + i) for i in range(4)]


def run_together(eng: JaxEngine) -> list:
    with ThreadPoolExecutor(4) as pool:
        return [r for rs in pool.map(eng.generate, workload()) for r in rs]


@pytest.fixture(scope="module")
def without_preemption(tiny_split) -> list:
    with engine(tiny_split, prefix_cache={"enabled": False}) as eng:  # 24 pages: every slot's longest context
        out = run_together(eng)
        assert eng.metrics()["engine/preemptions"] == 0
    return out


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no_reuse"])
def test_preempted_sequences_resume_with_the_same_tokens(tiny_split, without_preemption, reuse):
    """A pool of 8 pages (one longest context and a bit) for four sequences that need 20: the
    latest admitted are preempted and resumed (their pages kept in the tree and found again, or
    their contexts prefilled again), and every sample gets the tokens it gets without preemption,
    greedy and sampled, with log-probs within 1e-5; the pool is never over-committed."""
    _, graphdef, params = tiny_split
    with engine(tiny_split, kv_pages=8, prefix_cache={"enabled": reuse}) as eng:
        got = run_together(eng)
        metrics = eng.metrics()
        assert metrics["engine/preemptions"] >= 2 and metrics["engine/kv_pages_used"] == 0
    for request, a, b in zip(workload(), without_preemption, got):
        assert a.output_ids.tolist() == b.output_ids.tolist() and b.stop_reason == "length"
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(b.logprobs, reference_logprobs(graphdef, params, request.prompt_ids, b,
                                                                  1.0 if request.greedy else 0.9), atol=1e-5)


def test_the_tpu_page_layout_decodes_the_same_on_the_cpu(tiny_split, without_preemption, monkeypatch):
    """The TPU's pool layout (``ps2kd``: a page's positions, each head's key and value side by side)
    through the same engine on the CPU: the default layout's tokens, log-probs within 1e-6."""
    from asyncrl.engine import model_runner

    monkeypatch.setattr(model_runner, "kv_page_layout", lambda platform: "ps2kd")
    with engine(tiny_split, prefix_cache={"enabled": False}) as eng:
        assert eng.runner.pool[0].layout == "ps2kd" and eng.runner.pool[0].kv.shape[-2] == 2 * eng.model_config.num_kv_heads
        got = run_together(eng)
    for a, b in zip(without_preemption, got):
        assert a.output_ids.tolist() == b.output_ids.tolist()
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-6, rtol=0)


def test_an_agent_history_survives_another_episode(tiny_split):
    """A/B/A on 8 slots: A (a 96-token system prompt + 10), B (the same system prompt, other 10),
    then A's next turn (A + its answer + 10): A's next turn reuses A's whole history (the KV of
    every position but its answer's last token), and B reused the system prompt's whole pages."""
    system = prompt_of(20, 96)
    a_prompt, b_prompt = system + prompt_of(21, 10), system + prompt_of(22, 10)
    with engine(tiny_split, slots=8, kv_capacity=160, prefill_buckets=[32, 128]) as eng:
        (a,) = eng.generate(GenerationRequest(prompt_ids=a_prompt, greedy=True, max_new_tokens=16, stop_token_ids=[]))
        (b,) = eng.generate(GenerationRequest(prompt_ids=b_prompt, greedy=True, max_new_tokens=16, stop_token_ids=[]))
        shared = next(i for i, (x, y) in enumerate(zip(a_prompt, b_prompt)) if x != y)
        assert shared >= 96 and b.usage.prefix_hit_tokens == shared
        next_turn = a_prompt + a.output_ids.tolist() + prompt_of(23, 10)
        (again,) = eng.generate(GenerationRequest(prompt_ids=next_turn, greedy=True, max_new_tokens=4, stop_token_ids=[]))
        assert again.usage.prefix_hit_tokens == len(a_prompt) - 1 + len(a.output_ids)
        assert again.usage.prefill_tokens == len(next_turn) - 1 - again.usage.prefix_hit_tokens


def test_each_sample_reports_the_prompt_tokens_it_did_not_compute(tiny_split):
    """``GenerationResponse.cached_tokens``: a request's first sample computes its prompt (less a kept
    prefix), its other samples share those pages; a later request on the same prompt reuses it all."""
    prompt = prompt_of(2, 40)
    with engine(tiny_split) as eng:
        first = eng.generate(GenerationRequest(prompt_ids=prompt, n=3, max_new_tokens=2, stop_token_ids=[], sample_id=5))
        again = eng.generate(GenerationRequest(prompt_ids=prompt, n=2, max_new_tokens=2, stop_token_ids=[], sample_id=6))
    assert [r.cached_tokens for r in first] == [0, 39, 39] and first[0].usage.prefill_tokens == 39
    assert [r.cached_tokens for r in again] == [39, 39] and again[0].usage.prefix_hit_tokens == 39
