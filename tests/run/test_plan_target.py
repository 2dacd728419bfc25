"""``asyncrl plan --target``: the report of the programs compiled for the cpu target (every field
of ``--json``, the exit status), the one-line errors raised before a compiler starts, and the
GPU decode structure read from XLA's thunk sequence dumps.

The dumps under tests/fixtures/thunk_sequences are XLA's own
(``*.thunk_sequence_after_thunk_passes.txt``), written by ``asyncrl plan --target h100 --dump DIR``
(jax-cuda13-plugin 0.10.2, the engine's command-buffer flags): the GSM8K 0.5B recipe's decode
chunk (``configs/gsm8k_grpo_qwen2.5_0.5b.yaml --set model.path=configs/models/qwen2.5-0.5b``,
gzipped) and the quickstart's with ``model.path=tiny:layers=6`` and bfloat16 compute."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from asyncrl.cli import main
from asyncrl.plan.targets import plugin_installed
from asyncrl.plan.thunk_sequence import decode_structure, layer_period, parse_thunks
from tests.helpers import REPO_ROOT, subprocess_env

DUMPS = REPO_ROOT / "tests" / "fixtures" / "thunk_sequences"
QWEN_05B = gzip.decompress((DUMPS / "decode_chunk_qwen2.5-0.5b_h100.txt.gz").read_bytes()).decode()
TINY6 = (DUMPS / "decode_chunk_tiny6_h100.txt").read_text()
INNER8 = gzip.decompress((DUMPS / "decode_chunk_qwen2.5-0.5b_3layers_inner8_h100.txt.gz").read_bytes()).decode()
SMALL = ["--set", "stages=[]", "--set", "rollout.batch_size=2", "--set", "engine.slots=16"]


def test_decode_structure_of_the_05b_recipe_on_h100():
    """The issue's measurement: 407 kernels per decode step, 16 per layer (24 layers) + 23, the loop
    body in one command buffer, the while driven by the host: one round trip per token."""
    d = decode_structure(QWEN_05B, num_layers=24)
    assert d is not None
    assert (d.kernels_per_step, d.kernels_per_layer, d.kernels_outside_layers) == (407, 16, 23)
    assert d.steps_per_iteration == 1 and d.host_round_trips_per_token == 1.0
    assert d.body_in_command_buffer and not d.while_in_command_buffer and d.condition_kernels == 2
    assert d.kernels_outside_loop == 10  # copies and fusions before the loop, in a command buffer of their own


def test_decode_structure_of_eight_steps_per_iteration_with_the_decode_attention_kernel():
    """Qwen2.5-0.5B's shape at 3 layers with engine.decode_inner_steps 8 and the Pallas decode
    attention kernel: 8 steps per loop iteration, 10 kernels per layer, one host round
    trip per 8 tokens. Few layers and many steps: the kernels repeated most often by name are a
    pair outside the layers, not the layers' (the steps are read from the launches they cover)."""
    d = decode_structure(INNER8, num_layers=3)
    assert d is not None and d.steps_per_iteration == 8 and d.host_round_trips_per_token == 0.125
    assert (d.kernels_per_step, d.kernels_per_layer, d.kernels_outside_layers) == (49, 10, 19)
    assert d.body_in_command_buffer and not d.while_in_command_buffer


def test_decode_structure_of_a_tiny_model_and_the_loop_variants():
    d = decode_structure(TINY6, num_layers=6)
    assert d is not None and (d.kernels_per_step, d.kernels_per_layer, d.kernels_outside_layers) == (107, 14, 23)
    body = [t for t in parse_thunks(TINY6) if t.is_kernel and t.in_while_body]
    assert len(body) == 107 and all(t.path == ("kWhile/body", "kCommandBuffer") for t in body)
    assert layer_period([t.name for t in body], 6) == 14
    # The same loop inside a command buffer (a CUDA graph conditional node): no round trip per token.
    nested = "000: kCommandBuffer [source | sink]\n" + "\n".join("    " + line for line in TINY6.splitlines())
    inside = decode_structure(nested, num_layers=6)
    assert inside is not None and inside.while_in_command_buffer and inside.host_round_trips_per_token == 0.0
    # The body unrolled once (two steps per iteration): kernels per step unchanged, half a round trip per token.
    lines = TINY6.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "body:") + 2  # past the command buffer line
    unrolled = "\n".join(lines[:start] + lines[start:] * 2)
    twice = decode_structure(unrolled, num_layers=6)
    assert twice is not None and twice.steps_per_iteration == 2 and twice.kernels_per_step == 107
    assert twice.host_round_trips_per_token == 0.5
    assert decode_structure("000: kCustomKernel [source | sink] loop_add_fusion grid: [1, 1, 1]", 6) is None


