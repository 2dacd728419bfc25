"""Checkpoint/resume acceptance tests against the real training loop.

Every run is a few steps of the ``tiny`` model on the ``copy`` task, configured here
explicitly (not from ``configs/quickstart.yaml``). Runs that must be killed or signalled
run ``asyncrl train`` in a subprocess (:data:`CHILD`); the rest call :func:`asyncrl.run.loop.train`
in-process.

What "identical metrics" means (:func:`comparable`): every metrics row is compared name for
name, except names whose value depends on wall-clock timing:

* ``perf/*`` (throughput, step and train times, FLOP/s) - the issue's own exclusion;
* timers: names ending in ``_s`` (``rollout/wait_s``, ``rollout/episode_latency_p50_s``,
  ``engine/decode_s``, ``engine/queue_wait_s``, ``engine/swap_latency_s``...), ``_per_s``
  (``engine/decode_tokens_per_s``...) and ``_ms_per_step``;
* engine scheduling: ``engine/decode_steps``, ``engine/slot_occupancy`` and ``engine/waiting``
  count how the scheduler thread happened to batch requests that arrive from rollout threads
  at timing-dependent moments (the tokens are identical: each request's randomness is its own).

Everything else - losses, rewards, KL, gradient norms, lags, rollout counts, the engine's
request, token and swap counts (continued across a resume) - must be equal to the bit.
``engine/compiles`` counts the XLA compilations of the whole process (not of the run), which
a second run in the same process or a resumed process does not repeat the same way, so it is
excluded too (:data:`PROCESS_WIDE`).

Test hooks of the child process are described at :data:`CHILD`. Budget (2-core CPU, warm
compilation cache): about 60-90 s for the default selection of this file; the ten-kill test
is ``slow``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

from asyncrl.checkpoint import checkpoint_problems, checkpoints_root, latest_checkpoint, load_checkpoint, step_dir_name
from asyncrl.config import load_config
from tests.helpers import REPO_ROOT, subprocess_env
from tests.rollout_fakes import MULTI_TURN_ON_TINY

BASE: dict[str, Any] = {
    "run": {"name": "resume-test", "seed": 3, "total_steps": 4},
    "model": {"path": "tiny"},
    "data": {"dataset": "copy"},
    "workflow": "single_turn",
    "algo": {"kl_coef": 0.05},  # a reference policy (the initial weights) that a resume must keep
    "rollout": {"batch_size": 4, "group_size": 4, "max_staleness": 0, "max_concurrent": 8, "temperature": 1.0,
                "max_new_tokens": 8},
    "engine": {"slots": 16},
    "eval": {"every_steps": 0},
    "checkpoint": {"every_steps": 2, "keep": 10},
    "logging": {"level": "INFO", "dump_every_steps": 0},
}

TIMING_NAMES = {"engine/decode_steps", "engine/slot_occupancy", "engine/waiting"}
TIMING_SUFFIXES = ("_s", "_per_s", "_ms_per_step")
PROCESS_WIDE = {"engine/compiles"}


def timing_dependent(name: str) -> bool:
    return name.startswith("perf/") or name.endswith(TIMING_SUFFIXES) or name in TIMING_NAMES


def comparable(row: dict[str, Any], also: frozenset[str] = frozenset()) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not timing_dependent(k) and k not in also}


def assert_rows_equal(got: list[dict], want: list[dict], also: frozenset[str] = frozenset()) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):
        a, b = comparable(a, also), comparable(b, also)
        diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
        assert not diff, f"step {a['step']}: {diff}"


def assert_saved_at_publish(checkpoint: Any) -> None:
    """A synchronous run's checkpoint holds no queued group: its rollout state is the one of the
    step's publish (``WorkflowExecutor.checkpoint_state``), before the next step's episodes were
    admitted, so a resume generates (and counts in the engine counters) every later group once,
    as the uninterrupted run did."""
    groups = checkpoint.rollout_state["meta"]["groups"] if checkpoint.rollout_state else {}
    assert not groups, f"{checkpoint.path} holds queued groups {sorted(groups)}"


def merged(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def write_config(directory: Path, out: Path, **overrides: Any) -> Path:
    """A YAML config of BASE + overrides writing to ``out``; returns its path."""
    raw = merged(BASE, {**overrides, "run": {**overrides.get("run", {}), "output_dir": str(out)}})
    if "stages" in overrides:
        del raw["run"]["total_steps"]  # the stages' own
    path = directory / f"config-{out.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def read_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_in_process(config_path: Path, *overrides: str):
    from asyncrl.run.loop import train

    return train(load_config(config_path, list(overrides)), console=io.StringIO())


# The child: `asyncrl train` with test hooks set through the environment.
#   ASYNCRL_TEST_KILL_AT=STAGE:N  SIGKILL itself at the N-th checkpoint-write stage STAGE (mid-write)
#   ASYNCRL_TEST_STALL_FROM=S     episodes of sample ids >= S never finish (a wait in next_batch)
# After main() returns it prints the threads still alive (the main thread excepted).
CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    kill_at = os.environ.get("ASYNCRL_TEST_KILL_AT")
    if kill_at:
        from asyncrl.checkpoint import store as checkpoint
        stage, nth = kill_at.rsplit(":", 1)
        seen = [0]
        def hook(name):
            if name == stage:
                seen[0] += 1
                if seen[0] == int(nth):
                    os.kill(os.getpid(), signal.SIGKILL)
        checkpoint._stage_hook = hook
    from asyncrl.cli import main
    code = main(["train", *sys.argv[1:]])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
        if not left:
            break
        time.sleep(0.05)
    print("THREADS_LEFT " + json.dumps(left), flush=True)
    sys.exit(code)
    """
)


