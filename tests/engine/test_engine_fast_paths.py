"""The engine's per-platform fast paths, checked on the CPU: the XLA flags a GPU
would get (and that the CPU does not), the Gumbel-max sampler (same distribution as
``softmax(logits / T)`` by a chi-square test over 10^5 draws, exact log-probs, deterministic per
key), and decode attending over a prefix of the KV cache (attention buckets) giving the same
tokens and log-probs as attention over the whole capacity."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from asyncrl.config import EngineConfig
from asyncrl.engine.attention_buckets import attention_buckets, chunk_bucket
from asyncrl.engine.jax_engine import JaxEngine
from asyncrl.engine.platform import (
    apply_platform_xla_flags,
    expected_platform,
    merge_xla_flags,
    resolve_inner_steps,
    resolve_sampler,
    xla_flags_for,
)
from asyncrl.engine.protocol import GenerationRequest
from tests.engine.test_engine import check_logprobs, prompt_of

pytestmark = pytest.mark.timeout(300)

# --------------------------------------------------------------------------- platform flags


def test_command_buffer_flags_only_on_gpus():
    (flag,) = xla_flags_for("gpu")
    name, types = flag.split("=")
    assert name == "--xla_gpu_enable_command_buffer"
    assert {"WHILE", "CONDITIONAL", "FUSION"} <= set(types.split(","))
    assert xla_flags_for("cpu") == [] and xla_flags_for("tpu") == []


def test_platform_flags_applied_by_expected_platform_and_user_flags_win():
    env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert apply_platform_xla_flags(env) == xla_flags_for("gpu")
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", *xla_flags_for("gpu")]
    assert apply_platform_xla_flags(env) == []  # already there: nothing added twice

    cpu = {"JAX_PLATFORMS": "cpu"}
    assert expected_platform(cpu) == "cpu" and apply_platform_xla_flags(cpu) == [] and "XLA_FLAGS" not in cpu
    off = {"JAX_PLATFORMS": "cuda", "ASYNCRL_XLA_PLATFORM_FLAGS": "0"}
    assert apply_platform_xla_flags(off) == [] and "XLA_FLAGS" not in off

    mine = "--xla_gpu_enable_command_buffer=FUSION"
    assert merge_xla_flags(mine, xla_flags_for("gpu")) == mine  # the user's own setting is kept
    # This machine has no CUDA plugin: without JAX_PLATFORMS the guess is the CPU.
    assert expected_platform({}) == jax.default_backend() == "cpu"


def test_sampler_resolved_by_platform():
    assert resolve_sampler("auto", "cpu") == "inverse_cdf"
    assert resolve_sampler("auto", "gpu") == resolve_sampler("auto", "tpu") == "gumbel"
    assert resolve_sampler("gumbel", "cpu") == "gumbel"
    with pytest.raises(ValueError, match="engine.sampler"):
        resolve_sampler("sorted", "cpu")


def test_inner_steps_resolved_by_platform():
    assert resolve_inner_steps("auto", "gpu") == 8 and resolve_inner_steps("auto", "cpu") == resolve_inner_steps("auto", "tpu") == 1
    assert resolve_inner_steps(3, "cpu") == 3
    with pytest.raises(ValueError, match="engine.decode_inner_steps"):
        resolve_inner_steps(0, "gpu")


# --------------------------------------------------------------------------- samplers


def draws_of(sampler: str, logits: jax.Array, count: int, seed: int = 0) -> np.ndarray:
    from asyncrl.engine.jax_programs import draw_tokens

    keys = jax.random.split(jax.random.PRNGKey(seed), count)
    rows = jnp.broadcast_to(logits[None], (count, logits.shape[0]))
    return np.asarray(jax.jit(draw_tokens, static_argnums=0)(sampler, keys, rows))


@pytest.mark.parametrize("sampler", ["gumbel", "inverse_cdf"])
def test_sampler_draws_from_softmax_chi_square(sampler):
    """10^5 draws at T = 0.7 from 40 tokens (two masked) against softmax(logits / T)."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=40).astype(np.float32) * 2
    scaled = logits / 0.7
    scaled[[4, 17]] = -np.inf
    probs = np.exp(scaled - scaled[np.isfinite(scaled)].max())
    probs /= probs.sum()
    draws = draws_of(sampler, jnp.asarray(scaled), 100_000)
    counts = np.bincount(draws, minlength=40)
    assert counts[4] == counts[17] == 0, "a masked token was drawn"
    live = probs > 0
    _, p_value = stats.chisquare(counts[live], probs[live] * counts.sum())
    assert p_value > 1e-3, f"{sampler}: draws do not follow softmax(logits / T) (p = {p_value:.2e})"