def _plan_json(*args: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "plan", "configs/quickstart.yaml", *SMALL, *args, "--json"],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.timeout(600)  # a process of its own and three compiles: 15-20 s on a quiet machine, minutes under load
def test_cpu_target_reports_every_program_as_json():
    """The one test of the whole path: a process of its own compiles the train step, the prefill
    bucket and the decode chunk of a tiny config for the cpu target, one JSON line each, then the
    stage's device total (both sides' resident state and the larger transient)."""
    rows = _plan_json("--target", "cpu", "--devices", "2")
    assert [r["program"] for r in rows] == ["train_step", "prefill", "decode_chunk", "device_total"]
    *rows, total = rows
    for r in rows:
        assert r["stage"] == "rl" and r["target"] == "cpu" and r["devices"] == 2 and r["fits"] and r["compile_s"] > 0
        assert r["xla_peak_bytes"] == r["xla_argument_bytes"] + r["xla_output_bytes"] - r["xla_alias_bytes"] + r["xla_temp_bytes"]
        assert r["xla_argument_bytes"] > 0 and r["plan_bytes"] > 0
        assert 0 < r["xla_reported_peak_bytes"] <= r["xla_peak_bytes"] + r["xla_alias_bytes"]  # XLA's own, by live ranges
    assert rows[0]["detail"] == "16 x 24 rows, window 24" and "kernels_per_step" not in rows[2]  # no thunk dump on the CPU
    assert rows[0]["attention"] == rows[1]["attention"] == ["xla dense mask"]  # the train step's and the prefill's kernel
    # Colocated: the train step's and the engine's arguments are resident together, and the
    # larger of the programs' transients (what each adds to its arguments) comes on top of them.
    assert total["stage"] == "rl" and total["fits"] and total["plan_bytes"] > 0
    assert total["xla_temp_bytes"] == max(r["xla_peak_bytes"] - r["xla_argument_bytes"] for r in rows)
    assert total["xla_argument_bytes"] > max(r["xla_argument_bytes"] for r in rows)
    assert total["xla_peak_bytes"] == total["xla_argument_bytes"] + total["xla_temp_bytes"]


@pytest.mark.skipif(not plugin_installed("gpu"), reason="jax's CUDA plugin is not installed (tests/README.md: the aot venv)")
@pytest.mark.timeout(900)
def test_h100_target_compiles_and_reads_the_decode_structure():
    """With bfloat16 compute (the GPU default): the publish cast too; the decode chunk's launch
    structure from XLA's dump, compiled with the engine's command-buffer flags."""
    rows = _plan_json("--target", "h100", "--set", "model.param_dtype=float32")
    assert [r["program"] for r in rows] == ["train_step", "prefill", "decode_chunk", "publish", "device_total"]
    decode = rows[2]
    assert decode["kernels_per_step"] == decode["kernels_per_layer"] * 2 + decode["kernels_outside_layers"], decode
    # engine.decode_inner_steps: auto is 8 steps per loop iteration on GPUs, so one host round trip per 8 tokens
    assert decode["kernels_per_layer"] > 5 and decode["steps_per_iteration"] == 8 and decode["body_in_command_buffer"], decode
    assert decode["host_round_trips_per_token"] in (0.0, 0.125) and all(r["fits"] and r["devices"] == 1 for r in rows)


@pytest.mark.skipif(not plugin_installed("gpu"), reason="jax's CUDA plugin is not installed (tests/README.md: the aot venv)")
@pytest.mark.timeout(900)
def test_eight_h100s_with_fsdp_compile_the_cudnn_train_step():
    """cuDNN's partitioner refuses q and GQA's k/v sharded differently, which XLA's propagation gave
    them under fsdp: the train step of every multi-GPU fsdp run was rejected before q, k and v were
    laid out alike (asyncrl/model/attention.py)."""
    rows = _plan_json("--target", "h100", "--devices", "8", "--set", "mesh.fsdp=8", "--set", "model.param_dtype=float32")
    assert [r["program"] for r in rows] == ["train_step", "prefill", "decode_chunk", "publish", "device_total"]
    assert all(r["devices"] == 8 and r["fits"] for r in rows)


@pytest.mark.skipif(not plugin_installed("tpu"), reason="libtpu is not installed (tests/README.md: the aot venv)")
@pytest.mark.timeout(900)
def test_v6e_8_target_compiles_on_the_config_mesh():
    rows = _plan_json("--target", "v6e-8", "--set", "mesh.fsdp=8")
    assert [r["program"] for r in rows] == ["train_step", "prefill", "decode_chunk", "publish", "device_total"]
    assert all(r["devices"] == 8 and r["fits"] and r["xla_peak_bytes"] > 0 for r in rows)
    assert "kernels_per_step" not in rows[2]  # thunk sequences are XLA:GPU's


@pytest.mark.skipif(not plugin_installed("tpu"), reason="libtpu is not installed (tests/README.md: the aot venv)")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("target, chips", [("v6e-32", 32), ("v5p-32", 16)])
def test_a_multi_host_target_compiles_each_hosts_engine_and_the_publish_across_hosts(target, chips):
    """Every host of a v6e-32 (8 hosts of 4 chips) or v5p-32 (4 hosts of 4) runs an engine of its own:
    its decode chunk compiled for one host's chips (libtpu compiles nothing over a part of a larger
    compile-only slice), the publish as the one collective over every chip onto every host's engine."""
    rows = _plan_json("--target", target, "--program", "decode_chunk", "--program", "publish")
    assert [r["program"] for r in rows] == ["decode_chunk", "publish"], rows
    assert all(r["devices"] == chips and r["fits"] and r["xla_peak_bytes"] > 0 for r in rows)
    assert "collective layout programs onto every host's engine" in rows[1]["detail"]


