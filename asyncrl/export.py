"""``asyncrl export RUN_DIR OUT_DIR``: a run's saved policy as a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

from asyncrl.errors import AsyncRLError


class ExportError(AsyncRLError):
    """Nothing to export, or the target is unusable."""


def export_run(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Export the policy of ``run_dir``: its newest complete checkpoint (so a run that was
    stopped can still be exported), else its final ``hf/`` export, reloaded and re-written
    (so the output is checked to load)."""
    from asyncrl.checkpoint import latest_checkpoint, load_checkpoint
    from asyncrl.model import export_hf, load_model

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ExportError(f"{out_dir}: exists and is not empty; choose a new directory")
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:
        saved = load_checkpoint(checkpoint)
        # The architecture and tokenizer come from the run's own model spec; the weights
        # from the checkpoint, rebuilt into the model's exact tree structure.
        loaded = load_model(saved.config().model)
        graphdef, template = loaded.split()
        params = load_checkpoint(checkpoint, templates={"params": template}).arrays["params"]
    elif (run_dir / "hf" / "config.json").is_file():
        loaded = load_model(str(run_dir / "hf"))
        graphdef, params = loaded.split()
    else:
        raise ExportError(f"{run_dir}: holds no saved policy (no complete checkpoint, no hf/config.json)")
    export_hf(graphdef, loaded.tokenizer, out_dir, params=params)
    return out_dir
