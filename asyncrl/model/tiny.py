"""Built-in reference models: ``tiny`` (on disk, cached) and ``bench-40m`` (in memory).

``tiny`` is a random-init, seeded Qwen2-style model (hidden 64, 2 layers, 4 heads /
2 KV heads, intermediate 128, tied embeddings, attention biases; saved as
``model_type: llama`` with ``attention_bias: true``, see :func:`tiny_decoder_config`) with a character-level tokenizer over
:data:`TINY_ALPHABET` plus special tokens, built with the ``tokenizers`` library and
saved as a ``PreTrainedTokenizerFast`` that ``transformers.AutoTokenizer`` loads, with a
chat template. It is written as an ordinary HF directory (``export_hf``) into
``<cache>/tiny-<hash of spec>``: built in a temporary directory and renamed into
place, so parallel builders race safely (the loser discards its copy).

``model.path: tiny`` uses the defaults; ``tiny:hidden=128,layers=4`` overrides fields
of :class:`TinySpec`; ``tiny:family=gemma3`` is the same sizes in Gemma 3's layout
(:func:`as_gemma3`), for quickstart-sized runs of that family. The cache is ``$ASYNCRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/asyncrl``, else ``~/.cache/asyncrl``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from asyncrl.errors import ModelError
from asyncrl.model.config import DecoderConfig

TINY_ALPHABET = "0123456789 +-=:ACDMRS\n"
"""Characters of the synthetic tasks (digits, space, ``+ - = :``, task-tag letters, newline)."""

PAD, UNK, SYSTEM, USER, ASSISTANT, END = "<pad>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
TINY_SPECIAL_TOKENS = (PAD, UNK, SYSTEM, USER, ASSISTANT, END)

TINY_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('tiny chat template: unknown role ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)

_BUILD_LOCK = threading.Lock()  # builders in one process wait for each other (and for transformers' lazy imports)
_BUILD_FORMAT = 2  # bump when the build recipe changes, so old cache entries are not reused


@dataclasses.dataclass(frozen=True)
class TinySpec:
    """Fields settable as ``tiny:name=value,...``."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    tied: bool = True
    seed: int = 0
    max_positions: int = 1024
    family: str = "llama"
    """``llama`` (the layout below) or ``gemma3`` (:func:`as_gemma3`)."""


TINY_FAMILIES = ("llama", "gemma3")


def is_tiny(text: str) -> bool:
    """True for ``tiny`` and ``tiny:options`` (not ``tiny-qwen3``)."""
    return text == "tiny" or text.startswith("tiny:")


def parse_spec_options(text: str, prefix: str, spec_type: type) -> dict[str, Any]:
    """The ``name=value`` options of ``prefix:name=value,...`` as the fields of the dataclass
    ``spec_type`` (int, bool or str); a bad option is a ModelError naming ``model.path``."""
    name, _, options = text.partition(":")
    if name != prefix:
        raise ModelError(f"model.path {text!r}: not a {prefix} spec")
    kinds = {f.name: f.type for f in dataclasses.fields(spec_type)}
    values: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in options.split(","))):
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or key not in kinds:
            raise ModelError(f"model.path {text!r}: bad option {item!r}; options are name=value with name in {', '.join(kinds)}")
        kind = kinds[key]
        if kind in (str, "str"):
            values[key] = raw
        elif kind in (bool, "bool"):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ModelError(f"model.path {text!r}: option {key} needs true/false, got {raw!r}")
            values[key] = raw.lower() in ("true", "1")
        else:
            try:
                values[key] = int(raw)
            except ValueError:
                raise ModelError(f"model.path {text!r}: option {key} needs an integer, got {raw!r}") from None
    return values


