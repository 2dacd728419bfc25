"""Built-in ``tiny-qwen3``: a small random-init Qwen3-shaped model with a real subword tokenizer.

For smoke runs of real-task recipes on a CPU (``configs/gsm8k_grpo.yaml`` with
``model.path: tiny-qwen3``): prompts and completions have the task's real token lengths,
and the model has Qwen3's layout (q/k RMSNorm, no attention biases, an explicit
``head_dim`` larger than ``hidden / heads`` as in Qwen3-0.6B, tied embeddings,
``model_type: qwen3``), so the recipe exercises the same code paths as the real model.

The tokenizer is a byte-level BPE (Qwen's kind) of 4,096 tokens with Qwen's special tokens
(``<|endoftext|>`` pad, ``<|im_start|>``, ``<|im_end|>`` EOS) and a ChatML chat template. It ships
with the package (``assets/tiny_qwen3_tokenizer.json``: trained with the ``tokenizers`` library on
the questions and answers of GSM8K's training split, MIT-licensed, its notice in
``assets/GSM8K-LICENSE``; ``scripts/make_tiny_qwen3_tokenizer.py`` trains it again), so the model
needs nothing outside the package. ``tiny-qwen3:corpus=/data/my.jsonl`` (or
``$ASYNCRL_TINY_QWEN3_CORPUS``) trains one on other text at build time instead, with ``vocab``
tokens: a JSONL corpus contributes every string field of every record; any other file, its lines.

Like ``tiny`` it is built once into ``<cache>/tiny-qwen3-<hash>`` (the hash covers the
spec, the tokenizer's source bytes and the recipe), atomically. Options:
``tiny-qwen3:layers=4``, ``tiny-qwen3:vocab=2048,corpus=/data/my.jsonl``; ``tiny-qwen3:experts=4``
is the same model as a Qwen3-MoE (4 experts, top-2, of width ``moe_intermediate``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator, Optional

from asyncrl.errors import ModelError
from asyncrl.model.config import DecoderConfig
from asyncrl.model.tiny import build_cached, parse_spec_options

PREFIX = "tiny-qwen3"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
CHATML_TEMPLATE = (
    # ChatML, and Qwen2.5/Qwen3's tool use: tools listed in a system turn, the model's calls as
    # <tool_call>{"name": ..., "arguments": {...}}</tool_call>, tool results as <tool_response>
    # blocks of a user turn. Messages without tools render as plain ChatML.
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first and tools -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if message['content'] -%}{{- '\\n' + message['content'] -}}{%- endif -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- if call['function'] is defined -%}{%- set call = call['function'] -%}{%- endif -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' -}}"
    "{%- if call['arguments'] is string -%}{{- call['arguments'] -}}{%- else -%}{{- call['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
SHIPPED_TOKENIZER = Path(__file__).resolve().parent / "assets" / "tiny_qwen3_tokenizer.json"
"""The tokenizer ``tiny-qwen3`` uses unless given a corpus: 4,096 BPE tokens trained on GSM8K's
training split (``scripts/make_tiny_qwen3_tokenizer.py``)."""
SHIPPED_VOCAB = 4096
CORPUS_ENV = "ASYNCRL_TINY_QWEN3_CORPUS"
_BUILD_FORMAT = 2  # bump when the recipe changes, so old cache entries are not reused


@dataclasses.dataclass(frozen=True)
class TinyQwen3Spec:
    """Fields settable as ``tiny-qwen3:name=value,...``."""

    vocab: int = 4096
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 192
    seed: int = 0
    max_positions: int = 2048
    corpus: str = ""
    """Tokenizer training text; empty: ``$ASYNCRL_TINY_QWEN3_CORPUS``, else the shipped tokenizer
    (:data:`SHIPPED_TOKENIZER`, ``vocab`` 4096)."""
    experts: int = 0
    """0: dense Qwen3; > 0: a Qwen3-MoE (``model_type: qwen3_moe``) with this many experts in every layer."""
    experts_per_tok: int = 2
    moe_intermediate: int = 64


_MOE_FIELDS = ("experts", "experts_per_tok", "moe_intermediate")


def chatml_char_tokenizer() -> Any:
    """A character-level tokenizer (printable ASCII plus ``<|endoftext|>``, ``<|im_start|>``,
    ``<|im_end|>`` = 0, 1, 2) with Qwen's chat template, built in a second: for agents on a
    scripted engine (docs/examples/calculator_agent.py, ``scripts/bench.py agent``)."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML_TEMPLATE
    return hf


def is_tiny_qwen3(text: str) -> bool:
    return text == PREFIX or text.startswith(PREFIX + ":")


def parse_spec(text: str) -> TinyQwen3Spec:
    """``tiny-qwen3`` or ``tiny-qwen3:vocab=2048,layers=4`` -> spec; bad options are a ModelError."""
    if not is_tiny_qwen3(text):
        raise ModelError(f"model.path {text!r}: not a {PREFIX} spec")
    spec = TinyQwen3Spec(**parse_spec_options(text, PREFIX, TinyQwen3Spec))
    if spec.heads % spec.kv_heads or spec.head_dim % 2 or min(spec.vocab, spec.hidden, spec.layers) < 1:
        raise ModelError(f"model.path {text!r}: heads must be a multiple of kv_heads, head_dim even, sizes positive")
    if spec.vocab < 256 + len(SPECIAL_TOKENS):
        raise ModelError(f"model.path {text!r}: vocab must be at least {256 + len(SPECIAL_TOKENS)} (the 256 byte tokens + specials)")
    return spec


