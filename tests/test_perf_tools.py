"""The measuring tools: the compilation cache of runs (where it goes, its switch, that it really
caches small CPU programs) and the arithmetic of scripts/bench_rl.py, bench_async.py,
bench_vs_trl.py and bench.py's engine, accel and prefix, and bench.py paged's refusal of a bad --long-group. The scripts themselves run in
tests/test_doc_commands.py (their quick forms); bench_async's split layout and bench.py's prefix
and colocated also here (slow, by name)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from asyncrl.engine.fake import FakeEngine
from asyncrl.run.compile_cache import compile_cache_dir
from tests.helpers import REPO_ROOT, run_python, subprocess_env

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import bench_async  # noqa: E402
import bench_rl  # noqa: E402
import bench_vs_trl  # noqa: E402
from bench_components import accel as bench_accel  # noqa: E402
from bench_components import engine as bench_engine  # noqa: E402
from bench_components import gpu as bench_gpu  # noqa: E402
from bench_components import prefix as bench_prefix  # noqa: E402

# --------------------------------------------------------------------------- benchmark arithmetic


def test_decode_step_bound_refills_the_slot_that_frees_first():
    # Two slots. Static: batches (4, 1) and (1, 4), each as long as its longest: 8 steps.
    # Continuous: the second slot frees after step 1 and takes the third request (ends at 2),
    # then the fourth (ends at 6) while the first slot runs to 4.
    assert bench_engine.decode_step_bound(np.array([4, 1, 1, 4]), 2) == (8, 6)
    assert bench_engine.decode_step_bound(np.array([3, 3]), 4) == (3, 3)  # fewer requests than slots
    # The benchmark's own workload: the ceiling its continuous_vs_static can reach in decode steps.
    lengths = np.random.default_rng(1).integers(8, 65, size=128)
    static, continuous = bench_engine.decode_step_bound(lengths, 16)
    assert (static, continuous) == (485, 319)


class _StepCountingEngine(FakeEngine):
    """FakeEngine with the counters bench_engine reads: one prefill call per request and n
    decode steps per request of n new tokens (no batching: both runs count the same steps)."""

    def __init__(self) -> None:
        super().__init__(vocab_size=64, eos_prob=0.0)
        self.prefill_calls = 0
        self.steps = 0

    def generate(self, request):
        with self._lock:
            self.prefill_calls += 1
            self.steps += request.max_new_tokens
        return super().generate(request)

    def metrics(self) -> dict:
        with self._lock:
            return {"engine/decode_steps": float(self.steps), "engine/prefill_s": 0.0}


def test_variable_workload_reports_both_runs_and_the_bound():
    out = bench_engine.variable_workload(_StepCountingEngine(), 64, repeats=1)
    assert out["continuous_tokens_per_s"] > 0 and out["static_tokens_per_s"] > 0
    # Per run (the untimed warm-up included in the counters, divided out): every request once.
    assert out["continuous_prefill_calls"] == out["static_prefill_calls"] == 128
    assert out["continuous_decode_steps"] == out["static_decode_steps"]  # the fake counts tokens alike
    assert out["continuous_vs_static_steps"] == 1.0 and out["continuous_prefill_s"] == 0.0
    assert out["continuous_vs_static_bound"] == 485 / 319


# --------------------------------------------------------------------------- the compilation cache


def test_cache_dir_order_of_precedence():
    home = Path.home() / ".cache" / "asyncrl" / "jax"
    assert compile_cache_dir(True, {}) == home
    assert compile_cache_dir(True, {"XDG_CACHE_HOME": "/x"}) == Path("/x/asyncrl/jax")
    assert compile_cache_dir(True, {"XDG_CACHE_HOME": "/x", "ASYNCRL_CACHE_DIR": "/a"}) == Path("/a/jax")
    # JAX's own variable (the test suite's choice) wins over asyncrl's default.
    assert compile_cache_dir(True, {"ASYNCRL_CACHE_DIR": "/a", "JAX_COMPILATION_CACHE_DIR": "/j"}) == Path("/j")


def test_cache_switches_off_by_config_or_environment():
    assert compile_cache_dir(False, {"JAX_COMPILATION_CACHE_DIR": "/j"}) is None
    for off in ("0", "false", "OFF", "no"):
        assert compile_cache_dir(True, {"ASYNCRL_COMPILE_CACHE": off, "JAX_COMPILATION_CACHE_DIR": "/j"}) is None
    assert compile_cache_dir(True, {"ASYNCRL_COMPILE_CACHE": "1", "XDG_CACHE_HOME": "/x"}) == Path("/x/asyncrl/jax")
    with pytest.raises(ValueError, match="ASYNCRL_COMPILE_CACHE='maybe': use 0"):
        compile_cache_dir(True, {"ASYNCRL_COMPILE_CACHE": "maybe"})


CACHE_PROBE = """
import json
import subprocess
import sys
from pathlib import Path
import jax, jax.numpy as jnp
from asyncrl.run.compile_cache import enable_compile_cache
where = enable_compile_cache(True)
jax.jit(lambda x: x * 2 + 1)(jnp.arange(3.0)).block_until_ready()  # compiles in well under JAX's 1 s threshold
files = sorted(p.name for p in Path(sys.argv[1]).rglob("*") if p.is_file()) if Path(sys.argv[1]).exists() else []
from jax._src import compiler  # the options XLA compiles with: where GPU autotuning results go
options = compiler.get_compile_options(1, 1)  # held: its nested views die with it
build = options.executable_build_options
autotune = build.debug_options.xla_gpu_per_fusion_autotune_cache_dir
print(where, len(files), autotune or "-")
"""


def test_a_run_process_caches_small_programs_under_the_user_cache_and_the_switch_stops_it(tmp_path):
    """... and XLA's GPU autotuning results go beside the executables (the compile options name the directory)."""
    env = subprocess_env(XDG_CACHE_HOME=str(tmp_path))
    for name in ("JAX_COMPILATION_CACHE_DIR", "ASYNCRL_CACHE_DIR", "ASYNCRL_COMPILE_CACHE",
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        env.pop(name, None)
    env.pop("JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES", None)
    cache = tmp_path / "asyncrl" / "jax"
    where, count, autotune = run_python(CACHE_PROBE, env=env, args=[str(cache)]).stdout.split()
    assert where == str(cache) and int(count) >= 1
    assert autotune == str(cache / "xla_gpu_per_fusion_autotune_cache_dir")  # GPU autotuning kept with the cache
    off = run_python(CACHE_PROBE, env={**env, "ASYNCRL_COMPILE_CACHE": "0"}, args=[str(tmp_path / "off")])
    assert off.stdout.split() == ["None", "0", "-"]


# --------------------------------------------------------------------------- bench_rl's window


def _row(step: int, **values: float) -> dict:
    base = {"step": step, "perf/trained_tokens_per_s": 100.0, "perf/step_time": 1.0, "perf/train_time": 0.5,
            "rollout/wait_s": 0.3, "engine/decode_tokens": 50.0 * step, "engine/decode_s": 0.4 * step,
            "engine/prefill_tokens": 10.0 * step, "engine/prefill_tokens_per_s": 100.0, "rollout/lag_max": 1.0}
    return {**base, **values}


def test_bench_rl_shares_are_over_steps_2_to_n():
    rows = [_row(1, **{"perf/train_time": 9.0}), _row(2, **{"perf/eval_time": 0.5}),
            _row(3, **{"perf/checkpoint_time": 0.25}), _row(4)]
    times = {1: 10.0, 2: 11.5, 3: 12.75, 4: 13.75}  # window: 3.75 s of wall time for steps 2..4
    got = bench_rl.summarise(rows, times, steps=4)
    assert got["wall_s"] == 3.75
    assert got["trained_tokens_per_s"] == round(300.0 / 3.75, 1)
    assert got["generated_tokens_per_s"] == round(150.0 / 3.75, 1)
    share = got["share"]
    assert share["training"] == round(1.5 / 3.75, 4) and share["batch_wait"] == round(0.9 / 3.75, 4)
    assert share["eval"] == round(0.5 / 3.75, 4) and share["checkpoint"] == round(0.25 / 3.75, 4)
    assert share["publishing"] is None  # no perf/publish_time reported: unknown, not zero
    assert abs(sum(v for k, v in share.items() if k != "generation" and v is not None) - 1.0) < 1e-3
    # engine busy: decode 0.4 s/step + prefill 10 tokens at 100/s per step, for 3 steps
    assert share["generation"] == round(3 * 0.5 / 3.75, 4)
    published = bench_rl.summarise([_row(s, **{"perf/publish_time": 0.1}) for s in range(1, 5)], times, steps=4)
    assert published["share"]["publishing"] == round(0.3 / 3.75, 4)


# --------------------------------------------------------------------------- bench_accel's tables and floor


def test_bench_accel_peak_table_matches_device_kinds():
    assert bench_accel.table_peak("NVIDIA H100 80GB HBM3", "bfloat16") == (989.4e12, 3.35e12)
    assert bench_accel.table_peak("NVIDIA H100 PCIe", "bfloat16")[1] == 2.0e12
    assert bench_accel.table_peak("NVIDIA H200", "float32") == (494.7e12, 4.8e12)
    assert bench_accel.table_peak("TPU v5 lite", "bfloat16") == (197e12, 0.819e12)
    assert bench_accel.table_peak("TPU v5 lite", "float32") == (None, 0.819e12)  # measured instead
    assert bench_accel.table_peak("cpu", "float32") == (None, None)


def test_bench_accel_decode_floor_counts_weights_and_kv_cache():
    cfg = bench_accel.model_config(quick=False, dtype="bfloat16")
    decode = {"batch": 16, "prompt": 128, "new": 128, "ms_per_step": 2.0}
    param_bytes = 2 * cfg.num_params()
    got = bench_accel.decode_floor(cfg, cfg.num_params(), param_bytes, decode, flops=989.4e12, bandwidth=3.35e12)
    kv = 2 * 24 * 2 * 64 * 2 * (128 + 64)  # K and V, layers, kv heads, head_dim, bf16, mean context
    assert got["bytes_per_step"] == param_bytes + 16 * kv
    assert got["floor_bound"] == "memory"
    assert got["floor_ms_per_step"] == round(1e3 * got["bytes_per_step"] / 3.35e12, 3)
    assert got["vs_floor"] == pytest.approx(2.0 / got["floor_ms_per_step"], rel=1e-2)
    assert 490e6 < cfg.num_params() < 500e6  # Qwen2.5-0.5B: 494M


# --------------------------------------------------------------------------- bench_async


def test_bench_async_keeps_the_steps_after_warmup_and_takes_speedups_against_eta_0():
    def rows(step_time: float, wait: float) -> list[dict]:
        first = _row(1, **{"perf/step_time": 30.0, "perf/train_time": 20.0, "perf/publish_time": 5.0})  # compiles
        return [first] + [_row(s, **{"perf/step_time": step_time, "perf/train_time": 2.0, "rollout/wait_s": wait,
                                     "perf/publish_time": 0.1}) for s in (2, 3, 4)]

    eta0 = bench_async.summarise(rows(4.0, 1.5), {1: 40.0, 2: 44.0, 3: 48.5, 4: 52.0}, warmup=1)
    assert eta0["steps_kept"] == 3 and eta0["step_s"] == 4.0 and eta0["train_s"] == 2.0
    assert eta0["rollout_wait_s"] == 1.5 and eta0["publish_s"] == 0.1 and eta0["wall_step_s"] == 4.0
    eta2 = bench_async.summarise(rows(2.5, 0.2), {1: 40.0, 2: 42.5, 3: 45.0, 4: 47.5}, warmup=1)
    runs = {0: eta0, 2: eta2}
    layout = bench_async.layout_figures(runs)
    assert runs[0]["speedup"] == 1.0 and runs[2]["speedup"] == round(4.0 / 2.5, 3)
    ceiling = (2.0 + 1.5) / 2.0  # train + generation over the larger of the two, at eta 0
    assert layout == {"generation_s": 1.5, "ceiling": ceiling, "speedup_of_ceiling": round(1.6 / ceiling, 3)}
    checks = bench_async.targets({"split": {"eta0": eta0, "eta2": eta2, **layout}})
    assert checks["split_eta2_speedup"] == {"value": 1.6, "min": 1.6, "pass": True}
    assert checks["split_eta2_of_ceiling"]["pass"] is True  # 1.6 / 1.75 = 0.914 >= 0.9
    assert checks["colocated_eta2_speedup"]["pass"] is None  # not run: unknown, not failed
    with pytest.raises(ValueError, match="raise --steps above --warmup"):
        bench_async.summarise(rows(4.0, 1.5)[:1], {}, warmup=1)


def assert_bench_async_line(result: dict, layouts: list[str], etas: list[int]) -> None:
    """A bench_async JSON line: every figure of every (layout, eta) asked for is a number."""
    def number(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    assert result["bench"] == "async" and set(result["load_avg"]) == {"start", "end"}, result
    assert number(result["machine"]["cpu_count"]) and number(result["machine"]["cpus_usable"]), result["machine"]
    for layout in layouts:
        figures = result["runs"][layout]
        assert all(number(figures[name]) for name in ("generation_s", "ceiling", "speedup_of_ceiling")), figures
        for eta in etas:
            run = figures[f"eta{eta}"]
            for name in ("step_s", "wall_step_s", "train_s", "rollout_wait_s", "publish_s", "speedup", "lag_max"):
                assert number(run[name]) and run[name] >= 0, (layout, eta, name, run)
            assert run["steps_kept"] >= 1 and run["lag_max"] <= eta, run
    for name, check in result["targets"].items():
        assert number(check["value"]) == (check["pass"] is not None), (name, check)
    assert isinstance(result["ok"], bool), result


@pytest.mark.slow  # two tiny runs beside an asyncrl serve each (about a minute on 2 busy cores)
@pytest.mark.timeout(600)
def test_bench_async_split_layout_smallest_run(tmp_path):
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "bench_async.py"), "--model", "tiny", "--layouts", "split",
           "--staleness", "0", "2", "--steps", "3", "--warmup", "1", "--prompts", "2", "--group", "2", "--new", "8",
           "--work-dir", str(tmp_path / "work"), "--weights-root", str(tmp_path / "published")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), cwd=REPO_ROOT, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]  # a missed target is reported, not an exit status
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert_bench_async_line(result, ["split"], [0, 2])
    run = result["runs"]["split"]["eta2"]
    assert sorted(run["engine_cpus"] + run["trainer_cpus"]) == sorted(os.sched_getaffinity(0))
    assert not set(run["engine_cpus"]) & set(run["trainer_cpus"])
    assert list((tmp_path / "published").iterdir()) == []  # each run's published versions removed after it


