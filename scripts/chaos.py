"""Preemption drill: kill a training run at random moments, resume it until it finishes, and
check that nothing was lost or trained twice; prints one JSON line.

    PYTHONPATH=. python scripts/chaos.py CONFIG [--kills 20] [--set PATH=VALUE ...]
                                         [--launch "python -m asyncrl.cli"] [--seed 0] [--out DIR]

Each attempt launches ``<launch> train CONFIG --set run.output_dir=<out>/chaos ...`` (with
``--resume`` after the first) in its own process group, waits until it has trained at least
one more step (its console lines), and then stops it at random: SIGKILL or SIGTERM, either
after a short random delay or the moment a checkpoint write is in progress (a
``checkpoints/.tmp-step_*`` directory appears). After ``--kills`` kills the last resume runs
to the end. ``--launch`` is the command that starts one run (for a multi-process run, the
launcher of all its processes: the whole process group is signalled).

The run's own records are then checked:

* ``steps_missing`` / ``steps_duplicated``: trained steps in ``metrics.jsonl`` against
  ``1..total_steps``;
* ``samples_lost`` / ``samples_trained_twice``: the final checkpoint's ledger (every drawn
  sample id in exactly one category; trained = RL steps x ``rollout.batch_size``) and the
  dumped trajectories (every step's groups are dumped: ``logging.dump_every_steps=1``), no
  sample id trained at two steps;
* ``weights_equal``: with ``rollout.max_staleness: 0`` the config is also run once without
  interruption (alongside the drill) and the final weights must be equal to the bit (null
  for asynchronous runs, whose batches depend on timing).

The runs share a JAX persistent compilation cache (``--compile-cache``, default beside
``--out``), so a restart costs start-up, not compilation.

Exit status 0 when everything holds. docs/checkpoints.md: "A preemption drill".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlib import ChildRun, child_env, read_jsonl, read_metrics, train_argv  # noqa: E402


def wait_for_checkpoint_write(root: Path, before: set[str], proc: subprocess.Popen, timeout: float) -> bool:
    """Poll (1 ms) until a new ``.tmp-step_*`` directory appears under ``root``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            names = {e.name for e in os.scandir(root) if e.name.startswith(".tmp-step_")}
        except OSError:
            names = set()
        if names - before:
            return True
        time.sleep(0.001)
    return False


def tmp_dirs(root: Path) -> set[str]:
    try:
        return {e.name for e in os.scandir(root) if e.name.startswith(".tmp-step_")}
    except OSError:
        return set()


def run_until_done(args: argparse.Namespace, config: Path, out: Path, overrides: list[str], kills: int,
                   rng: random.Random) -> dict[str, Any]:
    """Launch, kill ``kills`` times, resume to the end; returns the counts."""
    launch = shlex.split(args.launch)
    # JAX's persistent compilation cache (a variable already set wins), so a restart does not recompile.
    env = child_env(compile_cache=Path(args.compile_cache), keep_cache=True) if args.compile_cache else child_env()
    counts = {"kills": 0, "sigkill": 0, "sigterm": 0, "kills_in_checkpoint_write": 0, "resumes": 0}
    errors: list[str] = []
    attempt_index = 0
    while True:
        argv = train_argv(config, [*overrides, f"run.output_dir={out}"], *(["--resume"] if attempt_index else []))
        counts["resumes"] += bool(attempt_index)
        root = out / "checkpoints"
        before = tmp_dirs(root)
        attempt = ChildRun(argv, env, launch=launch, cwd=Path.cwd(), new_session=True, keep_lines=30,
                           log=out.parent / f"{out.name}-attempt{attempt_index:03d}.log")
        attempt_index += 1
        if counts["kills"] >= kills:
            code = attempt.finish(args.timeout)
            if code != 0:
                errors.append(f"final resume exited {code}: {attempt.output[-600:]}")
            break
        if not attempt.wait_for_steps(rng.randint(1, 3), args.timeout):
            code = attempt.finish(args.timeout)
            if code == 0:
                break  # finished before it could be killed: fewer kills than asked
            errors.append(f"attempt {attempt_index} exited {code} before training a step: {attempt.output[-600:]}")
            break
        in_write = rng.random() < 0.5 and wait_for_checkpoint_write(root, before, attempt.proc, args.timeout)
        if not in_write:
            time.sleep(rng.uniform(0.0, args.max_delay))
        signum = rng.choice([signal.SIGKILL, signal.SIGTERM])
        alive = attempt.proc.poll() is None
        attempt.signal(signum)
        code = attempt.finish(args.timeout)
        if code == 0 and not alive:
            break  # it finished on its own
        expected = {-signal.SIGKILL, 128 + signal.SIGKILL} if signum == signal.SIGKILL else {
            128 + signal.SIGTERM, -signal.SIGTERM, -signal.SIGKILL, 0}
        if code not in expected:
            errors.append(f"attempt {attempt_index} ({signal.Signals(signum).name}) exited {code}: "
                          f"{attempt.output[-600:]}")
            break
        counts["kills"] += 1
        counts["sigkill" if signum == signal.SIGKILL else "sigterm"] += 1
        counts["kills_in_checkpoint_write"] += int(in_write)
    return {**counts, "errors": errors}


