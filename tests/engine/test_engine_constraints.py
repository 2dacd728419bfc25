"""Trie-constrained decoding in JaxEngine (docs/decoding.md): TokenTrie itself, constrained
sampling that never leaves the trie and draws from the masked distribution, greedy under a
trie, and constrained and free requests sharing one batch.

References are independent of the engine's decode path: the model's plain forward (no KV
cache) over each whole sequence, and a numpy log-softmax over the trie's allowed tokens.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import wait

import numpy as np
import pytest

from asyncrl.config import EngineConfig
from asyncrl.engine.constraints import FREE, TokenTrie, TriePool, allowed_tokens, is_leaf_node, next_nodes
from asyncrl.engine.jax_engine import JaxEngine
from asyncrl.engine.protocol import GenerationRequest
from asyncrl.errors import EngineRequestError
from asyncrl.model import forward_jit, load_model

pytestmark = pytest.mark.timeout(300)

CFG = EngineConfig(slots=16, kv_capacity=32, decode_chunk=4, prefill_buckets=[8])
PROMPT = [3, 9, 14, 5]
REF_LEN = 16


def random_trie(count: int, seed: int, low: int = 3, high: int = 28) -> TokenTrie:
    """``count`` prefix-free sequences of 2 to 4 tokens in ``[low, high)``."""
    rng = np.random.default_rng(seed)
    chosen: list[tuple[int, ...]] = []
    while len(chosen) < count:
        seq = tuple(int(t) for t in rng.integers(low, high, size=int(rng.integers(2, 5))))
        if all(seq[: len(c)] != c and c[: len(seq)] != seq for c in chosen):
            chosen.append(seq)
    return TokenTrie(chosen, name=f"random-{count}")


@pytest.fixture(scope="module")
def engine(tiny_split):
    lm, graphdef, params = tiny_split
    eng = JaxEngine(graphdef, params, stop_token_ids=lm.stop_token_ids, config=CFG, seed=3)
    yield eng
    eng.shutdown()


def step_logits(graphdef, params, prompt: list[int], completions: list[list[int]]) -> list[np.ndarray]:
    """Per completion, float64 ``[len, V]``: the logits its tokens were chosen from (plain forward)."""
    ids = np.zeros((len(completions), REF_LEN), np.int32)
    mask = np.zeros(ids.shape, bool)
    for b, c in enumerate(completions):
        seq = prompt + list(c)
        ids[b, : len(seq)], mask[b, : len(seq)] = seq, True
    logits = np.asarray(forward_jit(graphdef, params, ids, None, mask)[0], np.float64)
    return [logits[b, len(prompt) - 1 : len(prompt) - 1 + len(c)] for b, c in enumerate(completions)]


def masked_logprobs(trie: TokenTrie, logits: np.ndarray, completion: list[int], temperature: float = 1.0) -> np.ndarray:
    """float64 ``[len]``: each token's log-prob under ``softmax(logits / T)`` restricted to the trie."""
    nodes = trie.walk(completion)
    out = []
    for i, token in enumerate(completion):
        z = logits[i] / temperature
        allowed = trie.allowed(nodes[i])
        sub = z[allowed]
        out.append(z[token] - sub.max() - np.log(np.exp(sub - sub.max()).sum()))
    return np.asarray(out)


# --------------------------------------------------------------------------- the trie itself


def test_trie_structure_and_errors(tmp_path):
    trie = TokenTrie([[5, 7, 9], [5, 8, 2], [6, 1, 1], [5, 7, 9]])
    assert trie.num_sequences == 3 and trie.max_depth == 3 and trie.max_branch == 2
    assert trie.allowed(0).tolist() == [5, 6]
    assert trie.sequences() == [[5, 7, 9], [5, 8, 2], [6, 1, 1]]
    assert trie.contains([5, 8, 2]) and not trie.contains([5, 8]) and not trie.contains([5, 8, 3])
    with pytest.raises(ValueError, match="token 4 is not allowed at node 0"):
        trie.walk([4])
    with pytest.raises(ValueError, match="prefix of another"):
        TokenTrie([[1, 2, 3], [1, 2]])
    with pytest.raises(ValueError, match="extends another"):
        TokenTrie([[1, 2], [1, 2, 3]])
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        TokenTrie([[1], []])

    path = tmp_path / "items.txt"
    path.write_text("# item ids\n5 7 9\n5,8,2\n\n6 1 1\n")
    assert TokenTrie.from_file(path).fingerprint == trie.fingerprint
    path.write_text("5 7 9\n5 x 2\n")
    with pytest.raises(ValueError, match=r"items.txt, line 2: '5 x 2' is not token ids"):
        TokenTrie.from_file(path)
    with pytest.raises(FileNotFoundError, match="constraint file .*missing.txt: not found"):
        TokenTrie.from_file(tmp_path / "missing.txt")