# --------------------------------------------------------------------------- bench_vs_trl with eta 0 and 2


def test_bench_vs_trl_reports_asyncrl_at_eta_0_and_the_async_eta_against_trl(monkeypatch, tmp_path):
    made: list[int] = []

    def fake_asyncrl(config_path, out, env, steps, staleness=0):
        made.append(staleness)
        return {"first_step_s": 9.0, "step_s": [4.0, 4.0] if staleness == 0 else [2.5, 2.5], "train_s": [3.0, 3.0]}

    monkeypatch.setattr(bench_vs_trl, "run_asyncrl", fake_asyncrl)
    monkeypatch.setattr(bench_vs_trl, "run_trl", lambda plan, env: {
        "first_step_s": 20.0, "step_s": [10.0, 10.0], "trl": "x", "torch": "y", "torch_threads": 2})
    args = bench_vs_trl.parse(["--rounds", "2"])
    result = bench_vs_trl.compare(args, tmp_path / "c.yaml", tmp_path / "out", {}, tmp_path)
    assert made == [0, 2, 0, 2]  # interleaved with TRL, each round
    assert result["asyncrl_step_s"] == 4.0 and result["speedup"] == 2.5 and result["asyncrl_train_s"] == 3.0
    assert result["asyncrl_async"] == {"max_staleness": 2, "step_s": 2.5, "speedup": 4.0, "train_s": 3.0,
                                       "first_step_s": [9.0, 9.0]}
    made.clear()
    only_sync = bench_vs_trl.compare(bench_vs_trl.parse(["--rounds", "1", "--async-staleness", "0"]),
                                     tmp_path / "c.yaml", tmp_path / "out", {}, tmp_path)
    assert made == [0] and only_sync["asyncrl_async"] is None


