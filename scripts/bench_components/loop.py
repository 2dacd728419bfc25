"""The train step inside the loop against the same step alone: where the loop's train time goes.

Runs ``bench_vs_trl.py``'s asyncrl work (the ``bench-40m`` llama-layout directory, ``--prompts``
x ``--group`` completions of ``--new`` tokens, one update per step) through
:func:`asyncrl.run.loop.train` in this process at ``max_staleness`` ``--staleness``, and around
every ``Trainer.step`` records its wall time, the process's ``getrusage`` deltas (minor page
faults, voluntary and involuntary context switches, user and system CPU) and the CPU each of
the process's threads used meanwhile (``/proc/self/task``; Python threads by name, XLA's by
their native name). After the run (engine shut down, rollout threads gone) it steps the same
``Trainer`` again on the same batches (``alone``), then steps a Trainer built as
``bench.py train`` builds it on ``bench.py train``'s random batch of the loop's shape
(``bench_train``). First ``--warmup`` loop steps (compilation) are left out; figures are medians.

Fields: ``shape`` (rows, length of the trained batch); per mode ``train_s`` (``perf/train_time``),
``minflt``, ``nvcsw``, ``nivcsw``, ``user_s``, ``sys_s``; ``loop.other_threads_cpu_s`` (CPU of
every thread but XLA's and the main one during a loop step: the engine, rollouts, rewards,
trackers); ``loop_over_bench_train`` and ``loop_over_alone`` (ratios of ``train_s``) and
``target`` (the loop's train time at most 1.1 x ``bench.py train``'s step at the same
shape). Compare the page faults with ``run.keep_host_memory`` (``--keep-host-memory``).
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from bench_common import load_avg, load_avg_since

_XLA_AND_MAIN = ("MainThread", "native:tf_XLAEigen")


def _usage() -> dict[str, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"minflt": r.ru_minflt, "nvcsw": r.ru_nvcsw, "nivcsw": r.ru_nivcsw, "user_s": r.ru_utime, "sys_s": r.ru_stime}


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """``{tid: (name, CPU seconds)}`` of this process's threads (Python names by ``native_id``)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (names.get(int(tid), "native:" + comm), (int(fields[11]) + int(fields[12])) / ticks)
    return out


def _timed(step: Callable[[], dict]) -> dict[str, Any]:
    """One trainer step with its usage deltas and the CPU of the threads other than XLA's and the main one."""
    before, threads = _usage(), _thread_cpu()
    metrics = step()
    after, threads_after = _usage(), _thread_cpu()
    other = sum(cpu - threads.get(tid, (name, 0.0))[1] for tid, (name, cpu) in threads_after.items()
                if name not in _XLA_AND_MAIN)
    return {**{k: after[k] - before[k] for k in before}, "train_s": metrics["perf/train_time"], "other_threads_cpu_s": other}


def _median(rows: list[dict]) -> dict[str, float]:
    return {key: round(statistics.median(row[key] for row in rows), 4) for key in rows[0]}


def _config(args: argparse.Namespace, work: Path) -> Any:
    import bench_vs_trl
    from bench_common import bench_40m_dir

    from asyncrl.config import load_config

    model = "tiny" if args.model == "tiny" else str(bench_40m_dir(work / "bench-40m-hf"))
    trl_args = bench_vs_trl.parse(["--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group),
                                   "--new", str(args.new)])
    raw = bench_vs_trl.asyncrl_config(trl_args, Path(model), bench_vs_trl.write_prompts(work / "prompts.jsonl"), work / "run")
    raw["rollout"]["max_staleness"] = args.staleness
    raw["run"]["keep_host_memory"] = args.keep_host_memory
    return load_config(data=raw)


def run(args: argparse.Namespace) -> dict:
    from bench_common import random_train_batch

    from asyncrl.config import load_config
    from asyncrl.model import bench_40m_config, init_decoder, load_model, split_params
    from asyncrl.run.loop import train
    from asyncrl.trainer import Trainer

    start = load_avg()
    loop_rows: list[dict] = []
    batches: list[Any] = []
    trainers: list[Trainer] = []
    original = Trainer.step

    def recorded(self: Trainer, batch: Any) -> dict:
        trainers[:] = [self]
        batches.append(batch)
        out: dict = {}
        loop_rows.append(_timed(lambda: out.setdefault("m", original(self, batch))))
        return out["m"]

    with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
        cfg = _config(args, Path(tmp))
        Trainer.step = recorded  # type: ignore[method-assign]
        try:
            train(cfg, console=sys.stderr)  # stdout carries the one JSON line
        finally:
            Trainer.step = original  # type: ignore[method-assign]
    kept = batches[args.warmup:]
    if not kept:
        raise SystemExit(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    trainer = trainers[0]
    alone = [_timed(functools.partial(trainer.step, b)) for b in kept]

    # bench.py train's trainer (default config, init_decoder weights) on its random batch, the loop's shape.
    rows, length = kept[-1].input_ids.shape
    if args.model == "tiny":
        graphdef, params = load_model("tiny", with_tokenizer=False).split()
    else:
        graphdef, params = split_params(init_decoder(bench_40m_config(), seed=0))
    bench_trainer = Trainer(load_config(data={"rollout": {"group_size": args.group, "batch_size": rows // args.group}}),
                            graphdef, params)
    data = random_train_batch(rows, length, bench_trainer.model_cfg.vocab_size, min(16, length // 2))  # bench_vs_trl's prompt
    bench_trainer.step(data)  # compiles
    bench = [_timed(lambda: bench_trainer.step(data)) for _ in kept]

    loop, alone_m, bench_m = _median(loop_rows[args.warmup:]), _median(alone), _median(bench)
    ratio = loop["train_s"] / bench_m["train_s"]
    return {
        "model": args.model, "staleness": args.staleness, "keep_host_memory": args.keep_host_memory,
        "shape": [int(rows), int(length)], "steps": len(kept),
        "loop": loop, "alone": alone_m, "bench_train": bench_m,
        "loop_over_bench_train": round(ratio, 3), "loop_over_alone": round(loop["train_s"] / alone_m["train_s"], 3),
        "target": {"loop_over_bench_train_max": 1.1, "pass": ratio <= 1.1},
        **load_avg_since(start),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bench-40m", choices=["bench-40m", "tiny"],
                        help="tiny: the built-in 2-layer model, to check the script in seconds")
    parser.add_argument("--staleness", type=int, default=0, help="rollout.max_staleness of the loop")
    parser.add_argument("--steps", type=int, default=8, help="loop steps (the first --warmup left out)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--keep-host-memory", action="store_true", help="run.keep_host_memory: true in the loop")
