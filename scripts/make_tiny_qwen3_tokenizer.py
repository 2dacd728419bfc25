"""Train the tokenizer ``tiny-qwen3`` ships with (asyncrl/model/assets/tiny_qwen3_tokenizer.json).

    python scripts/make_tiny_qwen3_tokenizer.py --gsm8k-train path/to/gsm8k/train.jsonl [--check]

A byte-level BPE of 4,096 tokens (Qwen's special tokens first) trained with the ``tokenizers``
library on every string field of GSM8K's training split (7,473 questions and worked answers, the
original release's ``train.jsonl``; MIT licence, its notice shipped beside the tokenizer). The
training is deterministic: the same file gives the same bytes. ``--check`` compares instead of
writing and exits 1 when the shipped file differs. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def main(argv: list[str] | None = None) -> int:
    from asyncrl.model.tiny_qwen3 import SHIPPED_TOKENIZER, SHIPPED_VOCAB, train_bpe

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gsm8k-train", type=Path, required=True, help="GSM8K's train.jsonl (fields question, answer)")
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = parser.parse_args(argv)
    if not args.gsm8k_train.is_file():
        parser.error(f"--gsm8k-train {args.gsm8k_train}: no such file")
    with tempfile.TemporaryDirectory() as tmp:
        made = Path(tmp) / "tokenizer.json"
        train_bpe(SHIPPED_VOCAB, args.gsm8k_train).save(str(made))
        data = made.read_bytes()
    same = SHIPPED_TOKENIZER.is_file() and SHIPPED_TOKENIZER.read_bytes() == data
    if not args.check:
        SHIPPED_TOKENIZER.write_bytes(data)
    print(json.dumps({"path": str(SHIPPED_TOKENIZER.relative_to(REPO_ROOT)), "sha256": hashlib.sha256(data).hexdigest(),
                      "bytes": len(data), "same_as_shipped": same, "written": not args.check}))
    return 0 if same or not args.check else 1


if __name__ == "__main__":
    raise SystemExit(main())