def test_max_and_argmax_in_one_reduction_equals_jnp():
    """The Gumbel path's one reduction (the log-prob's maximum and the token's argmax) against
    jnp.max and jnp.argmax: ties to the first index, rows all -inf, NaN, across 300 columns."""
    from asyncrl.engine.jax_programs import _max_and_argmax

    rng = np.random.default_rng(4)
    values = rng.normal(size=(6, 300)).astype(np.float32)
    choose = np.round(rng.normal(size=(6, 300)), 1).astype(np.float32)  # rounded: many ties
    choose[1] = -np.inf
    choose[2, [7, 250]] = 9.0  # a tie at the maximum: the first wins
    choose[3, 41] = np.nan
    values[4, 100] = np.nan
    values[5] = -np.inf
    top, arg = jax.jit(_max_and_argmax)(values, choose)
    np.testing.assert_array_equal(np.asarray(top), np.asarray(jnp.max(values, axis=-1)))
    np.testing.assert_array_equal(np.asarray(arg), np.asarray(jnp.argmax(choose, axis=-1)))
    assert arg[2] == 7 and arg[3] == 41 and np.isnan(top[4])


def test_gumbel_sampler_deterministic_per_key():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=64).astype(np.float32))
    np.testing.assert_array_equal(draws_of("gumbel", logits, 500, seed=5), draws_of("gumbel", logits, 500, seed=5))
    assert not np.array_equal(draws_of("gumbel", logits, 500, seed=5), draws_of("gumbel", logits, 500, seed=6))


def test_gumbel_engine_logprobs_exact_and_seeded(tiny_split):
    """The engine with ``sampler: gumbel``: log-probs equal per_token_logprobs (1e-5), a seeded
    request repeats its tokens, and greedy tokens equal the default sampler's."""
    lm, graphdef, params = tiny_split
    cfg = EngineConfig(slots=4, kv_capacity=64, decode_chunk=4, prefill_buckets=[16])
    prompt = prompt_of(0, 11)
    sampled = GenerationRequest(prompt_ids=prompt, n=4, temperature=0.8, max_new_tokens=24, sample_id=9)
    greedy = GenerationRequest(prompt_ids=prompt, greedy=True, max_new_tokens=24, stop_token_ids=[])
    with JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=cfg.model_copy(update={"sampler": "gumbel"}),
                   seed=2) as gumbel:
        assert gumbel.sampler == "gumbel"
        first, again, gumbel_greedy = gumbel.generate(sampled), gumbel.generate(sampled), gumbel.generate(greedy)
    check_logprobs(graphdef, params, prompt, first, 0.8, tol=1e-5)
    assert [r.output_ids.tolist() for r in first] == [r.output_ids.tolist() for r in again]
    with JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=cfg, seed=2) as default:
        assert default.sampler == "inverse_cdf"  # auto on the CPU
        default_greedy = default.generate(greedy)
    assert gumbel_greedy[0].output_ids.tolist() == default_greedy[0].output_ids.tolist()
    np.testing.assert_array_equal(gumbel_greedy[0].logprobs, default_greedy[0].logprobs)


# --------------------------------------------------------------------------- attention buckets


def test_attention_bucket_sizes():
    assert attention_buckets(512, 1) == (512,)
    assert attention_buckets(512, 4) == (64, 128, 256, 512)
    assert attention_buckets(100, 3) == (32, 64, 100)  # 25 and 50 pages rounded up to multiples of 16
    assert attention_buckets(20, 4) == (16, 20)  # merged duplicates, never above the pool
    with pytest.raises(ValueError, match="engine.attention_buckets"):
        attention_buckets(64, 0)
    buckets = (64, 128, 256, 512)
    assert chunk_bucket(buckets, 64) == 64  # pages the busiest replica's sequences reach
    assert chunk_bucket(buckets, 65) == 128
    assert chunk_bucket(buckets, 0) == 64
    assert chunk_bucket(buckets, 600) == 512