class StallingWorkflow:
    """``single_turn``, except that episodes of sample ids >= ASYNCRL_TEST_STALL_FROM never end
    (until the engine shuts down): the loop then waits in next_batch."""

    def __new__(cls, cfg, tokenizer):
        from asyncrl.rollout.workflow import SingleTurnWorkflow

        class _Stalling(SingleTurnWorkflow):
            def run_episode(self, engine, sample):
                if sample["sample_id"] >= int(os.environ.get("ASYNCRL_TEST_STALL_FROM", "1000000")):
                    while not getattr(engine, "_closed", True):  # like a generate call the shutdown ends
                        time.sleep(0.05)
                    return None
                return super().run_episode(engine, sample)

        return _Stalling(cfg, tokenizer)


@contextlib.contextmanager
def no_unpickling():
    """Every pickle entry point records the call and raises, whatever thread makes it. The one
    exemption: tensorboardX hands its own event objects to its writer thread through a
    multiprocessing.Queue (pickled in this process, never read from a file)."""
    import _pickle
    import multiprocessing.reduction
    import pickle
    import traceback

    calls: list[str] = []
    original_loads = _pickle.loads

    def refuse(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == "multiprocessing.queues":
            return original_loads(*args, **kwargs)
        calls.append("".join(traceback.format_stack(limit=10)))
        raise AssertionError("something unpickled during a resume")

    class RefusingUnpickler(pickle.Unpickler):  # still a class: libraries subclass it
        def __init__(self, *args, **kwargs):
            refuse()

    saved = [(m, n, getattr(m, n)) for m in (pickle, _pickle) for n in ("load", "loads", "Unpickler")]
    saved.append((multiprocessing.reduction.ForkingPickler, "loads", multiprocessing.reduction.ForkingPickler.__dict__["loads"]))
    try:
        for module in (pickle, _pickle):
            module.load = module.loads = refuse
            module.Unpickler = RefusingUnpickler
        multiprocessing.reduction.ForkingPickler.loads = staticmethod(refuse)
        yield calls
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def start_child(config_path: Path, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(config_path), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=subprocess_env(**env), cwd=REPO_ROOT,
    )


def finish(proc: subprocess.Popen, timeout: float = 100) -> tuple[int, str, str]:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"child did not finish in {timeout} s\nstdout:\n{stdout}\nstderr:\n{stderr}") from None
    return proc.returncode, stdout, stderr


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 90, poll: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            _, stdout, stderr = finish(proc)
            raise AssertionError(f"child exited {proc.returncode} before the awaited moment\n{stdout}\n{stderr}")
        if time.monotonic() > deadline:
            proc.kill()
            _, stdout, stderr = finish(proc)
            raise AssertionError(f"timed out waiting\n{stdout}\n{stderr}")
        time.sleep(poll)


