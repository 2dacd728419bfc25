"""Draw where runs put their trainer and engine: each host's devices, by the role the run gave them.

    python scripts/plot_placement.py RUN_DIR [RUN_DIR ...] [-o placement.png]
    python scripts/plot_placement.py --make-runs runs/placement -o docs/placement.png

Reads each run's ``provenance.json``: its devices (id, process) and the placement the run
resolved (``asyncrl/run/provenance.py record_placement``: the trainer's devices and mesh, the
engine's devices, replicas and tensor-parallel degree). One panel per run, one box per process
(a host), one square per device. ``--make-runs DIR`` first trains one step of the quickstart's RL
stage in each layout of ``LAYOUTS`` into ``DIR/<layout>`` (forced CPU devices; the two-host
layout as two processes on this machine, started by ``asyncrl launch``), then draws those runs.
Prints one JSON line: the image and, per run, the devices of each role per process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlib import REPO_ROOT, child_env, run_train, train_argv  # noqa: E402

ONE_STEP = ["stages=[]", "run.total_steps=1", "eval.every_steps=0", "checkpoint.every_steps=0",
            "logging.dump_every_steps=0", "run.overwrite=true"]
"""One RL step of the quickstart: enough for a run to resolve and record its placement."""

LAYOUTS: dict[str, dict[str, Any]] = {
    "one host, colocated (the default)": {"name": "colocated", "processes": 1, "devices": 8, "overrides": []},
    "one host, split": {"name": "split", "processes": 1, "devices": 8,
                        "overrides": ["placement.trainer=0:4", "placement.engine=4:8", "mesh.fsdp=2",
                                      "engine.tensor_parallel=2"]},
    "two hosts": {"name": "two_hosts", "processes": 2, "devices": 4, "overrides": []},
}
"""The layouts ``--make-runs`` trains, by the title of their panel: processes (hosts), devices per
process and the config overrides that differ from the quickstart."""

COLORS = {"trainer": "#4C72B0", "engine": "#DD8452", "unused": "#DDDDDD"}


def make_runs(out: Path) -> list[tuple[str, Path]]:
    """One short run per layout of :data:`LAYOUTS` into ``out/<name>``; ``(title, run directory)`` each."""
    runs = []
    for title, layout in LAYOUTS.items():
        run_dir = (out / layout["name"]).resolve()
        argv = train_argv(REPO_ROOT / "configs" / "quickstart.yaml",
                          [*layout["overrides"], *ONE_STEP, f"run.output_dir={run_dir}"])
        if layout["processes"] > 1:
            argv = ["launch", "--nproc", str(layout["processes"]), "--cpu-devices", str(layout["devices"]), "--", *argv]
            env = child_env(JAX_PLATFORMS="cpu")
        else:
            env = child_env(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={layout['devices']}")
        run_train(argv, env, timeout=1800)
        runs.append((title, run_dir))
    return runs


def roles(run_dir: Path) -> dict[str, Any]:
    """What ``run_dir``'s provenance says ran where: ``hosts`` (process -> its devices, each
    ``(id, role names)``), the trainer mesh, the engine's replicas and degree."""
    path = run_dir / "provenance.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"plot_placement: {path}: {err}") from None
    placement = record.get("placement")
    if placement is None:
        raise SystemExit(f"plot_placement: {path} records no placement (written by an asyncrl without it); run again")
    trainer, engine = set(placement["trainer"]), set(placement["engine"])
    hosts: dict[int, list[tuple[int, list[str]]]] = {}
    for device in sorted(record["devices"], key=lambda d: (d["process"], d["id"])):
        names = [role for role, ids in (("trainer", trainer), ("engine", engine)) if device["id"] in ids]
        hosts.setdefault(device["process"], []).append((device["id"], names))
    return {"hosts": hosts, **{k: v for k, v in placement.items() if k not in ("trainer", "engine")},
            "engine_devices": placement["engine"]}


def describe(layout: dict[str, Any]) -> str:
    """One line under a panel: the trainer's mesh and the engine's replicas."""
    mesh = " x ".join(f"{axis} {size}" for axis, size in layout["trainer_mesh"].items() if size > 1) or "1 device"
    if layout["engine_remote_servers"]:
        engine = f"engine: {layout['engine_remote_servers']} remote server(s)"
    elif layout["shares_trainer_arrays"]:
        engine = "engine serves the trainer's arrays"
    else:
        each = "an engine per host" if len(layout["hosts"]) > 1 else "engine"
        engine = f"{each}: {layout['engine_replicas']} replica(s) x tensor-parallel {layout['engine_tensor_parallel']}"
    return f"trainer mesh {mesh}; {engine}"


