"""Write the item catalog of the next-item task (workflows/recommend.py) as a constraint file:
one line of token ids per item (its 3 characters, then the model's end token).

    python scripts/make_item_trie.py --out runs/recommend/items.txt [--items 16] [--seed 0] [--model tiny]

Prints one JSON line: the file, the item count and the trie's size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the constraint file to write")
    parser.add_argument("--items", type=int, default=16, help="catalog size (the dataset's items)")
    parser.add_argument("--seed", type=int, default=0, help="catalog seed (the dataset's seed)")
    parser.add_argument("--model", default="tiny", help="model.path whose tokenizer encodes the items")
    args = parser.parse_args(argv)

    from asyncrl.engine.constraints import TokenTrie
    from asyncrl.model import load_model
    from workflows.recommend import trie_lines

    loaded = load_model(args.model, with_tokenizer=True)
    if not loaded.stop_token_ids:
        raise SystemExit(f"make_item_trie: model {args.model} has no end token (generation_config eos_token_id)")
    lines = trie_lines(loaded.tokenizer, loaded.stop_token_ids[0], args.items, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    made_for = f"next-item catalog of {args.items} items, seed {args.seed}, model {args.model}"
    tmp.write_text(f"# {made_for}: each item's token ids, then the end token\n" + "\n".join(lines) + "\n")
    tmp.replace(out)  # no half-written file
    trie = TokenTrie.from_file(out)
    print(json.dumps({"file": str(out), "items": trie.num_sequences, "nodes": trie.num_nodes, "max_depth": trie.max_depth}))


if __name__ == "__main__":
    main()
