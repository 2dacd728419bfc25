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
from asyncrl.run.thunk_sequence import decode_structure, layer_period, parse_thunks
from tests.helpers import REPO_ROOT, subprocess_env

DUMPS = REPO_ROOT / "tests" / "fixtures" / "thunk_sequences"
QWEN_05B = gzip.decompress((DUMPS / "decode_chunk_qwen2.5-0.5b_h100.txt.gz").read_bytes()).decode()
TINY6 = (DUMPS / "decode_chunk_tiny6_h100.txt").read_text()
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


def test_cpu_target_reports_every_program_as_json():
    """The one test of the whole path: a process of its own compiles the train step, the prefill
    bucket and the decode chunk of a tiny config for the cpu target, one JSON line each."""
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "plan", "configs/quickstart.yaml", *SMALL, "--target", "cpu",
                           "--devices", "2", "--json"], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["program"] for r in rows] == ["train_step", "prefill", "decode_chunk"]
    for r in rows:
        assert r["stage"] == "rl" and r["target"] == "cpu" and r["devices"] == 2 and r["fits"] and r["compile_s"] > 0
        assert r["xla_peak_bytes"] == r["xla_argument_bytes"] + r["xla_output_bytes"] - r["xla_alias_bytes"] + r["xla_temp_bytes"]
        assert r["xla_argument_bytes"] > 0 and r["plan_bytes"] > 0
    assert rows[0]["detail"] == "16 x 24 rows, window 24" and "kernels_per_step" not in rows[2]  # no thunk dump on the CPU


@pytest.mark.parametrize("args, message", [
    (["--target", "h800"], "--target 'h800': no such target; known: h100, a100-80gb, h200, l4, v4-8"),
    (["--target", "v6e-8", "--devices", "4"], "--target v6e-8 is 8 chips on 1 host(s); --devices/--processes cannot change"),
    (["--target", "cpu", "--devices", "3"], "--target cpu (3 devices): placement.trainer: mesh.fsdp x mesh.tensor = 2 x 1 does not divide the 3"),
    (["--target", "cpu", "--xla"], "--xla: not with --target"),
    (["--json"], "--json: only with --target NAME"),
])
def test_one_line_errors_before_any_compile(args, message, capsys):
    extra = ["--set", "mesh.fsdp=2"] if "3" in args else []
    assert main(["plan", "configs/quickstart.yaml", *SMALL, *extra, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 2  # "asyncrl: config error:" and the line
