"""What a run records about itself in ``run.output_dir``: the resolved config, the
command line, package versions, the git commit, the devices it ran on and what ran on each."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

PACKAGES = ("asyncrl", "jax", "jaxlib", "flax", "optax", "transformers", "safetensors", "tokenizers", "numpy", "pydantic", "torch")


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_sha(cwd: str | Path | None = None) -> str | None:
    """The commit of the asyncrl checkout (``+dirty`` with local changes), or None."""
    where = Path(cwd) if cwd else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=where, capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def device_info() -> list[dict]:
    import jax

    return [
        {"id": d.id, "platform": d.platform, "kind": getattr(d, "device_kind", ""), "process": d.process_index}
        for d in jax.devices()
    ]


def write_provenance(output_dir: str | Path, config_yaml: str, argv: list[str] | None = None) -> None:
    """Write ``config.yaml`` and ``provenance.json`` (each atomically) into ``output_dir``."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "command": list(argv if argv is not None else sys.argv),
        "cwd": os.getcwd(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git_sha": git_sha(),
        "packages": package_versions(),
        "devices": device_info(),
    }
    atomic_write_text(output_dir / "config.yaml", config_yaml)
    atomic_write_text(output_dir / "provenance.json", json.dumps(record, indent=2) + "\n")


def record_placement(output_dir: str | Path, placement: Any, mesh: Any, remote_servers: int = 0,
                     engine_devices: Optional[Sequence[Any]] = None) -> None:
    """Add to ``provenance.json`` which devices the trainer and the in-process engines run on, as the
    run resolved them (``placement``: a :class:`~asyncrl.cluster.placement.Placement`; ``mesh``: the
    trainer's mesh): device ids of ``devices``, the trainer mesh's shape and the engine's replicas.
    ``engine_devices``: every process's engine devices in a multi-process run (each process has an
    engine of its own; default: this process's). With ``remote_servers`` the engine is that many
    servers and holds no device here. ``scripts/plot_placement.py`` draws it."""
    path = Path(output_dir) / "provenance.json"
    record = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    every_engine = placement.engine_devices if engine_devices is None else engine_devices
    engine = [] if remote_servers else [d.id for d in every_engine]
    record["placement"] = {
        "trainer": [d.id for d in placement.trainer_devices],
        "trainer_mesh": {str(axis): int(size) for axis, size in mesh.shape.items()},
        "engine": engine,
        "engine_tensor_parallel": placement.tensor_parallel,
        "engine_replicas": placement.engine_replicas if engine else 0,
        "engine_remote_servers": remote_servers,
        "shares_trainer_arrays": bool(placement.shares_trainer_arrays),
    }
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (disk full) leaves the old file and no stray temporary
        raise