def sigkill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    finish(proc)
    assert proc.returncode == -signal.SIGKILL


def resumed_from(stderr: str) -> Optional[str]:
    for line in stderr.splitlines():
        if "resuming from" in line:
            return line.split("resuming from ", 1)[1].rsplit(" (step", 1)[0]
    return None


# --------------------------------------------------------------------------- synchronous runs


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory):
    """An uninterrupted synchronous run of 4 steps (checkpoints at 2 and 4), in-process."""
    base = tmp_path_factory.mktemp("sync")
    out = base / "reference"
    config = write_config(base, out)
    run_in_process(config)
    return config, out, read_rows(out)


@pytest.mark.slow  # each resume test compares against an uninterrupted seeded run
def test_two_synchronous_runs_give_identical_metrics(sync_reference, tmp_path):
    _, _, want = sync_reference
    out = tmp_path / "again"
    run_in_process(write_config(tmp_path, out))
    got = read_rows(out)
    assert len(got) == 4 and all(row["rollout/lag_max"] == 0 for row in got)
    assert_rows_equal(got, want, also=frozenset(PROCESS_WIDE))
    # Not vacuous: the runs learned something and their rewards vary across steps.
    assert len({row["loss/total"] for row in got}) > 1 and len({row["reward/mean"] for row in got}) > 1


