"""Model numerics: parity with transformers' PyTorch models, KV-cache decoding, log-probs, export.

References are transformers' own models on random weights it saved itself, and numpy
formulas written out here; nothing is compared against asyncrl code alone.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.model import (
    export_hf,
    forward_jit,
    init_kv_cache,
    load_model,
    per_token_logprobs_jit,
    split_params,
)
from tests.model_helpers import FAMILIES, hf_logits, rewrite_config, save_hf_model

torch = pytest.importorskip("torch")

SEQ = 11
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (directory written by transformers, the torch model, our loaded model)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, family in enumerate(FAMILIES):
        path = root / family
        hf = save_hf_model(family, path, seed=i)
        out[family] = (path, hf, load_model(str(path), with_tokenizer=False))
    return out


def padded_batch(vocab: int, seed: int = 0):
    """ids [3, SEQ] and mask: a full row, a left-padded row (3 pads), a right-padded row (4 pads)."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(5, vocab, size=(3, SEQ)).astype(np.int32)
    mask = np.ones((3, SEQ), bool)
    mask[1, :3] = False
    mask[2, -4:] = False
    ids[~mask] = 0
    return ids, mask


def numpy_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parity_with_transformers_padded_batch_and_logprobs(checkpoints, family):
    path, hf, lm = checkpoints[family]
    ids, mask = padded_batch(FAMILIES[family]["vocab_size"])
    ref = hf_logits(hf, ids, mask)
    graphdef, params = lm.split()
    ours = np.asarray(forward_jit(graphdef, params, jnp.asarray(ids), None, jnp.asarray(mask))[0])
    assert ours.dtype == np.float32
    diff = np.abs(ours - ref)[mask]
    assert diff.max() < 1e-4, f"{family}: max |logit diff| {diff.max()}"
    top2 = np.sort(ref, -1)[..., -2:]
    decisive = mask & (top2[..., 1] - top2[..., 0] > 1e-4)
    assert np.array_equal(ours.argmax(-1)[decisive], ref.argmax(-1)[decisive])

    # per_token_logprobs == log_softmax(HF logits / T) shifted by one; entropy by the formula.
    lp, ent = per_token_logprobs_jit(graphdef, params, jnp.asarray(ids), jnp.asarray(mask), TEMPERATURE)
    lp, ent = np.asarray(lp), np.asarray(ent)
    assert lp.dtype == np.float32 and ent.dtype == np.float32
    ref_lsm = numpy_log_softmax(ref / TEMPERATURE)
    scored = np.zeros_like(mask)
    scored[:, 1:] = mask[:, 1:] & mask[:, :-1]
    ref_lp = np.zeros(ids.shape)
    ref_ent = np.zeros(ids.shape)
    for b, t in zip(*np.nonzero(scored)):
        ref_lp[b, t] = ref_lsm[b, t - 1, ids[b, t]]
        ref_ent[b, t] = -(np.exp(ref_lsm[b, t - 1]) * ref_lsm[b, t - 1]).sum()
    assert np.abs(lp - ref_lp).max() < 1e-4
    assert np.abs(ent - ref_ent).max() < 1e-4
    assert np.all(lp[~scored] == 0) and np.all(ent[~scored] == 0)
    assert np.all(lp[:, 0] == 0)


def test_tied_head_is_not_missing_and_configs_translate(checkpoints):
    qwen2, qwen3, llama = (checkpoints[f][2].config for f in ("qwen2", "qwen3", "llama"))
    assert qwen2.tie_word_embeddings and qwen2.qkv_bias and not qwen2.o_bias
    assert "lm_head" not in checkpoints["qwen2"][2].split()[1]
    assert qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_heads and qwen3.qk_norm
    assert llama.rope_type == "llama3" and llama.rope_factor == 8.0 and llama.num_kv_heads == 1
    assert checkpoints["qwen2"][2].stop_token_ids == (3, 4)
    assert checkpoints["qwen3"][2].stop_token_ids == (2,)