def plot(runs: list[tuple[str, dict[str, Any]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Polygon, Rectangle

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.3 * len(runs)), squeeze=False)
    for ax, (title, layout) in zip(axes[:, 0], runs):
        replica_of = _replicas(layout)
        x = 0.0
        for process, devices in layout["hosts"].items():
            width = 0.3 + 1.1 * len(devices)
            ax.add_patch(Rectangle((x, 0), width, 1.6, fill=False, lw=1.2, ec="#555555"))
            ax.text(x + 0.15, 1.45, f"host {process} (process {process})", fontsize=8, va="center")
            for k, (device_id, names) in enumerate(devices):
                left, bottom = x + 0.3 + 1.1 * k, 0.2
                if names == ["trainer", "engine"]:  # shared: half and half
                    ax.add_patch(Polygon([(left, bottom), (left + 0.9, bottom), (left, bottom + 0.9)], color=COLORS["trainer"]))
                    ax.add_patch(Polygon([(left + 0.9, bottom), (left + 0.9, bottom + 0.9), (left, bottom + 0.9)],
                                         color=COLORS["engine"]))
                else:
                    ax.add_patch(Rectangle((left, bottom), 0.9, 0.9, color=COLORS[names[0] if names else "unused"]))
                label = f"device {k}" + (f"\nreplica {replica_of[device_id]}" if device_id in replica_of else "")
                ax.text(left + 0.45, bottom + 0.45, label, fontsize=7, ha="center", va="center", color="white")
            x += width + 0.4
        ax.set_xlim(-0.1, max(x - 0.3, 4.5))
        ax.set_ylim(-0.05, 1.7)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"{title}: {describe(layout)}", fontsize=9, loc="left")
    legend = [Patch(color=COLORS["trainer"], label="trainer"), Patch(color=COLORS["engine"], label="engine"),
              Patch(color=COLORS["unused"], label="unused"),
              Patch(facecolor=COLORS["trainer"], edgecolor=COLORS["engine"], hatch="//", label="both (half and half)")]
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _replicas(layout: dict[str, Any]) -> dict[int, int]:
    """Engine device id -> its replica in its host's engine (a replica's tensor-parallel devices are
    neighbours in device order, docs/scaling.md "The engine's mesh"; each process of a multi-process
    run has an engine of its own); empty where the engine has no mesh of its own."""
    if layout["shares_trainer_arrays"] or not layout["engine_devices"]:
        return {}
    degree, engine = layout["engine_tensor_parallel"], set(layout["engine_devices"])
    replica_of: dict[int, int] = {}
    for devices in layout["hosts"].values():
        ids = [device_id for device_id, _ in devices if device_id in engine]
        replica_of.update({device_id: k // degree for k, device_id in enumerate(ids)})
    return replica_of


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run directories (their provenance.json)")
    parser.add_argument("--make-runs", type=Path, default=None, metavar="DIR",
                        help="first train one step in each layout of LAYOUTS into DIR/<layout>, then draw those")
    parser.add_argument("--titles", nargs="+", default=None, help="a panel title per run (default: the directory's name)")
    parser.add_argument("-o", "--out", type=Path, default=Path("placement.png"), help="output PNG")
    args = parser.parse_args(argv)
    if bool(args.runs) == bool(args.make_runs):
        parser.error("give run directories or --make-runs DIR (one of them)")
    if args.titles is not None and len(args.titles) != len(args.runs):
        parser.error(f"--titles: {len(args.titles)} titles for {len(args.runs)} runs")
    titled = make_runs(args.make_runs) if args.make_runs else list(zip(args.titles or [r.name for r in args.runs], args.runs))
    layouts = [(title, roles(run_dir)) for title, run_dir in titled]
    plot(layouts, args.out)
    summary = {title: {str(process): {role: sum(role in names for _, names in devices) for role in ("trainer", "engine")}
                       for process, devices in layout["hosts"].items()} for title, layout in layouts}
    print(json.dumps({"png": str(args.out), "runs": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
