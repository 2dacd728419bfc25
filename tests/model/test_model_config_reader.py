"""Start-up without torch: asyncrl's own ``config.json`` reader gives the DecoderConfig that
``transformers.AutoConfig`` gives, the built-in models' tokenizers load as AutoTokenizer loads
them, and loading the tiny model (and a run's TensorBoard sink) imports no torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.errors import ModelError
from asyncrl.model.config import from_hf_config
from asyncrl.model.hf import load_tokenizer, read_hf_config, read_stop_token_ids
from asyncrl.model.tiny import ensure_tiny
from asyncrl.model.tiny_qwen3 import ensure_tiny_qwen3
from tests.helpers import run_python
from tests.model_helpers import FAMILIES

BASE = dict(vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)

# config.json files as checkpoints write them: each exercises defaults or a normalisation of AutoConfig's.
VARIANTS = {
    "llama-minimal": dict(model_type="llama", **BASE),  # head_dim, kv heads, eos/bos 2/1, max positions from defaults
    "qwen2-minimal": dict(model_type="qwen2", num_key_value_heads=2, **BASE),  # layer_types computed
    "qwen3-minimal": dict(model_type="qwen3", num_key_value_heads=4, **BASE),  # head_dim 128 by default
    "qwen2-default-kv-heads": dict(model_type="qwen2", **BASE),  # Qwen2Config's 32 KV heads: refused
    "llama-legacy-rope": dict(model_type="llama", rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0},
                              **BASE),
    "llama-legacy-llama3": dict(model_type="llama", max_position_embeddings=4096, rope_theta=500000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0}, **BASE),
    "llama-biases-head-dim": dict(model_type="llama", attention_bias=True, mlp_bias=True, head_dim=32,
                                  num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=[5, 6], **BASE),
    "qwen2-real-layout": dict(model_type="qwen2", rope_theta=1000000.0, use_sliding_window=False, sliding_window=4096,
                              max_window_layers=21, num_key_value_heads=2, tie_word_embeddings=True,
                              bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16", **BASE),
    "qwen2-window-over-no-layer": dict(model_type="qwen2", use_sliding_window=True, sliding_window=16,
                                       max_window_layers=2, num_key_value_heads=2, **BASE),
    "qwen3-attention-bias": dict(model_type="qwen3", attention_bias=True, head_dim=16, rms_norm_eps=1e-5,
                                 num_key_value_heads=2, **BASE),
    # Gemma 3: every default of Gemma3TextConfig (layer types from the pattern of 6, rope bases 1e6 / 1e4), and the
    # released 1B's layout (legacy rope_theta, rope_local_base_freq, sliding_window_pattern), and 4B's linear scaling
    "gemma3-minimal": dict(model_type="gemma3_text", num_key_value_heads=2, head_dim=16, **{**BASE, "num_hidden_layers": 7}),
    "gemma3-1b-layout": dict(model_type="gemma3_text", num_key_value_heads=1, head_dim=16, rope_theta=1000000,
                             rope_local_base_freq=10000, rope_scaling=None, sliding_window=512, sliding_window_pattern=6,
                             query_pre_attn_scalar=16, attn_logit_softcapping=None, final_logit_softcapping=None,
                             eos_token_id=[1, 106], cache_implementation="hybrid", **BASE),
    "gemma3-linear-rope": dict(model_type="gemma3_text", rope_scaling={"rope_type": "linear", "factor": 8.0},
                               sliding_window=1024, sliding_window_pattern=2, **BASE),
    # refused, with the same message from both readers
    "qwen2-sliding": dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1,
                          num_key_value_heads=2, **BASE),
    "llama-partial-rotary": dict(model_type="llama", partial_rotary_factor=0.5, **BASE),
    "llama-yarn": dict(model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 512}, **BASE),
    "llama-gelu": dict(model_type="llama", hidden_act="gelu", **BASE),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=48),
    "gemma3-attn-softcap": dict(model_type="gemma3_text", attn_logit_softcapping=50.0, **BASE),
}


def _through_transformers(model_dir: Path):
    """What the loader did before: AutoConfig, then the same translation."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def _translate(read, model_dir: Path):
    source = str(model_dir / "config.json")
    try:
        hf = read(model_dir)
        return from_hf_config(hf, source=source), read_stop_token_ids(model_dir, hf)
    except ModelError as err:
        return "ModelError", str(err)