def test_bfloat16_checkpoint_loads(tmp_path):
    path = tmp_path / "bf16"
    save_hf_model("qwen2", path, seed=5, dtype=torch.bfloat16)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="flax") as f:
        assert f.get_tensor("model.norm.weight").dtype == jnp.bfloat16
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    ids, mask = padded_batch(FAMILIES["qwen2"]["vocab_size"], seed=3)
    ref = hf_logits(ref_model, ids, mask)

    exact = load_model(str(path), with_tokenizer=False)  # bf16 weights upcast to float32
    g, p = exact.split()
    assert jax.tree.leaves(p)[0].dtype == jnp.float32
    out = np.asarray(forward_jit(g, p, jnp.asarray(ids), None, jnp.asarray(mask))[0])
    assert np.abs(out - ref)[mask].max() < 1e-4

    low = load_model(str(path), with_tokenizer=False, param_dtype="bfloat16", compute_dtype="bfloat16")
    g, p = low.split()
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p))
    out = np.asarray(forward_jit(g, p, jnp.asarray(ids), None, jnp.asarray(mask))[0])
    assert out.dtype == np.float32
    scale = np.abs(ref[mask]).max()
    assert np.abs(out - ref)[mask].max() < 0.05 * scale

    # bf16 parameters export as bf16 tensors and reload bit-identical
    exported = export_hf(low, None, tmp_path / "bf16-export")
    with safe_open(str(exported / "model.safetensors"), framework="flax") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == jnp.bfloat16
    again = load_model(str(exported), with_tokenizer=False, param_dtype="bfloat16", compute_dtype="bfloat16")
    assert all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(again.split()[1])))


def test_old_layout_config_gives_same_model(checkpoints, tmp_path):
    path, _, new = checkpoints["llama"]
    old_dir = tmp_path / "old"
    shutil.copytree(path, old_dir)
    rope = FAMILIES["llama"]["rope_parameters"]
    rewrite_config(
        old_dir,
        rope_parameters=None,
        rope_theta=rope["rope_theta"],
        rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
    )
    old = load_model(str(old_dir), with_tokenizer=False)
    assert old.config == new.config
    ids, mask = padded_batch(FAMILIES["llama"]["vocab_size"])
    a = forward_jit(*old.split(), jnp.asarray(ids), None, jnp.asarray(mask))[0]
    b = forward_jit(*new.split(), jnp.asarray(ids), None, jnp.asarray(mask))[0]
    assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("family", ["qwen3", pytest.param("llama", marks=pytest.mark.slow), pytest.param("gemma3", marks=pytest.mark.slow)])
def test_kv_cache_decoding_matches_full_forward(checkpoints, family):
    _, _, lm = checkpoints[family]
    graphdef, params = lm.split()
    ids, mask = padded_batch(FAMILIES[family]["vocab_size"], seed=1)
    full = np.asarray(forward_jit(graphdef, params, jnp.asarray(ids), None, jnp.asarray(mask))[0])

    for step in (1, 3):  # decode one token per call, and several
        cache = init_kv_cache(lm.config, batch=3, capacity=16)
        prefill = 4
        logits, cache = forward_jit(graphdef, params, jnp.asarray(ids[:, :prefill]), None, jnp.asarray(mask[:, :prefill]), cache)
        pieces = [np.asarray(logits)]
        for start in range(prefill, SEQ, step):
            stop = min(start + step, SEQ)
            if stop - start != step:  # keep one compiled shape: pad the call, ignore its tail
                chunk_ids = np.zeros((3, step), np.int32)
                chunk_mask = np.zeros((3, step), bool)
                chunk_ids[:, : stop - start] = ids[:, start:stop]
                chunk_mask[:, : stop - start] = mask[:, start:stop]
            else:
                chunk_ids, chunk_mask = ids[:, start:stop], mask[:, start:stop]
            logits, cache = forward_jit(graphdef, params, jnp.asarray(chunk_ids), None, jnp.asarray(chunk_mask), cache)
            pieces.append(np.asarray(logits)[:, : stop - start])
        decoded = np.concatenate(pieces, axis=1)
        diff = np.abs(decoded - full)[mask]
        assert diff.max() < 1e-5, f"{family}, {step} token(s) per call: {diff.max()}"
        # write positions end one past each row's last real token; valid slots = real tokens
        assert np.asarray(cache.write_pos).tolist() == [SEQ, SEQ, SEQ - 4]
        assert np.array_equal(np.asarray(cache.valid)[:, :SEQ], mask)
        assert not np.asarray(cache.valid)[:, SEQ:].any()