def test_bench_gpu_trace_summary_counts_device_kernels_per_step(tmp_path):
    """``bench.py gpu --profile``'s summary: on a trace with a GPU track, only its kernels count
    (per decode step, ranked by time); without one (the CPU), the host's events but Python frames."""
    import gzip

    def event(pid, name, dur):
        return {"ph": "X", "pid": pid, "tid": 1, "name": name, "ts": 0, "dur": dur}

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}]
    gpu = meta + [event(7, "fusion_1", 3.0)] * 8 + [event(7, "gemm", 10.0)] * 4 + [event(1, "$loop.py:1 run", 999.0)]
    path = tmp_path / "gpu.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": gpu}, f)
    summary = bench_gpu.summarise_trace(path, steps=4)
    assert summary["events_on"] == "device" and summary["events_per_step"] == 3.0
    assert summary["event_us_per_step"] == 16.0
    assert [row["name"] for row in summary["top"]] == ["gemm", "fusion_1"] and summary["top"][0]["per_step"] == 1.0

    cpu = meta[:1] + [event(1, "dot.3", 5.0), event(1, "$threading.py:1 wait", 500.0)]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": cpu}, f)
    summary = bench_gpu.summarise_trace(path, steps=1)
    assert summary["events_on"] == "host" and [row["name"] for row in summary["top"]] == ["dot.3"]


