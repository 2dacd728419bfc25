"""``asyncrl export RUN_DIR OUT_DIR``: a run's saved policy as a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.errors import AsyncRLError


class ExportError(AsyncRLError):
    """Nothing to export, or the target is unusable."""


def export_run(run_dir: str | Path, out_dir: str | Path, *, merged: bool = False) -> Path:
    """Export the policy of ``run_dir``: its newest complete checkpoint (so a run that was
    stopped can still be exported), else its final ``hf/`` export, reloaded and re-written
    (so the output is checked to load).

    A LoRA run (``model.lora``) exports a PEFT adapter directory, or with ``merged`` the base
    model with the adapters merged in as a Hugging Face directory (:func:`export_lora_run`)."""
    from asyncrl.checkpoint import latest_checkpoint, load_checkpoint
    from asyncrl.model import export_hf, load_model

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ExportError(f"{out_dir}: exists and is not empty; choose a new directory")
    checkpoint = latest_checkpoint(run_dir)
    saved = load_checkpoint(checkpoint) if checkpoint is not None else None
    if saved is not None and saved.config().model.lora is not None:
        return export_lora_run(saved, out_dir, merged=merged)
    if checkpoint is None and (run_dir / "adapter" / "adapter_config.json").is_file() and not merged:
        raise ExportError(f"{run_dir}: a LoRA run without a complete checkpoint; its adapter is in {run_dir / 'adapter'} "
                          "(or export the merged model with --merged)")
    if saved is not None:
        # The architecture and tokenizer come from the run's own model spec; the weights
        # from the checkpoint, filled into the model's own tree.
        loaded = load_model(saved.config().model)
        graphdef, template = loaded.split()
        params = saved.tree("params", template)
    elif (run_dir / "hf" / "config.json").is_file():
        loaded = load_model(str(run_dir / "hf"))
        graphdef, params = loaded.split()
    else:
        raise ExportError(f"{run_dir}: holds no saved policy (no complete checkpoint, no hf/config.json)")
    export_hf(graphdef, loaded.tokenizer, out_dir, params=params)
    return out_dir


def export_lora_run(saved: Any, out_dir: Path, *, merged: bool) -> Path:
    """A LoRA checkpoint's (:class:`~asyncrl.checkpoint.Checkpoint`) adapters as a PEFT adapter directory, or (``merged``) merged into the
    base model as a Hugging Face directory; refused when ``model.path`` no longer holds the base
    the adapters were trained on (both content hashes named)."""
    from asyncrl.model import export_hf, load_model
    from asyncrl.model.lora import LoraSpec, attach_lora, base_identity, check_same_base, export_peft_adapter, merge_lora

    checkpoint = saved.path
    cfg = saved.config()
    loaded = load_model(cfg.model)
    graphdef, base = loaded.split()
    check_same_base(saved.state.get("lora"), base_identity(loaded.path, base), str(checkpoint))
    spec = LoraSpec.from_config(cfg.model.lora)
    template = attach_lora(loaded.config, base, spec).adapters
    adapters = saved.tree("params", template)  # a CheckpointError naming every key that does not fit
    if not merged:
        return export_peft_adapter(adapters, spec, out_dir, base_model=str(loaded.path), overwrite=out_dir.exists())
    export_hf(graphdef, loaded.tokenizer, out_dir, params=merge_lora(base, adapters, spec.scale), overwrite=out_dir.exists())
    return out_dir
