"""scripts/bench_scale.py: its shapes and process environments, and end to end on a tiny model (one
JSON line with every figure, 1 and 2 processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, subprocess_env

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import bench_scale  # noqa: E402


def _args(*argv: str):
    return bench_scale.parser().parse_args(list(argv))


def test_model_config_reads_a_hugging_face_config_json():
    shape = bench_scale.model_config(_args("--model-config", "configs/models/qwen2.5-0.5b/config.json"))
    assert shape.num_params() == 494_032_768  # Qwen2.5-0.5B's own count
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads) == (24, 896, 14, 2)
    default = bench_scale.model_config(_args())
    assert (default.num_layers, default.hidden_size) == (10, 1024) and default.num_params() > 150_000_000


def test_a_model_config_that_is_not_json_is_named_before_any_process_starts(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("not json")
    monkeypatch.setattr(sys, "argv", ["bench_scale.py", "--model-config", str(bad)])
    with pytest.raises(SystemExit) as exit_info:
        bench_scale.main()
    assert exit_info.value.code == 2
    assert f"--model-config: {bad}: cannot read it as JSON" in capsys.readouterr().err


def test_process_env_gives_each_process_its_devices_and_the_coordinator():
    cpu = bench_scale.process_env(_args("--devices", "3"), 2, 1, 4321)
    assert cpu["JAX_PLATFORMS"] == "cpu" and cpu["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
    assert (cpu["JAX_COORDINATOR_ADDRESS"], cpu["JAX_NUM_PROCESSES"], cpu["JAX_PROCESS_ID"]) == ("127.0.0.1:4321", "2", "1")
    gpu = bench_scale.process_env(_args("--platform", "gpu"), 1, 0, 4321)
    assert gpu["JAX_PLATFORMS"] == "cuda" and gpu["CUDA_VISIBLE_DEVICES"] == "0"
    assert "XLA_FLAGS" not in gpu and "JAX_COORDINATOR_ADDRESS" not in gpu  # one process: no coordinator


@pytest.mark.slow  # two multi-process runs of a 4M-parameter model: about a minute on a busy 2-core machine
@pytest.mark.timeout(900)
def test_bench_scale_prints_one_line_with_every_figure(tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/bench_scale.py", "--processes", "1,2", "--layers", "1", "--hidden", "128",
         "--rows", "4", "--length", "16", "--steps", "2", "--out", str(tmp_path)],
        cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    assert [run["processes"] for run in result["runs"]] == [1, 2]
    assert result["model"]["params"] > 4_000_000
    for run in result["runs"]:
        n = run["processes"]
        assert run["bound_mb"] == pytest.approx(1.25 * run["state_mb"] / n, abs=0.1)
        for phase in ("train_step", "save", "restore", "publish"):
            assert len(run["peak_above_baseline_mb"][phase]) == n
        assert run["step_time_s"] > 0 and run["step_time_save_in_flight_s"] > 0 and run["publish_s"] > 0
        assert sum(run["publish_mb_written"]) > 0 and len(run["publish_mb_written"]) == n
        assert isinstance(run["save_restore_memory_ok"], bool) and isinstance(run["save_in_flight_ok"], bool)
    assert result["ok"] == all(r["save_restore_memory_ok"] and r["save_in_flight_ok"] for r in result["runs"])
    assert list(tmp_path.iterdir()) == []  # its working directory is removed
