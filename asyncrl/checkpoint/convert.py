"""Convert a run's format-2 checkpoints (one safetensors file per array tree, written by
process 0) to the current layout (Orbax, :data:`~asyncrl.checkpoint.layout.CHECKPOINT_FORMAT`),
so that a run started before the change resumes::

    python -m asyncrl.checkpoint.convert RUN_DIR

Every file of an old checkpoint is checked against its manifest (size and sha256) before it is
read; the converted checkpoint replaces the old directory atomically (the old one stays until
the new one is complete). Checkpoints already in the current format are left alone; format 1
cannot be converted. Runs in one process (on CPU): a checkpoint of any size passes through this
host once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import asyncrl.checkpoint.files as checkpoint_files
import asyncrl.checkpoint.layout as layout
import asyncrl.checkpoint.store as store
from asyncrl.errors import CheckpointError

OLD_FORMAT = 2


def convert_checkpoint(path: Path) -> Path:
    """Rewrite the format-2 checkpoint ``path`` (``<run>/checkpoints/step_<k>``) in the current format."""
    manifest = json.loads((path / layout.MANIFEST_FILE).read_text(encoding="utf-8"))
    if manifest.get("format") != OLD_FORMAT:
        raise CheckpointError(f"checkpoint {path}: MANIFEST.json: field format: {manifest.get('format')!r}, "
                              f"only format {OLD_FORMAT} converts")
    for filename, entry in manifest["files"].items():
        problem = layout._file_problem(path / filename, filename, entry)
        if problem:
            raise CheckpointError(f"checkpoint {path}: {problem}; not converted")
    from asyncrl.checkpoint.arrays import _nest

    arrays = {}
    for tree in manifest["trees"]:
        where = f"{path / tree}.safetensors"
        flat = checkpoint_files.decode_safetensors((path / f"{tree}.safetensors").read_bytes(), where)
        arrays[tree] = _nest(flat)  # keys "a/0/b" -> nested dicts: the same keys once flattened again
    state = json.loads((path / layout.STATE_FILE).read_text(encoding="utf-8"))
    config_yaml = (path / layout.CONFIG_FILE).read_text(encoding="utf-8")
    rollout_state = checkpoint_files.load_rollout_state(path) if manifest.get("rollout") else None
    return store.save_checkpoint(path.parent.parent, int(manifest["step"]), arrays=arrays, state=state,
                                 config_yaml=config_yaml, rollout_state=rollout_state)


def convert_run(out_dir: str | Path) -> list[Path]:
    """Convert every format-2 checkpoint under ``<out_dir>/checkpoints``; returns those converted."""
    converted = []
    for _, path in layout._step_dirs(layout.checkpoints_root(out_dir)):
        try:
            found = json.loads((path / layout.MANIFEST_FILE).read_text(encoding="utf-8")).get("format")
        except (OSError, ValueError):
            continue  # incomplete: skipped on resume like any other
        if found == OLD_FORMAT:
            converted.append(convert_checkpoint(path))
    return converted


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.checkpoint.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run's output directory (run.output_dir), which holds checkpoints/")
    args = parser.parse_args(argv)
    try:
        converted = convert_run(args.run_dir)
    except CheckpointError as err:
        print(f"asyncrl: {err}", file=sys.stderr)
        return 1
    for path in converted:
        print(f"converted {path} to checkpoint format {layout.CHECKPOINT_FORMAT}")
    if not converted:
        print(f"no format-{OLD_FORMAT} checkpoint in {layout.checkpoints_root(args.run_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
