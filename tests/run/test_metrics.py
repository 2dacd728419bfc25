"""The stats tracker and its sinks (JSONL, TensorBoard, console)."""

from __future__ import annotations

import io
import json
import sys
import threading

import pytest

from asyncrl.run.metrics import ConsoleSink, JsonlSink, StatsTracker, TensorBoardSink


def test_reductions_and_reset(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    tracker = StatsTracker([sink])
    tracker.scalar("reward/mean", 0.0)
    tracker.scalar("reward/mean", 1.0)
    tracker.scalar("rollout/dropped_stale", 2, reduce="sum")
    tracker.scalar("rollout/dropped_stale", 3, reduce="sum")
    tracker.scalar("engine/version", 4, reduce="last")
    tracker.scalar("engine/version", 5, reduce="last")
    first = tracker.commit(step=1)
    assert first["reward/mean"] == 0.5 and first["rollout/dropped_stale"] == 5 and first["engine/version"] == 5
    tracker.scalar("reward/mean", 0.25)
    assert tracker.commit(step=2) == {"reward/mean": 0.25}
    tracker.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[0]["reward/mean"] == 0.5 and lines[1] == {"step": 2, "reward/mean": 0.25}


def test_unknown_reduction_is_an_error():
    with pytest.raises(ValueError, match="unknown reduction 'median' for metric 'x'"):
        StatsTracker().scalar("x", 1.0, reduce="median")


def test_recording_from_many_threads():
    tracker = StatsTracker()
    threads = [threading.Thread(target=lambda: [tracker.scalar("n", 1, reduce="sum") for _ in range(1000)], daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert tracker.commit(0)["n"] == 8000


def test_tensorboard_events_read_back(tmp_path):
    from tests.helpers import read_tensorboard_scalars

    tracker = StatsTracker([TensorBoardSink(tmp_path / "tb")])
    for step in (1, 2):
        tracker.scalar("reward/mean", step / 4)
        tracker.scalar("loss/policy", -step)
        tracker.commit(step)
    tracker.close()
    scalars = read_tensorboard_scalars(tmp_path / "tb")
    assert scalars["reward/mean"] == [(1, 0.25), (2, 0.5)]
    assert scalars["loss/policy"] == [(1, -1.0), (2, -2.0)]


def test_a_failing_tensorboard_write_warns_once_and_never_blocks_the_step(tmp_path, monkeypatch, caplog):
    """Disk full under the event file: each step's write fails at once (tensorboardX's writer
    thread dies there, and its full queue must not block the run), one warning; a
    record the failure tore is cut off, and once writing works again the events go on in the
    same file."""
    import errno
    import logging
    import os

    import asyncrl.run.metrics as metrics
    from tests.helpers import read_tensorboard_scalars

    sink = TensorBoardSink(tmp_path / "tb")
    sink.write(1, {"reward/mean": 0.5})
    real_write = os.write
    full = {"on": True}

    def write(fd, data):
        if full["on"] and os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / "tb")):
            real_write(fd, bytes(data)[:7])  # a torn record, as a full disk leaves one
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(metrics.os, "write", write)
    with caplog.at_level(logging.WARNING, logger="asyncrl"):
        for step in range(2, 50):  # far more events than tensorboardX's queue of ten
            sink.write(step, {"reward/mean": step / 100})
        full["on"] = False
        sink.write(50, {"reward/mean": 0.25})
    sink.close()
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "[Errno 28] No space left on device" in warned[0], warned
    assert "works again; 48 step(s) were lost" in warned[1], warned
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    assert read_tensorboard_scalars(tmp_path / "tb")["reward/mean"] == [(1, 0.5), (50, 0.25)]


def test_console_plain_lines_keep_last_values_and_eta():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=4, stream=stream, use_bar=False)
    sink.write(1, {"reward/mean": 0.5, "eval/reward": 0.25, "rollout/lag_max": 1.0})
    sink.write(2, {"reward/mean": 0.75, "perf/trained_tokens_per_s": 1234.4})
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("step 1/4 reward 0.500 eval@1 0.250 lag 1")
    # a step without eval names the step its eval value is from
    assert lines[1].startswith("step 2/4 reward 0.750 eval@1 0.250 lag 1 tok/s 1234 eta ")