def test_bucketed_attention_equals_full_attention(tiny_split):
    """Requests whose pages cross several size classes of the CPU's flat attention as they run and
    end (prompts of 5 to 60 tokens, up to 64 new tokens, 10 pages per row), on 9 of 32 rows: sampled
    and greedy tokens and log-probs equal those of attention over a list of every row's pages on 6
    rows, and the smaller classes were used (their programs were compiled; the chunks ran 16 of the
    32 rows, the busy ones and idle ones)."""
    from asyncrl.engine import jax_programs

    lm, graphdef, params = tiny_split
    cfg = EngineConfig(slots=6, kv_capacity=160, decode_chunk=4, prefill_buckets=[16, 64])
    requests = [GenerationRequest(prompt_ids=prompt_of(i, length), n=2, temperature=1.0, max_new_tokens=new,
                                  stop_token_ids=[], sample_id=i)
                for i, (length, new) in enumerate([(5, 40), (30, 60), (60, 30), (12, 64)])]
    requests.append(GenerationRequest(prompt_ids=prompt_of(9, 20), greedy=True, max_new_tokens=50, stop_token_ids=[]))

    def run(buckets: int, slots: int) -> tuple[list, set]:
        config = cfg.model_copy(update={"attention_buckets": buckets, "slots": slots})
        with JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=config, seed=4) as engine:
            rows: set[int] = set()
            decode = engine.runner.decode

            def counted(controls, *args):
                rows.add(len(controls.active))
                return decode(controls, *args)

            engine.runner.decode = counted  # type: ignore[method-assign]
            return [f.result() for f in [engine.submit(r) for r in requests]], rows  # together: 45 pages at first

    full, full_rows = run(1, 6)
    bucketed, bucketed_rows = run(5, 32)
    traced = {name for name in jax_programs._compiles if isinstance(name, str)}
    assert {"decode_chunk_flat32", "decode_chunk_flat48"} <= traced  # 320 / 16 and 320 / 8, rounded up to 16
    assert full_rows == {6} and bucketed_rows == {16}  # 32 rows, 16 and 32 the row classes
    for request, want, got in zip(requests, full, bucketed):
        for a, b in zip(want, got):
            assert a.output_ids.tolist() == b.output_ids.tolist()
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-6, rtol=0)
        check_logprobs(graphdef, params, request.prompt_ids, got, 1.0, tol=1e-5)


# --------------------------------------------------------------------------- steps per loop iteration


@pytest.mark.parametrize("variants", [pytest.param(False, marks=pytest.mark.slow), pytest.param(True, marks=pytest.mark.slow)])  # GPUs' default
def test_inner_steps_decode_the_same_tokens_stops_and_versions(tiny_split, variants):
    """Three decode steps per loop iteration (not dividing the 4-step chunk: the last two steps of
    an iteration run idle) against one: the same tokens, log-probs, stop reasons and versions for
    sampled (stop ids after ``min_new_tokens``) and greedy (a stop sequence) requests in one batch,
    with a publish in between; with ``variants`` (slow) also top-k/top-p and trie-constrained
    requests under attention buckets."""
    from asyncrl.engine.constraints import TokenTrie

    lm, graphdef, params = tiny_split
    cfg = EngineConfig(slots=6, kv_capacity=96, decode_chunk=4, prefill_buckets=[32], attention_buckets=2 if variants else 1)
    requests = [
        GenerationRequest(prompt_ids=prompt_of(30, 9), n=3, temperature=0.9, max_new_tokens=30, sample_id=30,
                          min_new_tokens=3),
        GenerationRequest(prompt_ids=prompt_of(31, 20), greedy=True, max_new_tokens=21, stop_token_ids=[],
                          stop_sequences=[prompt_of(31, 20)[-2:]]),
    ]
    if variants:
        rng = np.random.default_rng(11)
        trie = TokenTrie({tuple(int(t) for t in rng.integers(6, 28, size=12)) for _ in range(8)}, name="inner-test")
        requests += [
            GenerationRequest(prompt_ids=prompt_of(32, 14), temperature=1.0, top_k=6, top_p=0.9, max_new_tokens=17,
                              stop_token_ids=[], sample_id=32),
            GenerationRequest(prompt_ids=prompt_of(33, 6), temperature=1.0, max_new_tokens=12, stop_token_ids=[],
                              sample_id=33, constraint=trie),
        ]

    def run(inner: int) -> list:
        config = cfg.model_copy(update={"decode_inner_steps": inner})
        with JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=config, seed=6) as engine:
            assert engine.inner_steps == inner
            first = [f.result() for f in [engine.submit(r) for r in requests]]
            engine.update_weights(params, 1)
            return first + [engine.generate(requests[0])]

    one, three = run(1), run(3)
    for want, got in zip(one, three):
        for a, b in zip(want, got):
            assert a.output_ids.tolist() == b.output_ids.tolist() and a.stop_reason == b.stop_reason
            assert a.versions.tolist() == b.versions.tolist()
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-6, rtol=0)
    assert {r.stop_reason for rs in three for r in rs} >= ({"length", "eos", "stop"} if variants else {"length", "eos"})
    assert three[-1][0].versions.tolist() == [1] * len(three[-1][0].output_ids)


# --------------------------------------------------------------------------- serving copy


@pytest.fixture(scope="module")
def bf16_compute_tiny():
    """tiny's shape with float32 weights and bfloat16 compute (the GSM8K recipes' dtypes)."""
    import dataclasses

    from asyncrl.model import init_decoder, split_params
    from asyncrl.model.tiny import parse_tiny_spec, tiny_decoder_config

    cfg = dataclasses.replace(tiny_decoder_config(parse_tiny_spec("tiny")), param_dtype="float32", compute_dtype="bfloat16")
    return split_params(init_decoder(cfg, seed=3))