def test_bench_gpu_comparison_child_runs_without_the_gpu_flags():
    from asyncrl.engine.platform import merge_xla_flags, xla_flags_for

    extended = merge_xla_flags("--xla_dump_to=/tmp/d", xla_flags_for("gpu"))
    assert bench_gpu.without_gpu_defaults(extended) == "--xla_dump_to=/tmp/d"


@pytest.mark.slow  # 12 s cold; the bench's pure parts are tested above
def test_bench_gpu_comparison_child_decodes_in_its_own_process():
    """The GPU-only comparison part, run here on the quick shape: a child process's decode line."""
    import argparse

    parser = argparse.ArgumentParser()
    bench_gpu.add_arguments(parser)
    args = parser.parse_args(["--quick", "--baseline-slots", "2"])
    out = bench_gpu.part_decode_without_command_buffers(args)
    assert [row["slots"] for row in out["slots"]] == [2] and out["slots"][0]["ms_per_step"] > 0, out


# --------------------------------------------------------------------------- bench.py prefix and colocated


def test_bench_prefix_counts_the_rl_steps_after_the_first_two():
    """Its figures are the cumulative counters' growth over the RL steps after the first two (an
    SFT row and the first two RL rows are not counted)."""
    def row(stage, prefill, hit, decode, seconds):
        return {"stage": stage, "engine/prefill_tokens": prefill, "engine/prefix_hit_tokens": hit,
                "engine/decode_tokens": decode, "engine/prefill_s": seconds, "engine/decode_s": 2 * seconds}

    rows = [row("sft", 5, 0, 5, 1.0), row("rl", 10, 0, 10, 2.0), row("rl", 20, 10, 20, 3.0),
            row("rl", 30, 40, 40, 4.0), row("rl", 40, 70, 60, 5.0)]
    assert bench_prefix.rl_figures(rows) == {"prefill_per_generated": 0.5, "hit_rate": 0.75,
                                             "engine_s_per_step": 3.0, "prefill_s_per_step": 1.0}
    with pytest.raises(ValueError, match="give --rl-steps > 2"):
        bench_prefix.rl_figures(rows[:3])