def trained_steps(out: Path) -> list[int]:
    """Steps of the trained rows of metrics.jsonl (rows with a loss: ``loss/total`` of an RL
    step, ``loss/sft`` of an SFT step; eval-only rows excluded)."""
    return [int(row["step"]) for row in read_metrics(out) if any(name.startswith("loss/") for name in row)]


def final_checkpoint(out: Path) -> Any:
    """The newest complete checkpoint of the run in ``out`` (a run that wrote none is an error)."""
    from asyncrl.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(out)
    if path is None:
        raise SystemExit(f"chaos: {out}: the run finished without a checkpoint (set checkpoint.every_steps)")
    return load_checkpoint(path)


def sample_accounting(out: Path, cfg: Any) -> dict[str, int]:
    """Lost and twice-trained samples, from the final checkpoint's ledger and the trajectory dumps."""
    rl_steps = sum(stage.total_steps for stage, _ in cfg.stage_configs() if stage.type == "rl")
    final = final_checkpoint(out)
    if final.rollout_state is None:
        return {"samples_lost": 0, "samples_trained_twice": 0}
    ledger = final.rollout_state["meta"]["ledger"]
    counts = dict(ledger["terminal"])
    for entry in ledger["entries"]:
        counts[entry[2]] = counts.get(entry[2], 0) + 1
    counts["reissued"] = counts.get("reissued", 0) + len(ledger["reissue"])
    unaccounted = int(ledger["next_sample_id"]) - sum(counts.values())
    expected = rl_steps * cfg.rollout.batch_size
    trained = counts.get("trained", 0)
    ids: dict[int, set[int]] = {}
    for record in read_jsonl(out / "trajectories.jsonl"):
        ids.setdefault(int(record["metadata"]["sample_id"]), set()).add(int(record["step"]))
    twice_in_dumps = sum(1 for steps in ids.values() if len(steps) > 1)
    return {
        "samples_lost": max(0, expected - trained) + max(0, unaccounted) + max(0, expected - len(ids)),
        "samples_trained_twice": max(0, trained - expected) + twice_in_dumps,
        "samples_trained": trained,
    }


def final_params(out: Path) -> dict[str, np.ndarray]:
    return final_checkpoint(out).arrays["params"]


def weights_equal(a: Path, b: Path) -> bool:
    pa, pb = final_params(a), final_params(b)
    return pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", metavar="CONFIG")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="config override for every run (as asyncrl train --set)")
    parser.add_argument("--launch", default=f"{shlex.quote(sys.executable)} -m asyncrl.cli",
                        help="the command that starts one run; 'train CONFIG --set ...' is appended")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--out", default="runs/chaos", help="directory for the runs (replaced)")
    parser.add_argument("--max-delay", type=float, default=2.0, help="most seconds between progress and a kill")
    parser.add_argument("--timeout", type=float, default=1800.0, help="most seconds one attempt may take")
    parser.add_argument("--compile-cache", default=None,
                        help="JAX persistent compilation cache for the runs (default: <out>/jax-cache; '' for none)")
    args = parser.parse_args(argv)

    from asyncrl.config import load_config

    rng = random.Random(args.seed)
    overrides = [*args.overrides, "logging.dump_every_steps=1", "run.overwrite=true"]
    cfg = load_config(args.config, overrides)
    overrides.append(f"logging.dump_groups={cfg.rollout.batch_size}")
    root = Path(args.out)
    if args.compile_cache is None:
        args.compile_cache = str(root.parent / f"{root.name}-jax-cache")
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    started = time.monotonic()
    synchronous = all(s.rollout.max_staleness == 0 for _, s in cfg.stage_configs())
    reference: dict[str, Any] = {"errors": []}
    # The uninterrupted run goes alongside the drill (its own process, its own directory).
    ref_thread = threading.Thread(target=lambda: reference.update(run_until_done(
        args, Path(args.config), root / "reference", overrides, 0, random.Random(0))), daemon=True)
    if synchronous:
        ref_thread.start()
    counts = run_until_done(args, Path(args.config), root / "chaos", overrides, args.kills, rng)
    if synchronous:
        ref_thread.join()
        counts["errors"] += reference["errors"]
    result: dict[str, Any] = {"config": args.config, "overrides": args.overrides,
                              **{k: v for k, v in counts.items() if k != "errors"}}
    if not counts["errors"]:
        steps = trained_steps(root / "chaos")
        expected = set(range(1, cfg.total_steps + 1))
        result["steps"] = len(set(steps))
        result["steps_missing"] = len(expected - set(steps))
        result["steps_duplicated"] = len(steps) - len(set(steps))
        result.update(sample_accounting(root / "chaos", cfg))
        result["weights_equal"] = weights_equal(root / "chaos", root / "reference") if synchronous else None
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["errors"] = counts["errors"]
    print(json.dumps(result))
    clean = not counts["errors"] and not result.get("steps_missing") and not result.get("steps_duplicated") and \
        not result.get("samples_lost") and not result.get("samples_trained_twice") and result.get("weights_equal") in (
            None, True)
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