def test_trie_from_strings_with_a_tokenizer():
    lm = load_model("tiny", with_tokenizer=True)
    tok = lm.tokenizer
    end = lm.stop_token_ids[0]
    trie = TokenTrie.from_strings(["1 2", "1 2 3", "4"], tok, end_token_id=end)
    assert trie.num_sequences == 3
    for s in ["1 2", "1 2 3", "4"]:
        assert trie.contains(list(tok.encode(s, add_special_tokens=False)) + [end])


def test_device_helpers_match_the_host_trie():
    trie = random_trie(50, seed=0)
    pool = TriePool()
    other = random_trie(7, seed=1)
    pool.rebuild([other, trie])
    offset = pool.offset(trie)
    assert offset is not None and pool.tables is not None
    for seq in trie.sequences():
        nodes = trie.walk(seq)
        pooled = np.asarray(nodes[:-1]) + offset
        allowed = allowed_tokens(np, pool.tables, pooled, pool.max_branch)
        for i, node in enumerate(nodes[:-1]):
            assert sorted(t for t in allowed[i] if t >= 0) == trie.allowed(node).tolist()
        after = next_nodes(np, pool.tables, pooled, np.asarray(seq), pool.max_branch)
        np.testing.assert_array_equal(after, np.asarray(nodes[1:]) + offset)
        assert is_leaf_node(np, pool.tables, after).tolist() == [False] * (len(seq) - 1) + [True]
    assert next_nodes(np, pool.tables, np.array([offset]), np.array([0]), pool.max_branch)[0] == FREE
    assert (allowed_tokens(np, pool.tables, np.array([FREE]), pool.max_branch) == -1).all()


# --------------------------------------------------------------------------- the engine


def test_constrained_sampling_never_leaves_the_trie_and_matches_the_masked_distribution(engine, tiny_split):
    """1,000 samples of one prompt under a 50-sequence trie, mixed with free requests in the same
    batches: every constrained sample is a trie sequence whose log-probs are the masked ones, the
    sequence frequencies match the masked distribution, and the free samples are untouched."""
    _, graphdef, params = tiny_split
    trie = random_trie(50, seed=0)
    sequences = trie.sequences()
    logits = step_logits(graphdef, params, PROMPT, sequences)
    probs = np.exp([masked_logprobs(trie, lg, s).sum() for lg, s in zip(logits, sequences)])
    np.testing.assert_allclose(probs.sum(), 1.0, atol=1e-9)

    futures = []
    for i in range(125):
        futures.append(engine.submit(GenerationRequest(PROMPT, n=8, sample_id=i, constraint=trie, max_new_tokens=6)))
        if i % 10 == 0:
            futures.append(engine.submit(GenerationRequest(PROMPT, n=2, sample_id=1000 + i, max_new_tokens=6)))
    done, _ = wait(futures, timeout=240)
    assert len(done) == len(futures)
    constrained = [r for f in futures for r in f.result() if len(f.result()) == 8]
    free = [r for f in futures for r in f.result() if len(f.result()) == 2]
    assert len(constrained) == 1000
    counts = np.zeros(len(sequences))
    index = {tuple(s): i for i, s in enumerate(sequences)}
    for r in constrained:
        out = r.output_ids.tolist()
        assert trie.contains(out), f"{out} is not a trie sequence"
        assert r.stop_reason == "stop"
        counts[index[tuple(out)]] += 1
    # Log-probs: the masked distribution's, for every distinct sequence drawn.
    for i in np.flatnonzero(counts):
        r = next(r for r in constrained if r.output_ids.tolist() == sequences[i])
        np.testing.assert_allclose(r.logprobs, masked_logprobs(trie, logits[i], sequences[i]), atol=1e-4)
    # Frequencies: within 4.5 standard errors of the masked sequence probabilities.
    freq = counts / counts.sum()
    assert np.all(np.abs(freq - probs) <= 4.5 * np.sqrt(probs * (1 - probs) / 1000) + 1e-3), (freq, probs)
    # The free requests in the same batches: not restricted to the trie, unmasked log-probs.
    assert any(not trie.contains(r.output_ids.tolist()) for r in free)
    free_logits = step_logits(graphdef, params, PROMPT, [r.output_ids.tolist() for r in free])
    for r, lg in zip(free, free_logits):
        logz = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
        np.testing.assert_allclose(r.logprobs, lg[np.arange(len(r.output_ids)), r.output_ids] - logz, atol=1e-4)