@pytest.mark.slow  # four training processes (40 s on 2 cores)
@pytest.mark.timeout(900)
def test_bench_prefix_smallest_run():
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench.py"), "prefix", "--runs", "agent", "--rl-steps", "3"],
                          capture_output=True, text=True, env=subprocess_env(), cwd=REPO_ROOT, timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "prefix" and result["agent_off_hit_rate"] == 0.0 and result["agent_on_hit_rate"] > 0.5
    assert result["agent_prefill_reduction"] > 1 and result["agent_engine_time_ratio"] > 0


@pytest.mark.slow  # bench-40m compiled on one device and on an 8-device mesh, in processes of their own (30 s)
@pytest.mark.timeout(900)
def test_bench_colocated_smallest_run():
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench.py"), "colocated", "--slots", "16", "--new", "4",
                           "--repeats", "1", "--layouts", "one_device", "colocated"],
                          capture_output=True, text=True, env=subprocess_env(), cwd=REPO_ROOT, timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "colocated" and result["devices"] == 8 and result["colocated_vs_one_device"] > 0
    assert result["one_device_new_tokens_per_s"] > 0 and result["colocated_new_tokens_per_s"] > 0


def test_bench_help_is_whole_and_the_readme_lists_every_subcommand():
    """``bench.py --help`` gives each subcommand's first paragraph whole (no description cut
    mid-sentence), every module of bench_components is a subcommand, and the README lists each."""
    import bench

    modules = {p.stem for p in (REPO_ROOT / "scripts" / "bench_components").glob("*.py") if p.stem != "__init__"}
    assert set(bench.SUBCOMMANDS) == modules
    listing = bench.parser().format_help()
    readme = (REPO_ROOT / "README.md").read_text()
    for name in bench.SUBCOMMANDS:
        module = __import__(f"bench_components.{name}", fromlist=["__doc__"])
        summary = " ".join(module.__doc__.split("\n\n")[0].split())
        assert summary.endswith("."), (name, summary)
        assert "".join(summary.split()[-3:]) in "".join(listing.split()), (name, summary)  # argparse wraps at hyphens
        assert f"python scripts/bench.py {name} " in readme or f"`bench.py {name}" in readme, name


def test_bench_paged_refuses_a_long_group_below_one():
    """``bench.py paged --long-group 0``: one line naming the option, exit status 1, before any engine starts."""
    proc = subprocess.run([sys.executable, "scripts/bench.py", "paged", "--parts", "long_tail", "--long-group", "0"],
                          capture_output=True, text=True, env=subprocess_env(), cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == "bench.py paged: --long-group must be at least 1 (given 0)"
