"""Plot a run's curves (reward, eval, version lag, throughput) from its metrics.jsonl.

Usage: python scripts/plot_metrics.py RUN_DIR_OR_METRICS_JSONL [-o OUT.png]
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
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return drawn


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("-o", "--out", type=Path, default=None, help="output PNG (default: RUN_DIR/curves.png)")
    parser.add_argument("--title", default=None, help="figure title (default: the run directory)")
    args = parser.parse_args(argv)
    rows = load(args.path)
    run_dir = args.path if args.path.is_dir() else args.path.parent
    out = args.out or run_dir / "curves.png"
    drawn = plot(rows, out, title=args.title or str(run_dir))
    print(json.dumps({"png": str(out), "steps": len(rows), "series": drawn}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