@pytest.mark.slow  # sampling under the trie and the trainer's scores stay in the default selection
def test_greedy_under_a_trie_is_the_best_valid_path(engine, tiny_split):
    """Greedy under a trie takes, at every step, the most likely token the trie allows: the path
    found by enumerating the trie's sequences (each step's argmax over the allowed tokens)."""
    _, graphdef, params = tiny_split
    for seed in range(3):
        trie = random_trie(12, seed=10 + seed)
        prompt = PROMPT[: 2 + seed]
        sequences = trie.sequences()
        logits = step_logits(graphdef, params, prompt, sequences)
        lp = [masked_logprobs(trie, lg, s) for lg, s in zip(logits, sequences)]
        # the best valid path: the one sequence whose every token is the argmax over its node's allowed tokens
        def best_at_every_step(i: int, trie=trie, sequences=sequences, logits=logits) -> bool:
            nodes = trie.walk(sequences[i])
            return all(token == trie.allowed(nodes[t])[np.argmax(logits[i][t][trie.allowed(nodes[t])])]
                       for t, token in enumerate(sequences[i]))

        greedy = [i for i in range(len(sequences)) if best_at_every_step(i)]
        assert len(greedy) == 1
        out = engine.generate(GenerationRequest(prompt, greedy=True, constraint=trie, max_new_tokens=5))[0]
        assert out.output_ids.tolist() == sequences[greedy[0]]
        assert out.stop_reason == "stop"
        np.testing.assert_allclose(out.logprobs, lp[greedy[0]], atol=1e-4)


def test_constraint_errors(engine):
    trie = TokenTrie([[5, 7, 9], [6, 1]])
    with pytest.raises(EngineRequestError, match="max_new_tokens = 2 is shorter than the longest sequence"):
        engine.generate(GenerationRequest(PROMPT, constraint=trie, max_new_tokens=2))
    with pytest.raises(EngineRequestError, match="token 99 is outside the vocabulary"):
        engine.generate(GenerationRequest(PROMPT, constraint=TokenTrie([[99, 1]]), max_new_tokens=4))
    with pytest.raises(EngineRequestError, match="expected a TokenTrie"):
        engine.generate(GenerationRequest(PROMPT, constraint=[[5, 7]], max_new_tokens=4))
    with pytest.raises(ValueError, match="min_new_tokens must be 0 with a constraint"):
        GenerationRequest(PROMPT, constraint=trie, min_new_tokens=1)


def test_several_tries_share_the_engine(engine):
    """Requests with different tries run together; the pool is rebuilt as new tries arrive."""
    tries = [random_trie(5 + k, seed=100 + k) for k in range(4)]
    futures = [(t, engine.submit(GenerationRequest(PROMPT, n=3, sample_id=k, constraint=t, max_new_tokens=4)))
               for k, t in enumerate(tries * 3)]
    for trie, f in futures:
        for r in f.result(timeout=120):
            assert trie.contains(r.output_ids.tolist())


# --------------------------------------------------------------------------- exact RL under a constraint


def constrained_groups(engine, trie: TokenTrie, temperature: float, groups: int = 4, group_size: int = 4):
    from asyncrl.rollout.trajectory import TrajectoryBuilder, TrajectoryGroup

    out = []
    for g in range(groups):
        prompt = PROMPT[: 2 + g % 3]
        responses = engine.generate(GenerationRequest(prompt, n=group_size, sample_id=500 + g, temperature=temperature,
                                                      constraint=trie, max_new_tokens=6))
        trajectories = [TrajectoryBuilder().add_tokens(prompt).add_generation(r, constraint=trie)
                        .build(temperature=temperature, reward=float(i), metadata={"i": i})
                        for i, r in enumerate(responses)]
        out.append(TrajectoryGroup(trajectories=trajectories))
    return out


