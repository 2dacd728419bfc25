"""Build (or find) the cached ``tiny`` reference model and print its directory.

Usage: ``PYTHONPATH=. python scripts/make_tiny_model.py [tiny[:options]] [--cache-dir DIR]``
e.g. ``tiny:hidden=128,layers=4``. Prints one JSON line: spec, path, vocab size, params.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", default="tiny", help="tiny or tiny:name=value,...")
    parser.add_argument("--cache-dir", default=None, help="default: $ASYNCRL_CACHE_DIR, else $XDG_CACHE_HOME/asyncrl, else ~/.cache/asyncrl")
    args = parser.parse_args()

    from asyncrl.model.tiny import ensure_tiny, parse_tiny_spec, tiny_decoder_config

    path = ensure_tiny(args.spec, cache_dir=args.cache_dir)
    cfg = tiny_decoder_config(parse_tiny_spec(args.spec))
    print(json.dumps({"spec": args.spec, "path": str(path), "vocab_size": cfg.vocab_size, "params": cfg.num_params()}))


if __name__ == "__main__":
    main()