def test_console_columns_are_the_same_after_a_resume_and_extra_metrics_follow_them():
    """A fresh run's first row is the step-0 eval, a resumed run's a training step: both lines give
    the fields in one order. Names from logging.console_metrics come after, labelled by their last part."""
    fresh, resumed = io.StringIO(), io.StringIO()
    row = {"reward/mean": 0.5, "rollout/lag_max": 1.0, "perf/trained_tokens_per_s": 100.0, "engine/prefix_hit_rate": 0.8}
    sink = ConsoleSink(total_steps=9, stream=fresh, use_bar=False, extra=["engine/prefix_hit_rate"])
    sink.write(0, {"eval/reward": 0.25})
    sink.write(1, row)
    sink = ConsoleSink(total_steps=9, start_step=4, stream=resumed, use_bar=False, extra=["engine/prefix_hit_rate"])
    sink.write(5, row)
    sink.write(6, {**row, "eval/reward": 0.25})

    def labels(line: str) -> list[str]:  # "step 6/9 reward 0.500 eval@6 0.250 ... eta 3s": every other word
        return [word.split("@")[0] for word in line.split()[2::2]]

    expected = ["reward", "eval", "lag", "tok/s", "prefix_hit_rate", "eta"]
    assert labels(fresh.getvalue().splitlines()[-1]) == labels(resumed.getvalue().splitlines()[-1]) == expected
    assert "prefix_hit_rate 0.8 eta" in resumed.getvalue()


def test_console_eta_is_this_processs_own_pace(monkeypatch):
    """Start-up (loading, compiling) before the first step written is not a step's cost: a resumed
    run 100 s into its start-up that then takes 2 s a step says 2 s x the steps left."""
    from asyncrl.run import metrics

    now = [0.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=60, start_step=50, stream=stream, use_bar=False)
    now[0] = 100.0
    sink.write(51, {"reward/mean": 0.5})
    now[0] = 102.0
    sink.write(52, {"reward/mean": 0.5})
    assert [line.rsplit(" ", 1)[-1] for line in stream.getvalue().splitlines()] == ["?", "16s"]


def test_console_log_records_never_land_inside_the_bar(monkeypatch):
    """On a terminal the bar and log lines share stderr: a record is written on a line of its own
    (tqdm's logging redirect), never after the bar's text on the bar's line."""
    import logging
    import re

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        sink = ConsoleSink(total_steps=3, use_bar=True)
        sink.write(1, {"reward/mean": 0.5})
        logging.getLogger("asyncrl.test").warning("a record while the bar is up")
        sink.write(2, {"reward/mean": 0.75})
        sink.close()
        logging.getLogger("asyncrl.test").warning("a record after the bar")
    finally:
        root.removeHandler(handler)
    visible = [re.split(r"\r", line)[-1] for line in stream.getvalue().split("\n")]  # what each terminal line shows
    assert "a record while the bar is up" in visible and "a record after the bar" in visible, visible
    assert any("reward 0.750" in line for line in visible)


def test_console_bar_shows_each_steps_values_at_once():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=3, stream=stream, use_bar=True)
    sink.write(1, {"eval/reward": 0.25})
    sink.write(2, {"eval/reward": 0.5})
    assert "eval@1 0.250" in stream.getvalue() and stream.getvalue().rstrip().endswith("eval@2 0.500]")


def test_every_hosts_metrics_combine_into_one_row():
    """Counters, seconds and throughputs summed; maxima, the p90 lag and the batch wait the largest;
    ratios, mean lags and latencies averaged; a name only some hosts report over those."""
    from asyncrl.run.metrics import combine_hosts, host_reduction

    hosts = [{"engine/requests": 4, "engine/decode_tokens_per_s": 100.0, "engine/slot_occupancy": 0.5,
              "engine/queue_wait_max_s": 0.2, "rollout/lag_max": 1, "rollout/lag_mean": 0.5, "rollout/lag_p90": 1,
              "rollout/wait_s": 0.1, "rollout/count/trained": 8, "engine/swap_latency_s": 0.01, "engine/version": 3,
              "rollout/step_dropped/stale": 1},
             {"engine/requests": 6, "engine/decode_tokens_per_s": 50.0, "engine/slot_occupancy": 0.25,
              "engine/queue_wait_max_s": 0.5, "rollout/lag_max": 0, "rollout/lag_mean": 0.0, "rollout/lag_p90": 0,
              "rollout/wait_s": 0.3, "rollout/count/trained": 8, "engine/swap_latency_s": 0.03, "engine/version": 3}]
    assert combine_hosts(hosts) == {
        "engine/requests": 10, "engine/decode_tokens_per_s": 150.0, "engine/slot_occupancy": 0.375,
        "engine/queue_wait_max_s": 0.5, "rollout/lag_max": 1, "rollout/lag_mean": 0.25, "rollout/lag_p90": 1,
        "rollout/wait_s": 0.3, "rollout/count/trained": 16, "engine/swap_latency_s": 0.02, "engine/version": 3,
        "rollout/step_dropped/stale": 1}
    assert [host_reduction(n) for n in ("engine/decode_wait_s", "engine/queue_wait_s", "engine/prefix_hit_rate",
                                        "rollout/episode_latency_p90_s", "engine/decode_ms_per_step")] == [
        "sum", "mean", "mean", "mean", "mean"]
