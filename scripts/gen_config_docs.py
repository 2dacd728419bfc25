"""Regenerate docs/config.md from the pydantic config models.

Usage: python scripts/gen_config_docs.py [--check]
With --check, exit 1 (and write nothing) when docs/config.md is out of date.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config.docs import config_reference_markdown  # noqa: E402

TARGET = ROOT / "docs" / "config.md"


def main(argv: list[str]) -> int:
    text = config_reference_markdown()
    if "--check" in argv:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET.relative_to(ROOT)} is out of date: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    tmp = TARGET.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(TARGET)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
