"""Plot a run's curves (reward, eval, version lag, throughput) from its metrics.jsonl, or compare runs.

Usage: python scripts/plot_metrics.py RUN_DIR_OR_METRICS_JSONL [-o OUT.png]
       python scripts/plot_metrics.py RUN_A RUN_B ... [--labels A B ...] -o OUT.png

With several runs: the training reward (a moving mean over ``SMOOTH_STEPS`` steps) and the
held-out eval reward against the step, one line per run (scripts/staleness_sweep.py --plot).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlib import read_metrics  # noqa: E402

PANELS = (
    ("reward", ("reward/mean",)),
    ("eval", ("eval/reward", "eval/accuracy")),
    ("version lag", ("rollout/lag_max", "rollout/lag_mean")),
    ("throughput (tokens/s)", ("perf/trained_tokens_per_s", "perf/gen_tokens_per_s")),
)


COMPARED = (("training reward (reward/mean, mean of {n} steps)", "reward/mean"), ("held-out eval reward (eval/reward)", "eval/reward"))
SMOOTH_STEPS = 10
"""Steps the compared training reward is averaged over (one step's batch mean is noisy)."""


def load(path: Path) -> list[dict]:
    try:
        rows = read_metrics(path)
    except (OSError, ValueError) as err:
        raise SystemExit(f"plot_metrics: {err}") from None
    if not rows:
        raise SystemExit(f"plot_metrics: {path}: no metrics")
    return rows


def plot(rows: list[dict], out: Path, title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    drawn = []
    for ax, (label, names) in zip(axes.ravel(), PANELS):
        for name in names:
            points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
            # Stage-tagged runs log "<stage>/<name>"; plot those series too.
            if not points:
                points = [(r["step"], v) for r in rows for k, v in r.items() if k.endswith("/" + name) and v is not None]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="." if len(points) < 40 else None, label=name)
                drawn.append(name)
        ax.set_title(label)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    _save(fig, out, title)
    return drawn


def plot_compare(runs: list[tuple[str, list[dict]]], out: Path, title: str) -> dict[str, dict[str, int]]:
    """``runs`` (label, metrics rows) side by side, one panel per series of ``COMPARED``; returns
    the points drawn per run and series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(COMPARED), figsize=(11, 4))
    drawn: dict[str, dict[str, int]] = {label: {} for label, _ in runs}
    for ax, (panel, name) in zip(axes, COMPARED):
        for label, rows in runs:
            points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
            if name == "reward/mean":
                points = [(step, _mean([v for _, v in points[max(0, k - SMOOTH_STEPS + 1):k + 1]]))
                          for k, (step, _) in enumerate(points)]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o" if name.startswith("eval/") else None, markersize=3, label=label)
            drawn[label][name] = len(points)
        ax.set_title(panel.format(n=SMOOTH_STEPS), fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, out, title)
    return drawn



def _save(fig, out: Path, title: str) -> None:
    """Title, lay out and write ``fig`` to ``out`` (its folder made), then free it."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)

def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", type=Path, nargs="+", metavar="path", help="a run directory or its metrics.jsonl; several: compare them")
    parser.add_argument("-o", "--out", type=Path, default=None, help="output PNG (default: RUN_DIR/curves.png; needed to compare)")
    parser.add_argument("--title", default=None, help="figure title (default: the run directory)")
    parser.add_argument("--labels", nargs="+", default=None, help="a legend label per run when comparing (default: the directories' names)")
    args = parser.parse_args(argv)
    if len(args.paths) > 1:
        if args.out is None:
            parser.error("comparing runs: give -o OUT.png")
        labels = args.labels or [p.name if p.is_dir() else p.parent.name for p in args.paths]
        if len(labels) != len(args.paths):
            parser.error(f"--labels: {len(labels)} labels for {len(args.paths)} runs")
        compared = plot_compare([(label, load(p)) for label, p in zip(labels, args.paths)], args.out, args.title or "")
        print(json.dumps({"png": str(args.out), "runs": compared}))
        return 0
    args.path = args.paths[0]
    rows = load(args.path)
    run_dir = args.path if args.path.is_dir() else args.path.parent
    out = args.out or run_dir / "curves.png"
    drawn = plot(rows, out, title=args.title or str(run_dir))
    print(json.dumps({"png": str(out), "steps": len(rows), "series": drawn}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