@pytest.fixture(scope="module")
def builtin_dirs(tmp_path_factory) -> dict[str, Path]:
    """``tiny`` where the other tests' load_model("tiny") finds it, a small ``tiny-qwen3`` here."""
    cache = tmp_path_factory.mktemp("builtin")
    corpus = cache / "corpus.txt"
    corpus.write_text("".join(f"Q: {i} + {i * 7} = ? A: {i * 8}\n" for i in range(200)))
    return {"tiny": ensure_tiny("tiny"),
            "tiny-qwen3": ensure_tiny_qwen3(f"tiny-qwen3:vocab=300,layers=1,corpus={corpus}", cache_dir=cache)}


def _config_dirs(root: Path, builtin_dirs: dict[str, Path]) -> dict[str, Path]:
    from tests.model_helpers import hf_config

    dirs = dict(builtin_dirs)
    for family in FAMILIES:  # the configs the model tests build, as transformers saves them
        dirs[family] = root / family
        hf_config(family).save_pretrained(str(dirs[family]))
    for name, raw in VARIANTS.items():
        dirs[name] = root / name
        dirs[name].mkdir()
        (dirs[name] / "config.json").write_text(json.dumps(raw))
    return dirs


def test_config_reader_matches_autoconfig(tmp_path, builtin_dirs):
    refused = []
    for name, model_dir in _config_dirs(tmp_path, builtin_dirs).items():
        ours = _translate(read_hf_config, model_dir)
        theirs = _translate(_through_transformers, model_dir)
        assert ours == theirs, name
        if ours[0] == "ModelError":
            refused.append(name)
            assert str(model_dir / "config.json") in ours[1], name
    assert refused == ["qwen2-default-kv-heads", "qwen2-sliding", "llama-partial-rotary", "llama-yarn", "llama-gelu", "gpt2", "gemma3-attn-softcap"]


@pytest.mark.parametrize("raw, message", [
    ('{"model_type": "llama", "hidden_size": "64"}', r"config.json: hidden_size must be an integer, got '64'"),
    ('{"model_type": "llama", "hidden_size": 66, "num_attention_heads": 4}', r"hidden_size=66 is not a multiple"),
    ('{"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}',
     r"rope_type 'llama3' needs low_freq_factor, high_freq_factor"),
    ('{"model_type": "llama",', r"config.json: cannot read it as JSON"),
    ('[1, 2]', r"config.json: not a JSON object"),
])
def test_config_reader_refuses_what_transformers_refuses(tmp_path, raw, message):
    (tmp_path / "config.json").write_text(raw)
    with pytest.raises(ModelError, match=message):
        read_hf_config(tmp_path)
    # transformers refuses each of these files too, with a different exception type for each
    with pytest.raises(Exception):  # noqa: B017
        _through_transformers(tmp_path)


def test_builtin_tokenizers_load_as_autotokenizer_loads_them(builtin_dirs):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "C:482 12+3"}]
    for name, model_dir in builtin_dirs.items():
        ours, theirs = load_tokenizer(model_dir, builtin=True), AutoTokenizer.from_pretrained(str(model_dir))
        assert type(ours) is type(theirs), name
        assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str(), name
        assert ours.init_kwargs == theirs.init_kwargs, name
        assert ours.all_special_ids == theirs.all_special_ids and ours.chat_template == theirs.chat_template, name
        assert (ours.eos_token_id, ours.pad_token_id) == (theirs.eos_token_id, theirs.pad_token_id), name
        prompt = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt, name
        ids = theirs(prompt)["input_ids"]
        assert ours(prompt)["input_ids"] == ids and ours.decode(ids) == theirs.decode(ids), name


def test_loading_a_builtin_model_imports_no_torch(builtin_dirs, tmp_path):
    """The start-up path of a run on a built-in model: the CLI and train modules, the model with
    its tokenizer, the TensorBoard sink. transformers' config classes (and tensorboardX) import
    torch whenever it is installed, which was most of a small run's start-up; flax imports
    IPython (where installed) only to ask whether a notebook is running."""
    run_python(f"""
        import sys
        from pathlib import Path
        import asyncrl.cli
        asyncrl.cli._import_flax_without_ipython()  # as `asyncrl train` does before its imports
        import asyncrl.run.loop
        from asyncrl.run.metrics import TensorBoardSink
        from asyncrl.model import load_model
        from asyncrl.model.hf import load_hf_directory
        for lm in (load_model("tiny"), load_hf_directory(Path({str(builtin_dirs["tiny-qwen3"])!r}), builtin=True)):
            assert lm.tokenizer.apply_chat_template([{{"role": "user", "content": "1"}}], tokenize=False)
        TensorBoardSink({str(tmp_path)!r}).close()
        heavy = sorted(m for m in ("torch", "transformers.configuration_utils", "IPython") if m in sys.modules)
        assert not heavy, heavy
        import torch  # still importable afterwards
    """)
