"""Write a random-init model with Qwen2.5-0.5B's exact configuration and an offline tokenizer.

    PYTHONPATH=. python scripts/make_qwen_shaped.py --out runs/qwen-shaped/model

The model is ``configs/models/qwen2.5-0.5b/config.json`` (Qwen2.5-0.5B's own: 24 layers, hidden
896, 14 query and 2 KV heads, intermediate 4864, vocabulary 151,936, tied embeddings, rope theta
1e6; 494,032,768 parameters) built at random by transformers and written by ``save_pretrained``
in ``--dtype`` (bfloat16, as Qwen ships it: about 1 GB). Nothing is downloaded.

The tokenizer is the project's offline one (:func:`asyncrl.model.tiny_qwen3.tokenizer_for`: the
byte-level BPE of 4,096 tokens ``tiny-qwen3`` ships, trained on GSM8K's training split, with Qwen's
special tokens and its ChatML chat template; with ``--corpus``, one of ``--tokenizer-vocab`` tokens
trained on that text): fewer tokens than the embedding's 151,936 rows, as Qwen's own tokenizer
(151,665 tokens) has fewer. ``eos``/``pad``/``bos`` ids in ``config.json`` and
``generation_config.json`` are this tokenizer's (``<|im_end|>``, ``<|endoftext|>``), the only
change to Qwen's configuration. Prints one JSON line: path, parameters, vocab sizes, seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

QWEN2_5_0_5B = REPO_ROOT / "configs" / "models" / "qwen2.5-0.5b"
QWEN2_5_0_5B_PARAMS = 494_032_768


def write_qwen_shaped(out: Path, *, seed: int = 0, dtype: str = "bfloat16", tokenizer_vocab: int = 4096,
                      corpus: str = "") -> dict[str, Any]:
    """Write the model and tokenizer into ``out`` (created; must not exist or be empty); returns a summary."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.errors import ModelError
    from asyncrl.model.tiny_qwen3 import ENDOFTEXT, IM_END, TinyQwen3Spec, tokenizer_for

    if out.exists() and any(out.iterdir()):
        raise ModelError(f"--out {out}: exists and is not empty; give a new directory")
    start = time.perf_counter()
    spec = TinyQwen3Spec(vocab=tokenizer_vocab, corpus=corpus, max_positions=32768)
    tokenizer = tokenizer_for(spec)
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)

    cfg = AutoConfig.from_pretrained(QWEN2_5_0_5B)
    cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id = eos, pad, pad
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    params = sum(p.numel() for p in model.parameters())
    if params != QWEN2_5_0_5B_PARAMS:
        raise ModelError(f"{QWEN2_5_0_5B}/config.json: built {params:,} parameters, Qwen2.5-0.5B has {QWEN2_5_0_5B_PARAMS:,}")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, pad
    model.generation_config.bos_token_id = pad
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"path": str(out), "params": params, "vocab_size": cfg.vocab_size, "tokenizer_tokens": len(tokenizer),
            "dtype": dtype, "eos_token_id": eos, "pad_token_id": pad, "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write (new or empty)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the random weights")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="dtype of the written weights")
    parser.add_argument("--tokenizer-vocab", type=int, default=4096,
                        help="BPE tokens of the tokenizer (at most 151,936; other than 4096 only with --corpus)")
    parser.add_argument("--corpus", default="", help="tokenizer training text (default: the shipped tokenizer, trained "
                        "on GSM8K's training split)")
    args = parser.parse_args(argv)
    if not 259 <= args.tokenizer_vocab <= 151_936:
        parser.error("--tokenizer-vocab: between 259 (bytes + specials) and 151936 (the embedding's rows)")
    summary = write_qwen_shaped(args.out, seed=args.seed, dtype=args.dtype, tokenizer_vocab=args.tokenizer_vocab,
                                corpus=args.corpus)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