def parse_tiny_spec(text: str) -> TinySpec:
    """``tiny`` or ``tiny:hidden=128,layers=4`` -> TinySpec; bad options are a ModelError."""
    spec = TinySpec(**parse_spec_options(text, "tiny", TinySpec))
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads or (spec.hidden // spec.heads) % 2:
        raise ModelError(f"model.path {text!r}: hidden must split into an even head_dim over heads, heads must be a multiple of kv_heads")
    if spec.family not in TINY_FAMILIES:
        raise ModelError(f"model.path {text!r}: family must be one of {', '.join(TINY_FAMILIES)}, got {spec.family!r}")
    return spec


def tiny_vocab() -> dict[str, int]:
    chars = list(TINY_ALPHABET)
    return {tok: i for i, tok in enumerate([*TINY_SPECIAL_TOKENS, *chars])}


def build_tiny_tokenizer() -> Any:
    """The character-level ``PreTrainedTokenizerFast`` of the tiny model."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=tiny_vocab(), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    tok.decoder = decoders.Fuse()  # join characters without separators
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        pad_token=PAD,
        eos_token=END,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT],
        chat_template=TINY_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    return fast


def tiny_decoder_config(spec: TinySpec) -> DecoderConfig:
    vocab = tiny_vocab()
    cfg = DecoderConfig(
        # Llama architecture with q/k/v/o biases: Qwen2's layout (plus an o_proj bias).
        # Not model_type qwen2, because transformers 5's AutoTokenizer forces its byte-level
        # Qwen2Tokenizer on every qwen2 directory, which mangles a character tokenizer.
        model_type="llama",
        vocab_size=len(vocab),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_layers=spec.layers,
        num_heads=spec.heads,
        num_kv_heads=spec.kv_heads,
        head_dim=spec.hidden // spec.heads,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=spec.tied,
        qkv_bias=True,
        o_bias=True,
        eos_token_id=vocab[END],
        pad_token_id=vocab[PAD],
    )
    return as_gemma3(cfg) if spec.family == "gemma3" else cfg


TINY_GEMMA3_WINDOW = 8
"""The tiny Gemma 3's sliding window: shorter than the quickstart's prompts plus completions (up to 24 tokens)."""


def as_gemma3(cfg: DecoderConfig) -> DecoderConfig:
    """``cfg``'s sizes in Gemma 3's layout (asyncrl.model.gemma3): no biases, q/k norms, ``(1 + w)`` and
    sandwich norms, GeGLU, scaled embeddings, and sliding layers with every second layer global
    (Gemma 3's pattern is every sixth), with Gemma 3's rope bases."""
    layer_types = tuple("full_attention" if (i + 1) % 2 == 0 else "sliding_attention" for i in range(cfg.num_layers))
    return cfg.replace(
        model_type="gemma3_text", qkv_bias=False, o_bias=False, qk_norm=True, hidden_act="gelu_pytorch_tanh",
        norm_plus_one=True, sandwich_norms=True, scale_embeddings=True, query_pre_attn_scalar=float(cfg.head_dim),
        sliding_window=TINY_GEMMA3_WINDOW, layer_types=layer_types, rope_theta=1_000_000.0, rope_local_theta=10_000.0,
    )


def bench_40m_config(**runtime: Any) -> DecoderConfig:
    """docs/design.md "Reference models": ``bench-40m``: hidden 512, 8 layers, 8/4 heads, intermediate 1536, vocab 32000, tied (41.6M)."""
    return DecoderConfig(
        model_type="qwen2",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qkv_bias=True,
        **runtime,
    )


def default_cache_dir(env: Optional[Mapping[str, str]] = None) -> Path:
    """asyncrl's cache root: ``$ASYNCRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/asyncrl``, else ``~/.cache/asyncrl``."""
    env = os.environ if env is None else env
    if env.get("ASYNCRL_CACHE_DIR"):
        return Path(env["ASYNCRL_CACHE_DIR"])
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "asyncrl"
    return Path.home() / ".cache" / "asyncrl"


def tiny_dir_name(spec: TinySpec) -> str:
    import flax
    import jax

    key = json.dumps(
        {"spec": dataclasses.asdict(spec), "config": dataclasses.asdict(tiny_decoder_config(spec)),
         "alphabet": TINY_ALPHABET, "special": TINY_SPECIAL_TOKENS, "template": TINY_CHAT_TEMPLATE,
         "format": _BUILD_FORMAT, "jax": jax.__version__, "flax": flax.__version__},
        sort_keys=True,
    )
    return "tiny-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def ensure_tiny(path: str = "tiny", cache_dir: Optional[str | Path] = None) -> Path:
    """The directory of the tiny model ``path`` names, building it first if absent."""
    from asyncrl.model.hf import export_hf
    from asyncrl.model.transformer import init_decoder

    spec = parse_tiny_spec(path)

    def build(target: Path) -> None:
        model = init_decoder(tiny_decoder_config(spec), seed=spec.seed)
        export_hf(model, build_tiny_tokenizer(), target, exist_ok=True)

    return build_cached(cache_dir, tiny_dir_name(spec), build)


def build_cached(cache_dir: Optional[str | Path], name: str, build: Callable[[Path], None]) -> Path:
    """``<cache>/<name>``, made by ``build(target)`` first if it holds no ``config.json``.

    ``build`` must write through ``export_hf(..., exist_ok=True)``: other processes may build
    the same name at once, and export_hf assembles a temporary directory and renames it into
    place (whoever renames second keeps the winner's). Builders in one process take turns.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / name
    if (target / "config.json").is_file():
        return target
    with _BUILD_LOCK:
        if not (target / "config.json").is_file():
            root.mkdir(parents=True, exist_ok=True)
            build(target)
    return target
