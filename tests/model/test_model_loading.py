"""Loading and building models: the tiny reference model and tokenizer, sharded and
tied checkpoints, pad/EOS handling, and the message of every loading error."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.errors import ConfigError, ModelError
from asyncrl.model import TINY_ALPHABET, ensure_tiny, export_hf, forward_jit, load_model
from tests.helpers import REPO_ROOT


@pytest.fixture()
def copy_of_tiny(tiny_dir, tmp_path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny_dir, target)
    return target


def read_tensors(model_dir: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(model_dir / "model.safetensors"))


def write_tensors(model_dir: Path, tensors: dict) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def logits_of(lm, ids=((4, 7, 8, 9, 10, 11, 5),)):
    return np.asarray(forward_jit(*lm.split(), jnp.asarray(ids, jnp.int32))[0])


# --------------------------------------------------------------------------- tiny


def test_tiny_build_is_cached_and_safe_under_racing_builders(tmp_path):
    results, errors = [], []

    def build():
        try:
            results.append(ensure_tiny("tiny:hidden=32,layers=1", cache_dir=tmp_path))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 3 and len(set(results)) == 1
    (built,) = set(results)
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporary directories left
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {p.name for p in built.iterdir()}
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny("tiny:hidden=32,layers=1", cache_dir=tmp_path) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt
    other = ensure_tiny("tiny:hidden=32,layers=1,seed=1", cache_dir=tmp_path)
    assert other != built and read_tensors(other)["model.norm.weight"].shape == (32,)


def test_export_losing_a_race_keeps_the_winner(tiny_from_dir, tmp_path, monkeypatch):
    """Another process renames its build into place while we assemble ours (exist_ok)."""
    import tempfile

    target = tmp_path / "tiny-x"
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp_then_lose(*args, **kwargs):
        ours = real_mkdtemp(*args, **kwargs)
        target.mkdir()
        (target / "config.json").write_text("{}")  # the winner's (complete) directory
        return ours

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_then_lose)
    assert export_hf(tiny_from_dir, None, target, exist_ok=True) == target
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-x"]  # our temporary copy is gone
    assert [p.name for p in target.iterdir()] == ["config.json"]  # the winner's files untouched
    target.rename(tmp_path / "gone")
    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_then_lose)
    with pytest.raises(ModelError, match=r"appeared while exporting"):
        export_hf(tiny_from_dir, None, target)


def test_tiny_resolves_by_name_with_options(tiny_dir, monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tiny_dir.parent))
    lm = load_model("tiny")
    assert lm.path == tiny_dir
    cfg = lm.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (64, 2, 4, 2, 128)
    assert cfg.tie_word_embeddings and cfg.qkv_bias and cfg.vocab_size <= 32
    from asyncrl.config import load_config

    model_cfg = load_config(data={"model": {"path": "tiny", "logprob_chunk_size": 3, "remat": True}}).model
    import asyncrl

    assert asyncrl.load_model is load_model and asyncrl.export_hf is export_hf
    lm = asyncrl.load_model(model_cfg)
    assert lm.config.logprob_chunk_size == 3 and lm.config.remat
    with pytest.raises(ConfigError, match="model.logprob_chunk_size"):
        load_config(data={"model": {"logprob_chunk_size": 0}})
    with pytest.raises(ModelError, match=r"bad option 'width=3'"):
        load_model("tiny:width=3")
    with pytest.raises(ModelError, match=r"option layers needs an integer, got 'two'"):
        load_model("tiny:layers=two")


def test_tiny_tokenizer_loads_with_autotokenizer(tiny_from_dir, tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert len(tok) == tiny_from_dir.config.vocab_size <= 32
    ids = {c: tok.convert_tokens_to_ids(c) for c in TINY_ALPHABET}
    assert len(set(ids.values())) == len(TINY_ALPHABET) and tok.unk_token_id not in ids.values()
    text = "A:12+30=42 R:987\nC:5-3"
    encoded = tok(text, add_special_tokens=False)["input_ids"]
    assert encoded == [ids[c] for c in text] and tok.decode(encoded) == text
    assert tok("1x2", add_special_tokens=False)["input_ids"] == [ids["1"], tok.unk_token_id, ids["2"]]

    chat = [{"role": "user", "content": "A:1+2"}, {"role": "assistant", "content": "3"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "<|user|>A:1+2<|end|><|assistant|>3<|end|>"
    prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>A:1+2<|end|><|assistant|>"
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert prompt_ids[0] == tok.convert_tokens_to_ids("<|user|>") and len(prompt_ids) == 1 + 5 + 1 + 1

    end = tok.convert_tokens_to_ids("<|end|>")
    assert tok.eos_token_id == end and tiny_from_dir.stop_token_ids == (end,)
    assert json.loads((tiny_dir / "generation_config.json").read_text())["eos_token_id"] == end
    assert tiny_from_dir.pad_token_id == tok.pad_token_id != end


def test_pad_token_may_be_absent(copy_of_tiny):
    """Llama-style: no pad token anywhere. The pad id falls back to the first stop id."""
    tok_cfg = json.loads((copy_of_tiny / "tokenizer_config.json").read_text())
    tok_cfg.pop("pad_token")
    (copy_of_tiny / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    cfg = json.loads((copy_of_tiny / "config.json").read_text())
    cfg["pad_token_id"] = None
    (copy_of_tiny / "config.json").write_text(json.dumps(cfg))
    gen = {"eos_token_id": [5, 2]}
    (copy_of_tiny / "generation_config.json").write_text(json.dumps(gen))
    lm = load_model(str(copy_of_tiny))
    assert lm.tokenizer.pad_token_id is None
    assert lm.stop_token_ids == (5, 2) and lm.pad_token_id == 5


# --------------------------------------------------------------------------- checkpoints


def test_sharded_checkpoint_and_legacy_tied_head_load(tiny_from_dir, copy_of_tiny):
    tensors = read_tensors(copy_of_tiny)
    (copy_of_tiny / "model.safetensors").unlink()
    from safetensors.numpy import save_file

    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(copy_of_tiny / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    index = copy_of_tiny / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert np.array_equal(logits_of(load_model(str(copy_of_tiny))), logits_of(tiny_from_dir))

    # transformers 4 also saved lm_head.weight beside tied embeddings: accepted and ignored
    extra = {"lm_head.weight": tensors["model.embed_tokens.weight"]}
    save_file(extra, str(copy_of_tiny / "model-00003.safetensors"), metadata={"format": "pt"})
    weight_map["lm_head.weight"] = "model-00003.safetensors"
    weight_map["model.layers.0.self_attn.rotary_emb.inv_freq"] = "model-00003.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert np.array_equal(logits_of(load_model(str(copy_of_tiny))), logits_of(tiny_from_dir))

    weight_map["model.norm.weight"] = "model-00009.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelError, match=r"index.json: names shard model-00009.safetensors, which does not exist"):
        load_model(str(copy_of_tiny))


def test_missing_unexpected_and_misshaped_tensors_are_one_error(copy_of_tiny):
    tensors = read_tensors(copy_of_tiny)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    del tensors["model.norm.weight"]
    tensors["model.layers.7.mlp.up_proj.weight"] = np.zeros((2, 2), np.float32)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    write_tensors(copy_of_tiny, tensors)
    with pytest.raises(ModelError) as info:
        load_model(str(copy_of_tiny))
    message = str(info.value)
    assert str(copy_of_tiny) in message
    assert "missing tensors (2): model.layers.1.mlp.up_proj.weight, model.norm.weight" in message
    assert "unexpected tensors (1): model.layers.7.mlp.up_proj.weight" in message
    assert "mis-shaped tensors (1): model.layers.0.self_attn.k_proj.weight: file has [16, 64], config needs [32, 64]" in message


def test_untied_config_needs_lm_head(copy_of_tiny):
    cfg = json.loads((copy_of_tiny / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (copy_of_tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"missing tensors \(1\): lm_head.weight"):
        load_model(str(copy_of_tiny))


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"model_type": "gpt2"}, r"model_type 'gpt2' is not supported; supported: qwen2, qwen3, llama"),
        ({"hidden_act": "gelu"}, r"unsupported option\(s\) for model_type 'llama': hidden_act='gelu'"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
            r"rope_type='yarn' \(supported: default, linear, llama3\)",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
            r"partial_rotary_factor=0.5",
        ),
    ],
)
def test_unsupported_architecture_is_a_clear_error(copy_of_tiny, changes, expected):
    cfg = json.loads((copy_of_tiny / "config.json").read_text())
    cfg.update(changes)
    (copy_of_tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=expected) as info:
        load_model(str(copy_of_tiny))
    assert "config.json" in str(info.value)


def test_sliding_window_qwen2_is_refused(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, use_sliding_window=True,
                         sliding_window=16, max_window_layers=0).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match=r"sliding-window attention is not supported"):
        load_model(str(tmp_path))


def test_file_level_errors(copy_of_tiny, tmp_path, monkeypatch):
    (copy_of_tiny / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"no model.safetensors or model.safetensors.index.json \(found: .*config.json"):
        load_model(str(copy_of_tiny))
    (copy_of_tiny / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelError, match=r"model.safetensors: cannot read safetensors"):
        load_model(str(copy_of_tiny))
    (copy_of_tiny / "config.json").unlink()
    with pytest.raises(ModelError, match=r"no config.json"):
        load_model(str(copy_of_tiny))
    with pytest.raises(ModelError, match=r"'\./no/such/dir': no such directory"):
        load_model("./no/such/dir")
    # a hub id goes to huggingface_hub only when no such directory exists (offline here)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match=r"'nobody-here/no-model': not a local directory, and downloading it from the hub failed"):
        load_model("nobody-here/no-model")


def test_export_refuses_to_clobber_unless_asked(tiny_from_dir, tmp_path):
    out = export_hf(tiny_from_dir, None, tmp_path / "out")
    with pytest.raises(ModelError, match=r"already exists \(pass overwrite=True"):
        export_hf(tiny_from_dir, None, out)
    export_hf(tiny_from_dir, None, out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    reloaded = load_model(str(out))
    assert reloaded.stop_token_ids == tiny_from_dir.stop_token_ids
    assert np.array_equal(logits_of(reloaded), logits_of(tiny_from_dir))
    assert reloaded.tokenizer("12")["input_ids"] == tiny_from_dir.tokenizer("12")["input_ids"]


def test_loading_sits_above_the_directory_format_and_the_builtin_models():
    """hf.py (the HF directory format), tiny.py and tiny_qwen3.py (built-in models written through
    export_hf) never import loading.py nor each other upwards: no model.hf <-> model.tiny cycle."""
    import ast

    from asyncrl.config import ModelConfig
    from asyncrl.model.loading import runtime_fields
    from tests.helpers import REPO_ROOT

    def imported(name: str) -> set[str]:
        tree = ast.parse((REPO_ROOT / "asyncrl" / "model" / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):  # function-level imports count too
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        return found

    below = {"hf": {"asyncrl.model.loading", "asyncrl.model.tiny", "asyncrl.model.tiny_qwen3"},
             "tiny": {"asyncrl.model.loading", "asyncrl.model.tiny_qwen3"},
             "tiny_qwen3": {"asyncrl.model.loading"}}
    for name, forbidden in below.items():
        assert not imported(name) & (forbidden | {"asyncrl.model"}), name
    # The model section's runtime options are derived, not listed: every one reaches the DecoderConfig.
    assert set(runtime_fields()) == set(ModelConfig.model_fields) - {"path", "lora"}


def test_tiny_qwen3_needs_nothing_outside_the_package(tmp_path, monkeypatch):
    """Without a corpus, tiny-qwen3's tokenizer is the one the package ships (4,096 BPE tokens with
    Qwen's specials and chat template), wherever the command runs; the package data lists it."""
    import configparser

    from asyncrl.model import tiny_qwen3

    monkeypatch.delenv(tiny_qwen3.CORPUS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    spec = tiny_qwen3.parse_spec("tiny-qwen3")
    assert tiny_qwen3.corpus_path(spec) is None
    tokenizer = tiny_qwen3.tokenizer_for(spec)
    assert len(tokenizer) == tiny_qwen3.SHIPPED_VOCAB and tokenizer.eos_token == tiny_qwen3.IM_END
    assert 4 <= len(tokenizer("Natalia sold 48 clips in April.")["input_ids"]) <= 12  # subwords
    setup = configparser.ConfigParser()
    setup.read(REPO_ROOT / "setup.cfg")
    shipped = {line.strip() for line in setup["options.package_data"]["asyncrl.model"].split(",")}
    assert shipped == {"assets/tiny_qwen3_tokenizer.json", "assets/GSM8K-LICENSE"}
    assert all((tiny_qwen3.SHIPPED_TOKENIZER.parent.parent / name).is_file() for name in shipped)


@pytest.mark.slow
def test_the_shipped_tiny_qwen3_tokenizer_is_what_its_script_trains_on_gsm8k():
    from tests.helpers import SHARED_DATA

    train = SHARED_DATA / "gsm8k" / "train.jsonl"
    proc = subprocess.run([sys.executable, "scripts/make_tiny_qwen3_tokenizer.py", "--gsm8k-train", str(train), "--check"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and json.loads(proc.stdout)["same_as_shipped"], proc.stdout + proc.stderr