def corpus_path(spec: TinyQwen3Spec) -> Optional[Path]:
    """The text to train the tokenizer on (``corpus=``, else ``$ASYNCRL_TINY_QWEN3_CORPUS``), or None:
    the shipped tokenizer, which has :data:`SHIPPED_VOCAB` tokens."""
    given = spec.corpus or os.environ.get(CORPUS_ENV)
    if not given:
        if spec.vocab != SHIPPED_VOCAB:
            raise ModelError(f"model.path {PREFIX}:vocab={spec.vocab}: the shipped tokenizer has {SHIPPED_VOCAB} tokens; "
                             f"another size is trained at build time: add corpus=/path/to/text (a JSONL file or plain text)")
        return None
    path = Path(given).expanduser()
    if not path.is_file():
        origin = "corpus=" if spec.corpus else CORPUS_ENV
        raise ModelError(
            f"model.path {PREFIX}: tokenizer corpus {path} not found (from {origin}); give a JSONL file or plain "
            f"text, or leave both unset for the shipped tokenizer"
        )
    return path


def tokenizer_for(spec: TinyQwen3Spec) -> Any:
    """The model's tokenizer: trained on the spec's corpus (a few seconds), else the shipped one."""
    corpus = corpus_path(spec)
    return build_tokenizer(spec, corpus) if corpus is not None else shipped_tokenizer(spec)


def corpus_texts(path: Path) -> Iterator[str]:
    """Training texts of the tokenizer: every string field of a JSONL record, else each line."""
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ModelError(f"{path}:{number}: not valid JSON ({err.msg}); the {PREFIX} tokenizer corpus") from None
                yield from (v for v in (record.values() if isinstance(record, dict) else [record]) if isinstance(v, str))
            else:
                yield line


def train_bpe(vocab: int, path: Path) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab`` tokens trained on ``path`` (a few seconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text encodes
    )
    tok.train_from_iterator(corpus_texts(path), trainer)
    return tok


def build_tokenizer(spec: TinyQwen3Spec, path: Path) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``path`` (a few seconds)."""
    return _with_chat_template(train_bpe(spec.vocab, path), spec)


def shipped_tokenizer(spec: TinyQwen3Spec) -> Any:
    """The shipped BPE (:data:`SHIPPED_TOKENIZER`) as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer

    return _with_chat_template(Tokenizer.from_file(str(SHIPPED_TOKENIZER)), spec)


def _with_chat_template(tok: Any, spec: TinyQwen3Spec) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=ENDOFTEXT,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=spec.max_positions,
    )


def decoder_config(spec: TinyQwen3Spec, tokenizer: Any) -> DecoderConfig:
    moe: dict[str, Any] = {}
    if spec.experts:  # the same layout with a sparse MoE block in every layer (asyncrl/model/moe.py)
        moe = dict(model_type="qwen3_moe", num_experts=spec.experts, num_experts_per_tok=spec.experts_per_tok,
                   moe_intermediate_size=spec.moe_intermediate, norm_topk_prob=True)
    return DecoderConfig(
        model_type="qwen3",
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_layers=spec.layers,
        num_heads=spec.heads,
        num_kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,  # Qwen3's
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        qk_norm=True,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
    ).replace(**moe)


def dir_name(spec: TinyQwen3Spec, corpus: Optional[Path]) -> str:
    import flax
    import jax

    source = {"corpus": hashlib.sha256(corpus.read_bytes()).hexdigest()} if corpus is not None else {
        "tokenizer": hashlib.sha256(SHIPPED_TOKENIZER.read_bytes()).hexdigest()}
    fields = {k: v for k, v in dataclasses.asdict(spec).items() if spec.experts or k not in _MOE_FIELDS}  # dense: keys as before
    key = json.dumps(
        {"spec": fields | source, "template": CHATML_TEMPLATE, "special": SPECIAL_TOKENS,
         "format": _BUILD_FORMAT, "jax": jax.__version__, "flax": flax.__version__},
        sort_keys=True,
    )
    return f"{PREFIX}-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def ensure_tiny_qwen3(path: str = PREFIX, cache_dir: Optional[str | Path] = None) -> Path:
    """The directory of the model ``path`` names, building it (tokenizer and weights) if absent."""
    from asyncrl.model.hf import export_hf
    from asyncrl.model.transformer import init_decoder

    spec = parse_spec(path)
    corpus = corpus_path(spec)

    def build(target: Path) -> None:
        tokenizer = build_tokenizer(spec, corpus) if corpus is not None else shipped_tokenizer(spec)
        model = init_decoder(decoder_config(spec, tokenizer), seed=spec.seed)
        export_hf(model, tokenizer, target, exist_ok=True)

    return build_cached(cache_dir, dir_name(spec, corpus), build)