def test_serving_copy_casts_matrices_only_and_decodes_bitwise_alike(bf16_compute_tiny):
    from asyncrl.engine.jax_programs import decode_chunk_jit, graphdef_config, idle_controls, init_pool
    from asyncrl.model.compute_copy import compute_copy

    graphdef, params = bf16_compute_tiny
    serving = compute_copy(params, "bfloat16")
    for (path, original), copy in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(serving)):
        want = jnp.bfloat16 if original.ndim >= 2 else jnp.float32
        assert copy.dtype == want, jax.tree_util.keystr(path)
    assert compute_copy(serving, "bfloat16") is serving  # nothing left to cast: no copy
    assert compute_copy(params, "float32") is params

    controls = idle_controls(3, 8, pages_per_seq=2, pool_pages=6)
    controls.active[:] = True
    controls.max_new_tokens[:] = 12
    controls.last_token[:] = [7, 9, 11]
    controls.greedy[:] = [True, False, False]
    controls.page_table[:] = [[0, 1], [2, 3], [4, 5]]
    outs = []
    for weights in (params, serving):  # the per-call cast, then the copy
        pool = init_pool(graphdef_config(graphdef, params), 6, 16)
        outs.append([np.asarray(x) for x in decode_chunk_jit(graphdef, weights, pool, controls, None, np.zeros(2, np.uint32),
                                                             12, False, None)[1:]])
    for per_call, copied in zip(*outs):
        np.testing.assert_array_equal(copied, per_call)


@pytest.mark.slow  # the copy's cast and bitwise decode stay in the default selection
def test_engine_serves_the_copy_and_refreshes_it_at_each_publish(bf16_compute_tiny):
    graphdef, params = bf16_compute_tiny
    cfg = EngineConfig(slots=2, kv_capacity=48, decode_chunk=4, prefill_buckets=[16])
    request = GenerationRequest(prompt_ids=prompt_of(3, 9), n=2, temperature=1.0, max_new_tokens=16, stop_token_ids=[],
                                sample_id=4)
    with JaxEngine(graphdef, params, config=cfg) as engine:
        assert engine.served_params["embed_tokens"]["embedding"].dtype == jnp.float32  # what asyncrl serve reuses
        assert engine.runner.serving["embed_tokens"]["embedding"].dtype == jnp.bfloat16
        before = engine.generate(request)
        moved = jax.tree.map(lambda x: x * 1.5, params)
        engine.update_weights(moved, 1)
        np.testing.assert_array_equal(np.asarray(engine.runner.serving["embed_tokens"]["embedding"], np.float32),
                                      np.asarray(moved["embed_tokens"]["embedding"].astype(jnp.bfloat16), np.float32))
        after = engine.generate(request)
    assert [r.versions.tolist() for r in after] == [[1] * 16] * 2
    assert any(a.logprobs.tolist() != b.logprobs.tolist() for a, b in zip(before, after))


@pytest.mark.slow  # the plain bucketed decode stays in the default selection
def test_bucketed_attention_equals_full_with_top_k_top_p_and_a_trie_in_one_batch(tiny_split):
    """The filtered and the constrained decode variants under attention buckets, requests submitted
    together (one batch): the same tokens and log-probs as over the whole cache."""
    from asyncrl.engine.constraints import TokenTrie

    lm, graphdef, params = tiny_split
    rng = np.random.default_rng(7)
    trie = TokenTrie({tuple(int(t) for t in rng.integers(6, 28, size=40)) for _ in range(16)}, name="bucket-test")
    cfg = EngineConfig(slots=6, kv_capacity=128, decode_chunk=4, prefill_buckets=[32])
    requests = [
        GenerationRequest(prompt_ids=prompt_of(20, 25), n=2, temperature=0.9, top_k=5, top_p=0.8, max_new_tokens=60,
                          stop_token_ids=[], sample_id=20),
        GenerationRequest(prompt_ids=prompt_of(21, 10), n=2, temperature=1.0, max_new_tokens=80, stop_token_ids=[],
                          sample_id=21, constraint=trie),
        GenerationRequest(prompt_ids=prompt_of(22, 30), n=2, temperature=1.0, max_new_tokens=70, stop_token_ids=[],
                          sample_id=22),
    ]

    def run(buckets: int) -> list:
        config = cfg.model_copy(update={"attention_buckets": buckets})
        with JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=config, seed=5) as engine:
            return [f.result() for f in [engine.submit(r) for r in requests]]

    full, bucketed = run(1), run(4)
    for want, got in zip(full, bucketed):
        for a, b in zip(want, got):
            assert a.output_ids.tolist() == b.output_ids.tolist() and a.stop_reason == b.stop_reason
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-6, rtol=0)
    assert all(trie.contains(r.output_ids.tolist()) for r in bucketed[1])  # the constrained request's samples