@pytest.mark.parametrize("args, message", [
    (["--target", "h800"], "--target 'h800': no such target; known: h100, a100-80gb, h200, l4, v4-8"),
    (["--target", "v6e-8", "--devices", "4"], "--target v6e-8 is 8 chips on 1 host(s); --devices/--processes cannot change"),
    (["--target", "cpu", "--devices", "3"], "--target cpu (3 devices): placement.trainer: mesh.fsdp x mesh.tensor = 2 x 1 does not divide the 3"),
    (["--target", "cpu", "--xla"], "--xla: not with --target"),
    (["--target", "cpu", "--program", "decode"],
     "--program decode: no such program; known: train_step, critic_step, prefill, decode_chunk, beam_search, publish"),
    (["--program", "decode_chunk"], "--program: only with --target NAME or --xla"),
])
def test_one_line_errors_before_any_compile(args, message, capsys):
    extra = ["--set", "mesh.fsdp=2"] if "3" in args else []
    assert main(["plan", "configs/quickstart.yaml", *SMALL, *extra, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 2  # "asyncrl: config error:" and the line


@pytest.mark.timeout(600)
@pytest.mark.slow  # every program of the cpu target stays in the default selection
def test_program_compiles_only_the_programs_named():
    rows = _plan_json("--target", "cpu", "--program", "decode_chunk", "--program", "prefill")
    assert [r["program"] for r in rows] == ["prefill", "decode_chunk"]  # no train step: no device total either
    # One device, weights stored wider than they are computed in: the publish is their cast.
    [cast] = _plan_json("--target", "cpu", "--program", "publish", "--set", "model.compute_dtype=bfloat16")
    assert cast["program"] == "publish" and cast["devices"] == 1 and 0 < cast["xla_output_bytes"] < cast["xla_argument_bytes"]


def test_json_without_a_target_is_the_device_total_of_each_stage(capsys):
    """``--json`` without ``--target``: the formulas' device total, one object per stage, each
    side's resident and temporary bytes adding up to it (colocated: both residents, the larger
    temporary)."""
    assert main(["plan", "configs/quickstart.yaml", *SMALL, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["program"], r["stage"]) for r in rows] == [("device_total", "rl")]
    total = rows[0]
    assert total["colocated"] and total["fits"] is None  # no target: no memory to fit
    assert total["plan_bytes"] == (total["plan_trainer_resident_bytes"] + total["plan_engine_resident_bytes"]
                                   + max(total["plan_trainer_temporary_bytes"], total["plan_engine_temporary_bytes"]))


def test_a_measuring_compile_the_target_rejects_is_one_line(monkeypatch):
    """``auto``'s measuring compiles (plan_auto.run_peak) fail like the report's own: one line
    naming what compiled and the compiler's first line (seen: libtpu refusing host 0's 4 chips of
    a v6e-32 engine), not a traceback."""
    import asyncrl.plan.auto as plan_auto
    from asyncrl.errors import ConfigError
    from asyncrl.plan.target import compile_and_print

    def rejected(*args, **kwargs):
        raise RuntimeError("INTERNAL: RET_CHECK failure device_id < kMaxDeviceCount\nError encountered while compiling ...")

    monkeypatch.setattr(plan_auto, "resolve_for_target", rejected)
    with pytest.raises(ConfigError) as info:
        compile_and_print("configs/quickstart.yaml", SMALL[1::2], "cpu", 1, None, True, None)
    (line,) = info.value.problems
    assert line.startswith("model.remat_policy / model.logprob_chunk_size: auto (its measuring compile): rejected for "
                           "--target cpu (RuntimeError: INTERNAL: RET_CHECK failure")
    assert line.endswith("or set both explicitly")


@pytest.mark.slow  # two train-step compiles; the cpu JSON test guards the path
def test_lora_train_step_compiles_with_its_frozen_base():
    """``model.lora``: the step takes the adapters as its parameters and the base as frozen, as the
    trainer does; its arguments are far below full fine-tuning's (no optimizer state for the base)."""
    import jax

    from asyncrl.config import load_config
    from asyncrl.plan.compiled import compile_lowered, lower_train_step
    from asyncrl.plan.formulas import stage_decoder_config

    overrides = ["stages=[]", "rollout.batch_size=2"]
    memory = {}
    for name, extra in (("full", []), ("lora", ["model.lora={rank: 4, alpha: 8, dropout: 0.1}"])):
        cfg = load_config(REPO_ROOT / "configs" / "quickstart.yaml", [*overrides, *extra])
        lowered = lower_train_step(cfg, stage_decoder_config(cfg, backend="cpu"), jax.devices()[:1], (16, 24, 8))
        memory[name] = compile_lowered(lowered)[0]
    assert 0 < memory["lora"].arguments < 0.6 * memory["full"].arguments, memory