def test_sigkill_after_a_checkpoint_then_resume_matches_and_never_unpickles(sync_reference, tmp_path, caplog):
    """The killed run is a child; the resume runs here with every pickle entry point patched to raise."""
    _, _, want = sync_reference
    out = tmp_path / "killed"
    config = write_config(tmp_path, out)
    manifest = checkpoints_root(out) / step_dir_name(2) / "MANIFEST.json"
    proc = start_child(config)
    wait_for(manifest.exists, proc)
    sigkill(proc)
    latest = latest_checkpoint(out)
    assert latest is not None
    k = load_checkpoint(latest).step
    assert k >= 2

    with caplog.at_level(logging.INFO, logger="asyncrl"), no_unpickling() as unpickled:
        run_in_process(config, "checkpoint.resume=auto")
    assert unpickled == []
    assert f"resuming from {latest} (step {k})" in caplog.text
    got = read_rows(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    # Engine counters count this process's own work: the resumed engine started at zero, and
    # the work counters continue from the checkpoint's copy (read when the step was published,
    # the moment its rollout state is of), so every counter equals the uninterrupted run's.
    from asyncrl.run.run_state import ENGINE_COUNTERS

    checkpoint = load_checkpoint(latest)
    assert_saved_at_publish(checkpoint)
    resumed, reference = [r for r in got if r["step"] > k], [r for r in want if r["step"] > k]
    assert_rows_equal(resumed, reference, also=frozenset(PROCESS_WIDE))
    base = checkpoint.state["engine_counters"]
    for name in ENGINE_COUNTERS:
        if name in base and not timing_dependent(name):  # decode_steps depends on batching
            assert all(base[name] <= row[name] <= ref[name] for row, ref in zip(resumed, reference)), name


def test_truncated_checkpoint_is_skipped_and_an_incompatible_config_refused(sync_reference, tmp_path):
    _, _, want = sync_reference
    out = tmp_path / "truncated"  # run.output_dir may not change on resume: a run of its own
    config = write_config(tmp_path, out)
    run_in_process(config)
    newest = checkpoints_root(out) / step_dir_name(4)
    params = max((f for f in (newest / "arrays" / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    params.write_bytes(params.read_bytes()[: params.stat().st_size // 2])  # a write cut short
    shutil.rmtree(out / "hf")

    # The real loop resumes from step 2 and reproduces steps 3 and 4.
    assert_saved_at_publish(load_checkpoint(checkpoints_root(out) / step_dir_name(2)))
    run_in_process(config, "checkpoint.resume=auto")
    assert_rows_equal(read_rows(out), want, also=frozenset(PROCESS_WIDE))
    assert not checkpoint_problems(newest)  # rewritten by the resumed run

    # A config that changes training fields is refused through the CLI, fields named.
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "train", str(config), "--resume", "--set", "rollout.batch_size=8",
         "--set", "algo.clip_high=0.3", "--set", "run.total_steps=9"],
        capture_output=True, text=True, timeout=60, env=subprocess_env(), cwd=REPO_ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert "cannot resume from" in proc.stderr
    assert "rollout.batch_size: checkpoint has 4, this config has 8" in proc.stderr
    assert "algo.clip_high: checkpoint has 0.2, this config has 0.3" in proc.stderr
    assert "run.total_steps" not in proc.stderr.split("may):")[1]  # allowed to change
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- asynchronous runs, killed


ASYNC = {
    "rollout": {"max_staleness": 2, "max_concurrent": 12},
    "checkpoint": {"every_steps": 1, "keep": 3},
    "logging": {"dump_every_steps": 1, "dump_groups": 4},
}
CHECKPOINT_STAGES = ["state.json", "config.yaml", "rollout", "arrays", "hashes",
                     "MANIFEST.json", "fsync-dir"]


def resume_here(config: Path) -> str:
    """Resume ``config`` to the end in this process; returns the asyncrl log. No thread of the
    run may outlive it."""
    import threading

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("asyncrl")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        run_in_process(config, "checkpoint.resume=auto")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    deadline = time.monotonic() + 5
    while (left := [t.name for t in threading.enumerate() if t.name.startswith("asyncrl-") and t.is_alive()]):
        assert time.monotonic() < deadline, f"threads left: {left}"
        time.sleep(0.05)
    return stream.getvalue()


def kill_and_resume_async(tmp_path: Path, kills: int, total_steps: int, seed: int) -> None:
    rng = random.Random(seed)
    out = tmp_path / "async"
    config = write_config(tmp_path, out, **merged(ASYNC, {"run": {"total_steps": total_steps}}))
    every_row: list[dict] = []  # rows of every process, also those a resume drops again
    resumes: list[tuple[Optional[str], Optional[str]]] = []
    for attempt in range(kills + 1):
        args = ["--resume"] if attempt else []
        before = latest_checkpoint(out)
        last_step = max((r["step"] for r in read_rows(out)), default=0)
        if attempt == kills:
            # The last resume runs to the end in this process (cheaper than a child).
            stderr = resume_here(config)
            every_row.extend(read_rows(out))
            resumes.append((resumed_from(stderr), str(before) if before is not None else None))
            break
        if attempt % 2 == 0:
            # SIGKILL in the middle of a checkpoint write, at a random stage of it.
            stage = rng.choice(CHECKPOINT_STAGES)
            proc = start_child(config, *args, ASYNCRL_TEST_KILL_AT=f"{stage}:{rng.randint(1, 2)}")
        else:
            # SIGKILL at a random moment after the run made progress.
            proc = start_child(config, *args)
            wait_for(lambda last_step=last_step: max((r["step"] for r in read_rows(out)), default=0) > last_step, proc)
            time.sleep(rng.uniform(0.0, 0.3))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        code, stdout, stderr = finish(proc)
        assert code in (-signal.SIGKILL, 0), stderr
        if attempt:
            # It resumed from the newest complete checkpoint there was (latest_checkpoint checked
            # every file's size and sha256 before the start).
            # A kill during the first checkpoint write leaves none: --resume then starts fresh.
            resumes.append((resumed_from(stderr), str(before) if before is not None else None))
            if before is None:
                assert "no complete checkpoint" in stderr and "starting fresh" in stderr
        every_row.extend(read_rows(out))

    assert all(got == expected for got, expected in resumes), resumes
    rows = read_rows(out)
    assert [r["step"] for r in rows] == list(range(1, total_steps + 1))
    # No trained token ever lagged more than max_staleness, in any process's rows.
    assert every_row and max(r["rollout/lag_max"] for r in every_row) <= 2
    assert max(r["rollout/dropped_stale"] for r in every_row) == 0

    # Accounting: the final checkpoint's ledger puts every sample drawn in exactly one category.
    latest = latest_checkpoint(out)
    assert latest is not None
    final = load_checkpoint(latest)
    assert final.step == total_steps and final.rollout_state is not None
    ledger = final.rollout_state["meta"]["ledger"]
    counts = {**ledger["terminal"]}
    for entry in ledger["entries"]:
        counts[entry[2]] = counts.get(entry[2], 0) + 1
    counts["reissued"] = counts.get("reissued", 0) + len(ledger["reissue"])
    assert sum(counts.values()) == ledger["next_sample_id"], counts
    assert counts["trained"] == total_steps * BASE["rollout"]["batch_size"], counts
    assert rows[-1]["rollout/count/trained"] == counts["trained"]
    # The metrics count B more trained groups per step, in every row of every process.
    assert all(r["rollout/count/trained"] == r["step"] * BASE["rollout"]["batch_size"] for r in every_row)

    # No sample trained twice, none trained with a lag > 2 (from the kept trajectory dumps).
    dumps = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    trained: dict[int, set[int]] = {}
    for record in dumps:
        trained.setdefault(record["step"], set()).add(record["metadata"]["sample_id"])
        assert record["step"] - 1 - min(record["versions"]) <= 2
    assert sorted(trained) == list(range(1, total_steps + 1))
    assert all(len(ids) == BASE["rollout"]["batch_size"] for ids in trained.values())
    all_ids = [i for ids in trained.values() for i in ids]
    assert len(all_ids) == len(set(all_ids))


@pytest.mark.slow  # 27 s; kills and resumes of asynchronous runs also run in test_checkpoint_async.py and the chaos drill
@pytest.mark.timeout(300)
def test_async_run_killed_twice_resumes_exactly(tmp_path):
    kill_and_resume_async(tmp_path, kills=2, total_steps=5, seed=0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_run_killed_ten_times_resumes_exactly(tmp_path):
    kill_and_resume_async(tmp_path, kills=10, total_steps=14, seed=1)


# --------------------------------------------------------------------------- signals


@pytest.mark.parametrize("signum, stall", [
    (signal.SIGINT, True),
    pytest.param(signal.SIGTERM, False, marks=pytest.mark.slow),
], ids=["sigint-waiting", "sigterm"])
def test_signal_checkpoints_and_exits(signum, stall, tmp_path):
    """SIGINT while the loop waits for rollouts that do not come: the wait is abandoned, a
    checkpoint of the last finished step written, every thread stopped, exit 130 well within
    the guard's 30 s. SIGTERM mid-run (slow): the same with 143."""
    out = tmp_path / "signalled"
    extra = {"run": {"total_steps": 500}, "checkpoint": {"every_steps": 0}}
    env = {}
    if stall:
        extra["workflow"] = "tests.checkpoint.test_resume:StallingWorkflow"
        env["ASYNCRL_TEST_STALL_FROM"] = "8"  # steps 1 and 2 train; step 3 waits forever
    config = write_config(tmp_path, out, **extra)
    proc = start_child(config, **env)
    wait_for(lambda: len(read_rows(out)) >= 2, proc, poll=0.05)
    if stall:
        time.sleep(0.5)  # well inside next_batch's wait for step 3
    sent = time.monotonic()
    proc.send_signal(signum)
    code, stdout, stderr = finish(proc, timeout=60)
    elapsed = time.monotonic() - sent
    assert code == 128 + signum, stderr
    assert elapsed < 30, elapsed
    assert "did not finish within" not in stderr
    rows = read_rows(out)
    path = latest_checkpoint(out)
    assert path is not None and load_checkpoint(path).step == rows[-1]["step"]
    if stall:
        assert rows[-1]["step"] == 2
    assert "THREADS_LEFT []" in stdout, stdout


@pytest.mark.slow  # the SIGINT checkpoint and the bit-for-bit resume stay in the default selection
def test_sigint_then_resume_continues_every_engine_counter_exactly(sync_reference, tmp_path, monkeypatch):
    """A SIGINT stop, then --resume, gives the uninterrupted run's rows to the bit, the
    engine's request and token counters included. The stop's checkpoint waits for the one in
    flight (each background write stalls half a second here), and with max_staleness 0 the next
    step's batch is generated meanwhile: its groups must not be saved as queued (they were
    generated after the counters the checkpoint keeps were read, so a resume would never count
    them; it counted 8 requests short on the quickstart)."""
    import threading

    from asyncrl.checkpoint import store
    from asyncrl.run.run_state import TrainingInterrupted

    _, _, want = sync_reference
    out = tmp_path / "interrupted"
    config = write_config(tmp_path, out, checkpoint={"every_steps": 1, "keep": 10})
    sent = threading.Event()

    def stall(stage: str) -> None:  # in the background write of each checkpoint
        if stage == "hashes":
            if not sent.is_set():  # during step 1's write: the loop stops after step 2
                sent.set()
                os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)

    monkeypatch.setattr(store, "_stage_hook", stall)
    with pytest.raises(TrainingInterrupted) as stopped:
        run_in_process(config)
    monkeypatch.setattr(store, "_stage_hook", None)
    assert stopped.value.exit_code == 130
    k = load_checkpoint(latest_checkpoint(out)).step
    assert 1 <= k < 4
    run_in_process(config, "checkpoint.resume=auto")
    got = read_rows(out)
    assert_rows_equal(got, want, also=frozenset(PROCESS_WIDE))
    from asyncrl.run.run_state import ENGINE_COUNTERS

    assert all(name in got[-1] for name in ENGINE_COUNTERS if not timing_dependent(name))  # not vacuous


# --------------------------------------------------------------------------- prefix reuse

MULTI_TURN: dict[str, Any] = {
    **MULTI_TURN_ON_TINY,
    # pages of 8: a turn extends the kept pages of the turn before (these contexts are shorter than the default 16)
    "engine": {"kv_capacity": 32, "prefill_buckets": [16, 31], "page_size": 8},
    "logging": {"dump_every_steps": 1, "dump_groups": 2},
}


@pytest.mark.parametrize("reuse", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["reuse", "no_reuse"])
def test_resume_reproduces_the_run_bit_for_bit_with_prefix_reuse_on_and_off(tmp_path, reuse):
    """A seeded synchronous multi-turn run with prefix reuse on (a group's requests copy one
    prefill, a turn extends the KV its trajectory's last turn kept), resumed from its step-2
    checkpoint. Kept prefixes are not saved: the resumed engine starts with none, which is what
    the uninterrupted engine has at every step's start, since the publish that ends a step makes
    every kept prefix stale (``across_versions: false``). So the resumed run reuses what the
    uninterrupted run reused, and its trajectories, metrics (the reuse counters continued from
    the checkpoint) and weights are the same bits. Left out of the row comparison: the workflow's
    own counters (``rollout/workflow/*``: this process's episodes) and ``engine/compiles``. With
    ``engine.prefix_cache.enabled: false`` the same holds, and nothing is reused."""
    out = tmp_path / "reuse"
    config = write_config(tmp_path, out, **merged(MULTI_TURN, {"engine": {"prefix_cache": {"enabled": reuse}}}))
    run_in_process(config)
    want = read_rows(out)
    want_dumps = (out / "trajectories.jsonl").read_text()
    want_params = {k: v.copy() for k, v in load_checkpoint(checkpoints_root(out) / step_dir_name(4)).arrays["params"].items()}
    # Not vacuous: turns were extended and, with reuse on, the reuse counted at every step.
    assert want[-1]["rollout/workflow/tool_calls"] > 0
    assert all((row["engine/prefix_hit_tokens"] > 0) == reuse for row in want)
    k = 2
    for path in checkpoints_root(out).iterdir():
        if path.name > step_dir_name(k):
            shutil.rmtree(path)
    shutil.rmtree(out / "hf")
    run_in_process(config, "checkpoint.resume=auto")

    got = read_rows(out)
    unsaved = {name for name in want[-1] if name.startswith("rollout/workflow/")}
    assert_rows_equal(got, want, also=frozenset(PROCESS_WIDE | unsaved))
    assert (out / "trajectories.jsonl").read_text() == want_dumps  # every step's groups: prompts, completions, rewards, versions
    got_params = load_checkpoint(checkpoints_root(out) / step_dir_name(4)).arrays["params"]
    assert got_params.keys() == want_params.keys()
    for key, value in want_params.items():
        assert value.tobytes() == got_params[key].tobytes(), key


# --------------------------------------------------------------------------- stages


SFT_THEN_RL: dict[str, Any] = {  # two SFT steps, then two RL steps
    "stages": [
        {"name": "sft", "type": "sft", "total_steps": 2},
        {"name": "rl", "type": "rl", "total_steps": 2},
    ],
    "sft": {"batch_size": 8},
}


@pytest.mark.slow  # a resume mid-RL with every engine counter stays in the default selection
def test_resume_from_the_end_of_sft_continues_every_engine_counter(tmp_path):
    """A seeded synchronous SFT-then-RL run with eval, resumed from the checkpoint that ends its SFT
    stage, gives the uninterrupted run's rows to the bit, engine counters included: that
    checkpoint's counters are read before the stage's last eval, whose requests a resume does
    not redo, so it keeps their own usage too (they went missing from every later row)."""
    stages = {**SFT_THEN_RL, "eval": {"every_steps": 2, "max_prompts": 6}, "checkpoint": {"every_steps": 1, "keep": 10}}
    out = tmp_path / "staged"
    config = write_config(tmp_path, out, **stages)
    run_in_process(config)
    want = read_rows(out)
    sft_end = next(row for row in want if row["step"] == 2)
    assert sft_end["stage"] == "sft" and "eval/reward" in sft_end
    for path in checkpoints_root(out).iterdir():
        if path.name > step_dir_name(2):
            shutil.rmtree(path)
    shutil.rmtree(out / "hf")
    run_in_process(config, "checkpoint.resume=auto")
    got = read_rows(out)
    assert_rows_equal(got, want, also=frozenset(PROCESS_WIDE))
    # Not vacuous: the evals' requests are among the counted ones (two RL steps alone make 8).
    assert got[-1]["engine/requests"] > 8


@pytest.mark.slow  # 15 s; staged resumes also run in test_resume_changes.py (extending a finished staged run)
def test_resume_in_the_middle_of_sft_then_rl(tmp_path):
    """Resumes land in the right stage and position; the RL stage's KL reference (its start
    weights) survives a resume that is itself resumed."""
    stages = {
        "stages": [
            {"name": "sft", "type": "sft", "total_steps": 2},
            {"name": "rl", "type": "rl", "total_steps": 3, "algo": {"kl_coef": 0.1}},
        ],
        "sft": {"batch_size": 8},
        "checkpoint": {"every_steps": 1, "keep": 10},
    }
    out = tmp_path / "staged"
    config = write_config(tmp_path, out, **stages)
    run_in_process(config)
    want = read_rows(out)
    assert [(r["step"], r["stage"]) for r in want] == [(1, "sft"), (2, "sft"), (3, "rl"), (4, "rl"), (5, "rl")]
    assert any(r["loss/kl"] != 0 for r in want if r["stage"] == "rl")

    def resume_from(step: int) -> None:
        for path in checkpoints_root(out).iterdir():
            if path.name > step_dir_name(step):
                shutil.rmtree(path)
        shutil.rmtree(out / "hf")
        assert_saved_at_publish(load_checkpoint(checkpoints_root(out) / step_dir_name(step)))
        run_in_process(config, "checkpoint.resume=auto")
        assert_rows_equal(read_rows(out), want, also=frozenset(PROCESS_WIDE))

    resume_from(1)  # in the SFT stage
    resume_from(3)  # in the RL stage
    # Step 4's checkpoint is now one a resumed run wrote: resuming it must still use the RL
    # stage's start weights as the KL reference.
    resume_from(4)