def test_trainer_scores_constrained_tokens_under_the_same_mask(engine, tiny_split):
    """RL under a constraint is exact: the trainer's log-probs of sampled completions (a 50-sequence
    trie, temperature 0.8) equal the engine's within 1e-5, the step's behaviour/proximal gap is ~0,
    the constraint survives packing, and a trainer without the trie refuses the batch."""
    from asyncrl.errors import TrainerError
    from asyncrl.rollout.batch import build_train_batch
    from asyncrl.rollout.trajectory import TrajectoryGroup
    from asyncrl.trainer import Trainer
    from tests.trainer_fixtures import trainer_config

    _, graphdef, params = tiny_split
    trie = random_trie(50, seed=0)
    temperature = 0.8
    groups = constrained_groups(engine, trie, temperature)
    for group in groups:
        for traj in group.trajectories:
            assert trie.contains(traj.input_ids[traj.loss_mask].tolist())
            assert traj.constraint == trie.fingerprint
    meta, arrays = groups[0].pack()
    again = TrajectoryGroup.unpack(meta, arrays, where="test")
    np.testing.assert_array_equal(again.trajectories[1].constraint_nodes, groups[0].trajectories[1].constraint_nodes)

    cfg = trainer_config(rollout={"temperature": temperature}, algo={"decoupled": True}, optim={"lr": 1e-6})
    trainer = Trainer(cfg, graphdef, params, constraint=trie)
    batch = build_train_batch(groups, cfg, row_multiple=trainer.row_multiple)
    assert batch.constraint == trie.fingerprint and batch.constraint_nodes is not None
    got = trainer.logprobs(batch)
    trained = batch.loss_mask
    np.testing.assert_allclose(got[trained], batch.behavior_logprobs[trained], atol=1e-5, rtol=0)
    # Without the mask the same tokens score very differently: the mask is what makes them equal.
    free = Trainer(trainer_config(rollout={"temperature": temperature}), graphdef, params)
    with pytest.raises(TrainerError, match="decoded under trie .* the trainer's constraint is none"):
        free.logprobs(batch)
    unmasked = Trainer(cfg, graphdef, params, constraint=trie).logprobs(
        dataclasses.replace(batch, constraint_nodes=np.full_like(batch.constraint_nodes, -1)))
    assert np.max(np.abs(unmasked[trained] - batch.behavior_logprobs[trained])) > 0.5

    metrics = trainer.step(batch)
    assert metrics["engine/logprob_gap"] < 1e-5
    assert abs(metrics["train/behave_weight_mean"] - 1.0) < 1e-5


@pytest.mark.slow  # 10 s; the trainer-equals-engine test checks the masked log-probs of the default path
def test_masked_logprobs_chunked_and_windowed_equal_the_whole(tiny_split):
    """per_token_logprobs(allowed=...) gives the same masked log-probs and entropies whether the
    lm head runs at once, in chunks, or over a window (the trainer's three paths)."""
    from asyncrl.engine.constraints import allowed_tokens
    from asyncrl.model import per_token_logprobs

    _, graphdef, params = tiny_split
    trie = random_trie(20, seed=5)
    rng = np.random.default_rng(0)
    ids = np.zeros((4, 12), np.int32)
    nodes = np.full((4, 12), -1, np.int32)
    mask = np.zeros((4, 12), bool)
    for b, seq in enumerate(trie.sequences()[:4]):
        prompt = [int(t) for t in rng.integers(6, 28, size=3 + b)]
        ids[b, : len(prompt) + len(seq)] = prompt + seq
        mask[b, : len(prompt) + len(seq)] = True
        nodes[b, len(prompt): len(prompt) + len(seq)] = trie.walk(seq)[:-1]
    allowed = allowed_tokens(np, trie.tables(), nodes, trie.max_branch)
    whole, whole_ent = per_token_logprobs(graphdef, params, ids, mask, 0.7, allowed=allowed)
    chunked, chunked_ent = per_token_logprobs(graphdef, params, ids, mask, 0.7, allowed=allowed, chunk_size=5)
    np.testing.assert_allclose(chunked, whole, atol=1e-6)
    np.testing.assert_allclose(chunked_ent, whole_ent, atol=1e-6)
    starts = np.array([3, 4, 5, 4], np.int32)
    windowed, _ = per_token_logprobs(graphdef, params, ids, mask, 0.7, allowed=allowed, window=7, window_start=starts)
    for b in range(4):
        np.testing.assert_allclose(np.asarray(windowed)[b], np.asarray(whole)[b, starts[b]: starts[b] + 7], atol=1e-6)
    # masked entropies are at most log(allowed count); free positions keep the full-vocabulary entropy
    counts = (allowed >= 0).sum(-1)
    constrained = (counts > 0) & mask
    assert np.all(np.asarray(whole_ent)[constrained] <= np.log(counts[constrained]) + 1e-5)
    free, free_ent = per_token_logprobs(graphdef, params, ids, mask, 0.7)
    np.testing.assert_allclose(np.asarray(whole)[~constrained], np.asarray(free)[~constrained], atol=1e-6)