def test_logprobs_of_a_row_do_not_depend_on_batch_padding_bucket_or_chunking(checkpoints):
    _, _, lm = checkpoints["qwen3"]
    graphdef, params = lm.split()
    vocab = FAMILIES["qwen3"]["vocab_size"]
    rng = np.random.RandomState(11)
    row = rng.randint(5, vocab, 7).astype(np.int32)

    alone_ids, alone_mask = row[None], np.ones((1, 7), bool)
    lp_alone, ent_alone = (np.asarray(x)[0] for x in per_token_logprobs_jit(graphdef, params, jnp.asarray(alone_ids), jnp.asarray(alone_mask), TEMPERATURE))

    bucket = 12  # longer bucket, other rows, and an all-padding row
    ids = np.zeros((4, bucket), np.int32)
    mask = np.zeros((4, bucket), bool)
    ids[0] = rng.randint(5, vocab, bucket)
    mask[0] = True
    ids[2, :7], mask[2, :7] = row, True
    ids[3, :4], mask[3, :4] = rng.randint(5, vocab, 4), True
    # batched, padded, a longer bucket, and chunked over the sequence (5 does not divide 12)
    lp, ent = per_token_logprobs_jit(graphdef, params, jnp.asarray(ids), jnp.asarray(mask), TEMPERATURE, chunk_size=5)
    lp, ent = np.asarray(lp), np.asarray(ent)
    assert np.abs(lp[2, :7] - lp_alone).max() < 1e-6
    assert np.abs(ent[2, :7] - ent_alone).max() < 1e-6
    assert np.all(lp[2, 7:] == 0) and np.all(lp[1] == 0) and np.all(ent[1] == 0)


def test_chunked_and_rematerialised_gradients_match_plain(checkpoints):
    """Chunking (jax.checkpoint + lax.map over the lm head) and per-layer remat change memory, not math."""
    from asyncrl.model import per_token_logprobs

    path, _, lm = checkpoints["llama"]
    remat = load_model(str(path), with_tokenizer=False, remat=True, logprob_chunk_size=4)
    ids, mask = padded_batch(FAMILIES["llama"]["vocab_size"], seed=6)

    def grads(graphdef, params):
        def loss(p):
            lp, ent = per_token_logprobs(graphdef, p, jnp.asarray(ids), jnp.asarray(mask), TEMPERATURE)
            return lp.sum() + 0.1 * ent.sum()

        return jax.tree.leaves(jax.jit(jax.grad(loss))(params))

    plain, both = grads(*lm.split()), grads(*remat.split())
    assert remat.config.remat and remat.config.logprob_chunk_size == 4
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(plain, both)) < 1e-5
    save_dots = load_model(str(path), with_tokenizer=False, remat=True, remat_policy="save_dots")
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(plain, grads(*save_dots.split()))) < 1e-5


@pytest.mark.slow  # remat's math stays in the default selection (chunked and rematerialised gradients)
def test_the_save_dots_policy_recomputes_only_attention_matmuls():
    """What each remat policy recomputes shows in the compiled backward's matmuls: with
    ``save_dots`` only attention's two einsums per layer run again (their operands have batch
    dimensions); with ``full`` every projection too."""
    from asyncrl.model import per_token_logprobs

    ids, mask = jnp.asarray(np.arange(32).reshape(2, 16) % 20 + 6, jnp.int32), jnp.ones((2, 16), bool)

    def matmuls(**options) -> tuple[int, int]:
        lm = load_model("tiny", with_tokenizer=False, **options)
        graphdef, params = lm.split()

        def loss(p):
            return per_token_logprobs(graphdef, p, ids, mask, TEMPERATURE)[0].sum()

        return str(jax.jit(jax.grad(loss)).lower(params).compile().as_text()).count(" dot("), lm.config.num_layers

    (none, layers), (dots, _), (full, _) = matmuls(remat=False), matmuls(remat=True, remat_policy="save_dots"), \
        matmuls(remat=True, remat_policy="full")
    assert dots == none + 2 * layers and full > dots, (none, dots, full)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_export_round_trip_loads_in_transformers(checkpoints, tmp_path, family):
    from transformers import AutoModelForCausalLM

    _, _, lm = checkpoints[family]
    out = export_hf(lm.model, None, tmp_path / "export", stop_token_ids=lm.stop_token_ids)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temp dirs left
    hf = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    ids, mask = padded_batch(FAMILIES[family]["vocab_size"], seed=9)
    ours = np.asarray(forward_jit(*lm.split(), jnp.asarray(ids), None, jnp.asarray(mask))[0])
    assert np.abs(ours - hf_logits(hf, ids, mask))[mask].max() < 1e-5
    reloaded = load_model(str(out), with_tokenizer=False)
    assert reloaded.config == lm.config and reloaded.stop_token_ids == lm.stop_token_ids
    # exporting from a graphdef + params (what the trainer holds) writes the same weights
    graphdef, params = split_params(lm.model)
    export_hf(graphdef, None, tmp_path / "again", params=params, stop_token_ids=lm.stop_token_ids)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
