"""``asyncrl export RUN_DIR OUT_DIR``: a run's saved policy as a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

from asyncrl.errors import AsyncRLError


class ExportError(AsyncRLError):
    """Nothing to export, or the target is unusable."""


def export_run(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Export the policy of ``run_dir``: its final ``hf/`` export, reloaded and re-written
    (so the output is checked to load) into ``out_dir``."""
    from asyncrl.model import export_hf, load_model

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    source = run_dir / "hf"
    if not (source / "config.json").is_file():
        raise ExportError(f"{run_dir}: holds no saved policy (no hf/config.json); was the run completed?")
    if out_dir.resolve() == source.resolve():
        raise ExportError(f"{out_dir}: is the run's own export; choose another directory")
    loaded = load_model(str(source))
    graphdef, params = loaded.split()
    export_hf(graphdef, loaded.tokenizer, out_dir, params=params)
    return out_dir
