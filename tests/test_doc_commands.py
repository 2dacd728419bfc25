"""Every shell command the docs show runs here, so a documented command that fails fails a test.

The commands are read from the fenced shell blocks (```bash, ```sh, ```shell, ```console) of
README.md and docs/*.md and run as written, in a scratch directory that looks like the
repository root, with arguments appended that shorten them to seconds on the `tiny` model.
A fenced command that no chain below runs (and that `ELSEWHERE` does not account for) fails
``test_every_documented_command_is_run``: documenting a command means adding it here (or, when it
runs a Python module the docs have you save, to ``EXAMPLE_CHAINS`` in tests/test_doc_examples.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

from asyncrl.cluster.launch import free_port
from tests.helpers import REPO_ROOT, subprocess_env

SHELL_FENCES = ("bash", "sh", "shell", "console")

# Commands shortened to seconds: 2 SFT steps then 3 RL steps, a small eval, a checkpoint to resume from.
QUICKSTART_QUICK = ("--set", "stages.0.total_steps=2", "--set", "stages.1.total_steps=3", "--set", "eval.every_steps=3",
                    "--set", "eval.max_prompts=8", "--set", "checkpoint.every_steps=2")


@dataclasses.dataclass(frozen=True)
class Step:
    """One documented command, as the docs spell it, and how this test makes it quick."""

    command: str
    quick: tuple[str, ...] = ()  # appended arguments (later --set / flags win)
    swap: tuple[tuple[str, str], ...] = ()  # documented text -> local value ({port}, {tmp} filled in)
    check: Optional[Callable[[Path, str], None]] = None  # (workspace, output) -> raises when wrong
    prepare: Optional[Callable[[Path], None]] = None  # (workspace) -> sets the scene before the command
    timeout: float = 800  # seconds a subprocess command may take


def _json_line(_: Path, output: str) -> None:
    json.loads(output.strip().splitlines()[-1])


def _bench_line(name: str) -> Callable[[Path, str], None]:
    """A ``scripts/bench.py NAME`` line: its ``bench`` name and its ``load_avg`` field (``start``, ``end``)."""
    def check(_: Path, output: str) -> None:
        result = json.loads(output.strip().splitlines()[-1])
        assert result["bench"] == name and set(result["load_avg"]) == {"start", "end"}, result
    return check


def _bench_loop(ws: Path, output: str) -> None:
    """The loop-vs-alone line: every mode's figures, the other threads' CPU, the ratios and the target."""
    _bench_line("loop")(ws, output)
    result = json.loads(output.strip().splitlines()[-1])
    for mode in ("loop", "alone", "bench_train"):
        assert result[mode]["train_s"] > 0 and result[mode]["minflt"] >= 0, result
    assert result["loop"]["other_threads_cpu_s"] >= 0 and result["loop_over_bench_train"] > 0, result
    assert isinstance(result["target"]["pass"], bool) and result["steps"] == 2, result


def _bench_publish(ws: Path, output: str) -> None:
    """The publish bench's line: the adapter publish wrote fewer bytes, and the server read only them."""
    _bench_line("remote")(ws, output)
    result = json.loads(output.strip().splitlines()[-1])
    assert result["weights_dir"] == "dev-shm" and 0 < result["lora_bytes"] < result["full_bytes"], result
    assert result["server_bytes_read"]["lora"] == result["lora_bytes"] and result["lora_over_full"] > 0, result


def _exists(*paths: str) -> Callable[[Path, str], None]:
    def check(ws: Path, _: str) -> None:
        missing = [p for p in paths if not (ws / p).exists()]
        assert not missing, f"missing after the command: {missing}"
    return check


def _eval_printed_table_and_json(_: Path, output: str) -> None:
    result = json.loads(output.strip().splitlines()[-1])
    assert {"eval/reward", "eval/accuracy", "eval/n_prompts"} <= set(result), result


def _interrupt_after_step_4(ws: Path) -> None:
    """As if the run had been killed during step 5: its checkpoint never completed."""
    import shutil

    shutil.rmtree(ws / "runs/quickstart/checkpoints/step_00000005")


def _resumed(ws: Path, output: str) -> None:
    rows = [json.loads(line) for line in (ws / "runs/quickstart/metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row["step"] > 0] == [1, 2, 3, 4, 5], "resume repeated or lost a step"
    assert (ws / "runs/quickstart/checkpoints/step_00000005").is_dir()


GEMMA3_RUN = "runs/quickstart-gemma3"


def _gemma3_interrupted(ws: Path) -> None:
    """The tiny Gemma 3 run as if killed during step 5 (as :func:`_interrupt_after_step_4`)."""
    import shutil

    shutil.rmtree(ws / GEMMA3_RUN / "checkpoints/step_00000005")


def _gemma3_resumed(ws: Path, _: str) -> None:
    rows = [json.loads(line) for line in (ws / GEMMA3_RUN / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row["step"] > 0] == [1, 2, 3, 4, 5], "resume repeated or lost a step"
    assert (ws / GEMMA3_RUN / "checkpoints/step_00000005").is_dir()


def _gemma3_export_loads_in_transformers(ws: Path, _: str) -> None:
    """transformers' Gemma3ForCausalLM loads the export and gives our logits (the sliding window of 8 included)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.model import forward_jit, load_model

    hf = AutoModelForCausalLM.from_pretrained(str(ws / "runs" / "quickstart-gemma3-export"), attn_implementation="eager").eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    ours = load_model(str(ws / "runs" / "quickstart-gemma3-export"), with_tokenizer=False)
    ids = np.random.default_rng(0).integers(6, ours.config.vocab_size, size=(2, 20)).astype(np.int32)
    with torch.no_grad():
        want = hf(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    got = np.asarray(forward_jit(*ours.split(), ids)[0])
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()


def _printed_config(_: Path, output: str) -> None:
    assert re.search(r"^\s*max_staleness: 0$", output, re.M), output[-2000:]


def _sweep(_: Path, output: str) -> None:
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert [line["max_staleness"] for line in lines] == [0, 2]
    assert lines[0]["lag_max"] == 0 and lines[1]["lag_max"] <= 2 and all(line["rl_steps"] == 3 for line in lines)


def _placement_drawn(ws: Path, output: str) -> None:
    """The figure, and each layout's devices per role: 8 shared; 4 and 4; two hosts of 4 trainer
    devices, each with an engine of its own on them."""
    result = json.loads(output.strip().splitlines()[-1])
    assert (ws / "placement.png").stat().st_size > 10_000
    colocated, split, two_hosts = result["runs"].values()
    assert colocated == {"0": {"trainer": 8, "engine": 8}} and split == {"0": {"trainer": 4, "engine": 4}}, result
    assert [(host["trainer"], host["engine"]) for host in two_hosts.values()] == [(4, 4), (4, 4)], result


def _chaos(_: Path, output: str) -> None:
    result = json.loads(output.strip().splitlines()[-1])
    assert result["errors"] == [] and result["steps_missing"] == result["steps_duplicated"] == 0, result
    assert result["samples_lost"] == result["samples_trained_twice"] == 0 and result["weights_equal"] is True, result


README_CHAIN = (
    Step("asyncrl train configs/quickstart.yaml", QUICKSTART_QUICK,
         check=_exists("runs/quickstart/hf/config.json", "runs/quickstart/metrics.jsonl")),
    Step("python scripts/plot_metrics.py runs/quickstart", check=_exists("runs/quickstart/curves.png")),
    Step("asyncrl eval configs/quickstart.yaml --set model.path=runs/quickstart/hf", ("--set", "eval.max_prompts=8"),
         check=_eval_printed_table_and_json),
    Step("asyncrl export runs/quickstart runs/quickstart-export/",
         check=_exists("runs/quickstart-export/config.json", "runs/quickstart-export/model.safetensors")),
    # docs/checkpoints.md: the same run, interrupted during its last step, resumed from step 4
    Step("asyncrl train configs/quickstart.yaml --resume", QUICKSTART_QUICK, prepare=_interrupt_after_step_4,
         check=_resumed),
    Step("asyncrl train configs/quickstart.yaml --set rollout.max_staleness=0 --print-config", check=_printed_config),
)

def _peft_loads_the_adapter(ws: Path, output: str) -> None:
    """The adapter directory, and docs/lora.md's PEFT lines load it on its base (``base_dir``: the run's base)."""
    from tests.test_doc_examples import python_block

    _exists("runs/quickstart-lora-adapter/adapter_config.json", "runs/quickstart-lora-adapter/adapter_model.safetensors")(ws, output)
    names = {"base_dir": str(ws / "runs/quickstart-base/hf")}
    exec(compile(python_block("docs/lora.md", "PeftModel.from_pretrained"), "docs/lora.md", "exec"), names)
    assert type(names["model"]).__name__ == "PeftModelForCausalLM", type(names["model"])


LORA_CHAIN = (
    Step("asyncrl train configs/quickstart.yaml --set run.name=quickstart-base --set 'stages=[{name: sft, type: sft, "
         "total_steps: 20, optim: {lr: 0.003, warmup_steps: 0}}]'",
         ("--set", "stages.0.total_steps=2", "--set", "eval.max_prompts=8"), check=_exists("runs/quickstart-base/hf")),
    Step("asyncrl train configs/quickstart.yaml --set run.name=quickstart-lora --set model.path=runs/quickstart-base/hf "
         "--set 'stages=[{name: rl, type: rl, total_steps: 300}]' --set 'model.lora={rank: 8, alpha: 16}' --set optim.lr=0.01",
         ("--set", "stages.0.total_steps=2", "--set", "eval.max_prompts=8")),
    Step("asyncrl export runs/quickstart-lora runs/quickstart-lora-adapter/", check=_peft_loads_the_adapter),
    Step("asyncrl export runs/quickstart-lora runs/quickstart-lora-merged/ --merged", check=_exists("runs/quickstart-lora-merged/config.json")),
)

def _bench_rl(_: Path, output: str) -> None:
    result = json.loads(output.strip().splitlines()[-1])
    [entry] = result["entries"]
    assert entry["model"] == "tiny" and entry["max_staleness"] == 0 and entry["ttfs_s"] > 0, entry
    assert entry["trained_tokens_per_s"] > 0 and entry["generated_tokens_per_s"] > 0, entry
    share = entry["share"]
    assert share["training"] > 0 and share["eval"] > 0 and share["checkpoint"] > 0, share  # eval/checkpoint every 2


def _bench_pack(_: Path, output: str) -> None:
    """``bench.py pack``: both modes measured, the packed batch denser than the padded one."""
    _bench_line("pack")(_, output)
    result = json.loads(output.strip().splitlines()[-1])["tiny"]
    assert result["packed"]["trained_tokens_per_s"] > 0 and result["unpacked"]["trained_tokens_per_s"] > 0, result
    assert result["real_tokens_fraction_packed"] > result["real_tokens_fraction_unpacked"], result


def _bench_pack_long(_: Path, output: str) -> None:
    """``bench.py pack --lengths long``: the stated mix (median sequence under 1/8 of the budget, when
    the budget dwarfs the prompts), both modes, the target reported."""
    _bench_pack(_, output)
    result = json.loads(output.strip().splitlines()[-1])
    assert result["lengths"] == "long" and result["mix"]["budget"] == 512, result
    assert isinstance(result["tiny"]["target"]["pass"], bool) and result["tiny"]["speedup"] > 0, result


LONG_REASONING_SMOKE = (
    "asyncrl train configs/long_reasoning_grpo.yaml --set model.path=tiny-qwen3 --set model.compute_dtype=float32 "
    "--set model.remat=false --set mesh.fsdp=1 --set rollout.batch_size=2 --set rollout.group_size=4 "
    "--set rollout.max_new_tokens=384 --set rollout.length_bucket=768 --set engine.kv_capacity=768 --set engine.slots=16 "
    "--set algo.overlong_buffer=96 --set run.total_steps=3 --set eval.max_prompts=8 --set run.name=long_reasoning_cpu_smoke")


def _long_reasoning_trained(ws: Path, _: str) -> None:
    """Three packed steps by a token budget, each with its micro-batch count, the overlong penalty's reward shaping."""
    rows = [json.loads(line) for line in (ws / "runs/long_reasoning_cpu_smoke/metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if row["step"] > 0]
    assert [row["step"] for row in trained] == [1, 2, 3], rows
    assert all(row["train/micro_batches"] >= 1 and row["rollout/lag_max"] <= 4 for row in trained), trained


def _bench_accel(_: Path, output: str) -> None:
    result = json.loads(output.strip().splitlines()[-1])
    assert result["jax"] and result["device_kind"] and result["peak"]["source"] in ("table", "measured"), result
    assert result["train"]["achieved_flops_per_s"] > 0 and result["decode"]["ms_per_step"] > 0, result


def _bench_gpu(_: Path, output: str) -> None:
    """``bench.py gpu``'s quick form: one line per part, then the summary; decode against its floor."""
    lines = [json.loads(line) for line in output.splitlines() if line.startswith('{"bench": "gpu"')]
    parts = {line["part"]: line for line in lines}
    assert set(parts) == {"device", "decode", "decode_baseline", "hf_generate", "loop", "summary"}, list(parts)
    assert parts["device"]["copy_bytes_per_s"] > 0 and parts["device"]["matmul_flops_per_s"] > 0, parts["device"]
    assert [row["slots"] for row in parts["decode"]["slots"]] == [1, 4], parts["decode"]
    assert all(row["ms_per_step"] > 0 and row["floor_ms_per_step"] > 0 for row in parts["decode"]["slots"]), parts["decode"]
    assert parts["hf_generate"]["slots"][0]["engine_over_hf"] > 0, parts["hf_generate"]
    loop = parts["loop"]
    assert loop["steps"] == 2 and loop["time_to_first_step_s"] > 0 and loop["plan_total_bytes"] > 0, loop
    assert set(parts["summary"]["load_avg"]) == {"start", "end"}


def _bench_vs_trl_dry(_: Path, output: str) -> None:
    result = json.loads(output.strip().splitlines()[-1])
    assert result["dry_run"] and result["asyncrl"]["rollout"]["max_staleness"] == 0, result
    assert result["async_staleness"] == 2, result  # the asynchronous runs beside the synchronous one
    trl = result["trl"]
    assert trl["beta"] == 0.0 and trl["gradient_checkpointing"] is False and trl["lr_scheduler_type"] == "constant"
    assert trl["per_device_train_batch_size"] == 32 and trl["num_generations"] == result["asyncrl"]["rollout"]["group_size"]


def _bench_async(_: Path, output: str) -> None:
    from tests.test_perf_tools import assert_bench_async_line

    assert_bench_async_line(json.loads(output.strip().splitlines()[-1]), ["colocated"], [0, 2])


def _bench_reward_model(cwd: Path, output: str) -> None:
    _bench_line("reward_model")(cwd, output)
    result = json.loads(output.strip().splitlines()[-1])
    assert result["batch"] == 64 and result["device_samples_per_s"] > 0 and result["queue_samples_per_s"] > 0, result
    assert 1 <= result["queue_mean_batch"] <= 64, result

def _plan_within_25_percent(cwd: Path, output: str) -> None:
    """``bench.py plan``: the plan's trainer and engine figures within 25% of the measured ones."""
    _bench_line("plan")(cwd, output)
    result = json.loads(output.strip().splitlines()[-1])
    assert 0.75 <= result["trainer_ratio"] <= 1.25 and 0.75 <= result["engine_ratio"] <= 1.25, result


def _compiled_for_cpu(_: Path, output: str) -> None:
    """``asyncrl plan --target cpu``: a row per program, each with XLA's figures and a verdict."""
    rows = [line.split() for line in output.splitlines() if line.startswith("rl ")]
    assert [row[1] for row in rows] == ["train_step", "prefill", "decode_chunk"], output
    assert all("fits" in row for row in rows), output


def _bench_serve_update(_: Path, output: str) -> None:
    result = json.loads(output.strip().splitlines()[-1])
    assert result["bench"] == "serve_update" and result["serving_copies_at_peak"] < 1.5, result


PLAN_CHAIN = (
    Step("asyncrl plan configs/gsm8k_grpo.yaml --set model.path=configs/models/qwen3-1.7b --device-memory 80",
         check=lambda _, out: None if "fits" in out and "does NOT" not in out else pytest.fail(out)),
    Step("python scripts/bench.py plan --model bench-40m --set optim.micro_batches=4", ("--model", "tiny"),
         check=_plan_within_25_percent),
    # docs/performance.md "Compiled for the target": the cpu target (the GPU and TPU ones need their plugins)
    Step("asyncrl plan configs/quickstart.yaml --target cpu --devices 2",
         ("--set", "stages=[]", "--set", "rollout.batch_size=2", "--set", "engine.slots=16"), check=_compiled_for_cpu),
)

BENCH_CHAIN = (
    Step("python scripts/bench.py train", ("--models", "tiny", "--steps", "2"), check=_bench_line("train")),
    Step("python scripts/bench.py engine", ("--skip-40m", "--repeats", "1"), check=_bench_line("engine")),
    Step("python scripts/bench.py model", ("--models", "tiny", "--steps", "1"), check=_bench_line("model")),
    Step("python scripts/bench.py batch", ("--reps", "20"), check=_bench_line("batch")),
    Step("python scripts/bench.py agent", ("--episodes", "8"), check=_bench_line("agent")),
    Step("python scripts/bench.py serve_update", ("--model", "tiny"), check=_bench_serve_update),
)

def _item_trie(ws: Path, output: str) -> None:
    result = json.loads(output.strip().splitlines()[-1])
    assert result["items"] == 16 and result["max_depth"] == 4 and (ws / "runs/recommend/items.txt").is_file(), result


def _recommend_trained(ws: Path, _: str) -> None:
    rows = [json.loads(line) for line in (ws / "runs/recommend/metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "engine/logprob_gap" in row] == [3, 4, 5], rows
    assert any("eval/accuracy" in row for row in rows) and (ws / "runs/recommend/hf/config.json").is_file()


def _real_shape(_: Path, output: str) -> None:
    result = json.loads(output.strip().splitlines()[-1])
    assert result["model"]["params"] == 494_032_768 and result["steps"] == [1, 2, 3], result
    assert result["logits_max_abs_diff"] <= 1e-3 * result["logits_max_abs"], result


# docs/scaling.md "Mixture-of-experts models": GRPO on a tiny Qwen3-MoE, checkpoint, resume, export.
MOE_TRAIN = ("asyncrl train configs/quickstart.yaml --set run.name=quickstart-moe --set model.path=tiny-qwen3:experts=4 "
             "--set 'stages=[{name: rl, type: rl, total_steps: 300}]' --set algo.router_aux_loss_coef=0.01 "
             "--set algo.decoupled=true --set rollout.max_staleness=0 --set data.max_prompt_tokens=32 --set 'engine.prefill_buckets=[32]' "
             "--set engine.kv_capacity=48")
MOE_QUICK = ("--set", "stages.0.total_steps=5", "--set", "eval.every_steps=5", "--set", "eval.max_prompts=8",
             "--set", "checkpoint.every_steps=2")


def _moe_trained(ws: Path, _: str) -> None:
    """Five steps with the router terms logged and the engine's log-probs equal to the trainer's."""
    rows = [json.loads(line) for line in (ws / "runs/quickstart-moe/metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if row["step"] > 0 and "loss/router_aux" in row]
    assert [row["step"] for row in trained] == [1, 2, 3, 4, 5], rows
    assert all(row["engine/logprob_gap"] <= 1e-5 and row["train/expert_load_max"] >= 1.0 for row in trained), trained
    assert json.loads((ws / "runs/quickstart-moe/hf/config.json").read_text())["model_type"] == "qwen3_moe"


def _moe_interrupt_after_step_4(ws: Path) -> None:
    import shutil

    shutil.rmtree(ws / "runs/quickstart-moe/checkpoints/step_00000005")


def _moe_resumed(ws: Path, output: str) -> None:
    rows = [json.loads(line) for line in (ws / "runs/quickstart-moe/metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row["step"] > 0] == [1, 2, 3, 4, 5], "resume repeated or lost a step"
    assert (ws / "runs/quickstart-moe/checkpoints/step_00000005").is_dir()


MOE_CHAIN = (
    Step(MOE_TRAIN, MOE_QUICK, check=_moe_trained),
    Step(MOE_TRAIN + " --resume", MOE_QUICK, prepare=_moe_interrupt_after_step_4, check=_moe_resumed),
    Step("asyncrl export runs/quickstart-moe runs/quickstart-moe-export/",
         check=_exists("runs/quickstart-moe-export/config.json", "runs/quickstart-moe-export/model.safetensors")),
)

SLOW_CHAINS = {
    # docs/scaling.md: the tiny Qwen3-MoE run (about 2 minutes per training command here)
    "moe": MOE_CHAIN,
    # docs/models.md: a quickstart-sized Gemma 3 run (tiny in Gemma 3's layout): train, interrupt, resume, export
    "gemma3": (
        Step("asyncrl train configs/quickstart.yaml --set model.path=tiny:family=gemma3 --set run.name=quickstart-gemma3",
             QUICKSTART_QUICK, check=_exists(f"{GEMMA3_RUN}/hf/config.json", f"{GEMMA3_RUN}/checkpoints/step_00000005")),
        Step("asyncrl train configs/quickstart.yaml --set model.path=tiny:family=gemma3 --set run.name=quickstart-gemma3 "
             "--resume", QUICKSTART_QUICK, prepare=_gemma3_interrupted, check=_gemma3_resumed),
        Step("asyncrl export runs/quickstart-gemma3 runs/quickstart-gemma3-export/", check=_gemma3_export_loads_in_transformers),
    ),
    # README: the component benchmarks' quick forms, five interpreters that each compile (34 s)
    "bench": BENCH_CHAIN,
    # docs/performance.md: the Qwen2.5-0.5B-shaped run (write, 3 steps, SIGKILL, resume, eval, export;
    # about 18 GB resident at the peak and ten minutes here), as documented.
    "real_shape": (Step("python scripts/real_shape_run.py --out runs/qwen-shaped", check=_real_shape, timeout=3000),),
    # docs/decoding.md: the generative-recommendation example (trie-constrained GRPO, beam eval), quick
    "recommend": (
        Step("python scripts/make_item_trie.py --out runs/recommend/items.txt", check=_item_trie),
        Step("asyncrl train configs/recommend.yaml", QUICKSTART_QUICK, check=_recommend_trained),
    ),
    # The whole-loop and accelerator benchmarks, quick (a training run and a 494M-shaped model's
    # small twin: about a minute here).
    "bench_loop": (
        Step("python scripts/bench_rl.py", ("--quick",), check=_bench_rl),
        Step("python scripts/bench.py accel", ("--quick",), check=_bench_accel),
        # Needs TRL (the optional [compare] extra) and minutes per step: the dry form checks the two configs.
        Step("python scripts/bench_vs_trl.py", ("--dry-run",), check=_bench_vs_trl_dry),
    ),
    # docs/performance.md "On a GPU": the GPU benchmark's CPU form (tiny shape, a 2-step GSM8K loop: minutes here)
    "bench_gpu": (Step("python scripts/bench.py gpu --model-config configs/models/qwen2.5-0.5b/config.json", ("--quick",),
                       check=_bench_gpu),),
    # docs/performance.md: bench_async on tiny, colocated (its split layout runs in tests/test_perf_tools.py)
    "bench_async": (
        Step("python scripts/bench_async.py", ("--model", "tiny", "--layouts", "colocated", "--staleness", "0", "2",
                                                "--steps", "3", "--warmup", "1", "--prompts", "2", "--group", "2",
                                                "--new", "8"), check=_bench_async),
        Step("python scripts/bench_async.py --model tiny --staleness 0 2 --steps 3 --warmup 1 --prompts 2 --group 2 --new 8",
             ("--layouts", "colocated", "--staleness", "0"), check=_bench_line("async")),
    ),
    # docs/performance.md: the train step inside the loop against the same step alone, on tiny
    "bench_loop_gap": (Step("python scripts/bench.py loop", ("--model", "tiny", "--steps", "3", "--warmup", "1",
                                                             "--prompts", "2", "--group", "2", "--new", "8"),
                            check=_bench_loop),),
    # bench-40m swapped for tiny: the documented LoRA memory comparison, quick
    "lora_bench": (
        Step("python scripts/bench.py train --models bench-40m --steps 3", ("--models", "tiny", "--steps", "1"),
             check=_json_line),
        Step("python scripts/bench.py train --models bench-40m --steps 3 --lora-rank 8", ("--models", "tiny", "--steps", "1"),
             check=_json_line),
    ),
    # Three layouts, each its own 8-device subprocess (a minute here).
    "bench_placement": (Step("python scripts/bench_placement.py", ("--steps", "4"), check=_json_line),),
    # README: the engine on 8 forced devices against one, and prefix reuse on against off (four training
    # processes), their smallest forms (minutes here)
    "bench_devices_prefix": (
        Step("python scripts/bench.py colocated", ("--slots", "16", "--new", "4", "--repeats", "1"),
             check=_bench_line("colocated")),
        Step("python scripts/bench.py prefix", ("--runs", "agent", "--rl-steps", "3"), check=_bench_line("prefix")),
    ),
    # docs/performance.md "Sequence packing": packed against unpacked trained tokens/s, one small batch
    "bench_pack": (Step("python scripts/bench.py pack", ("--rows", "8", "--batches", "1", "--rounds", "1"),
                        check=_bench_pack),
                   Step("python scripts/bench.py pack --lengths long", ("--rows", "16", "--batches", "1", "--rounds", "1",
                                                                        "--budget", "512", "--micro-rows", "4"),
                        check=_bench_pack_long),),
    # docs/scaling.md "Long contexts": the long-reasoning recipe's CPU smoke run on tiny-qwen3 (GSM8K from
    # $ASYNCRL_DATA_DIR; a few minutes here)
    "long_reasoning": (Step(LONG_REASONING_SMOKE, ("--set", "eval.every_steps=0"), check=_long_reasoning_trained),),
    "bench_remote": (Step("python scripts/bench.py remote", ("--requests", "8", "--repeats", "1"),
                          check=_bench_line("remote")),),
    # docs/performance.md: reward-model scoring throughput, on the 2-layer twin
    "bench_reward_model": (Step("python scripts/bench.py reward_model", ("--quick",), check=_bench_reward_model),),
    # docs/scaling.md: rollouts with every host generating against process 0 alone, a core per process
    # docs/performance.md: the paged engine alone (no --baseline checkout), its A/B/A probe on the tiny model
    "bench_paged": (Step("python scripts/bench.py paged", ("--parts", "agent"), check=_bench_line("paged")),),
    "bench_every_host": (Step("python scripts/bench.py every_host", ("--model", "tiny", "--steps", "2", "--new", "8",
                                                                    "--rounds", "1"), check=_bench_line("every_host")),),
    # docs/scaling.md: memory per process, a 4M-parameter model as 1 and 2 processes (about a minute)
    "bench_scale": (Step("python scripts/bench_scale.py --processes 1,2 --layers 1 --hidden 128 --rows 4 --length 16 "
                         "--steps 2", check=_json_line),),
    # Two quickstart start-ups in an empty compilation cache, beside the quick loop run.
    "bench_rl_quickstart": (Step("python scripts/bench_rl.py --quickstart", ("--quick",), check=_json_line),),
    "serve": (
        Step("asyncrl serve configs/quickstart.yaml --port 30000 --weights-root /shared/run1/weights "
             "--set engine.prefill_buckets=[32]", swap=(("--port 30000", "--port {port}"),
                                                        ("/shared/run1/weights", "{tmp}/weights"))),
        # docs/remote.md "Cheaper publishes": the same server rooted in RAM (it only reads there).
        Step("asyncrl serve configs/quickstart.yaml --port 30000 --weights-root /dev/shm/run1/weights "
             "--set engine.prefill_buckets=[32]", swap=(("--port 30000", "--port {port}"),)),
    ),
    # docs/remote.md "Cheaper publishes": full publish vs LoRA adapter publish, on tiny, once.
    "bench_publish": (Step("python scripts/bench.py remote --publish-only --model bench-40m --lora-rank 8 --weights-dir /dev/shm",
                           ("--model", "tiny", "--repeats", "1"), check=_bench_publish),),
    # tiny-qwen3 with the OpenAI-SDK calculator agent: 2 SFT steps, then 2 RL steps.
    "agents_train": (
        Step("asyncrl train configs/calculator_agent.yaml", ("--set", "stages.0.total_steps=2", "--set", "stages.1.total_steps=2"),
             check=_exists("runs/calculator_agent/metrics.jsonl")),
    ),
    "staleness_sweep": (
        Step("python scripts/staleness_sweep.py", ("--staleness", "0", "2", "--set", "stages.0.total_steps=2",
                                                   "--set", "stages.1.total_steps=3", "--set", "eval.every_steps=3"),
             check=_sweep),
        # docs/staleness.md's figure, written into the workspace (docs/ there is the repository's)
        Step("python scripts/staleness_sweep.py --staleness 0 1 2 --plot docs/staleness_reward.png",
             ("--set", "stages.0.total_steps=2", "--set", "stages.1.total_steps=3", "--set", "eval.every_steps=3"),
             swap=(("docs/staleness_reward.png", "{tmp}/staleness_reward.png"),), check=_exists("staleness_reward.png")),
    ),
    # docs/scaling.md's figure: three one-step runs (8 forced devices; two processes of 4), then the drawing
    "placement_figure": (
        Step("python scripts/plot_placement.py --make-runs runs/placement -o docs/placement.png",
             swap=(("docs/placement.png", "{tmp}/placement.png"),), check=_placement_drawn),
    ),
    # docs/scaling.md: two processes on this host (process 1 in the background, then process 0)
    "multiprocess": tuple(
        Step(f"JAX_COORDINATOR_ADDRESS=127.0.0.1:12355 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID={pid} asyncrl train "
             f"configs/quickstart.yaml{' &' if pid else ''}", QUICKSTART_QUICK,
             swap=(("127.0.0.1:12355", "127.0.0.1:{mp_port}"),),
             check=None if pid else _exists("runs/quickstart/hf/config.json", "runs/quickstart/checkpoints/step_00000005"))
        for pid in (1, 0)
    ),
    # docs/scaling.md: the same two processes started by asyncrl launch
    "launch": (
        Step("asyncrl launch --nproc 2 --cpu-devices 2 -- train configs/quickstart.yaml", QUICKSTART_QUICK,
             check=_exists("runs/quickstart/hf/config.json", "runs/quickstart/checkpoints/step_00000005")),
    ),
    "chaos": (
        Step("python scripts/chaos.py configs/quickstart.yaml --kills 20 --set rollout.max_staleness=0 "
             "--set checkpoint.every_steps=20",
             ("--kills", "2", "--max-delay", "0.5", "--set", "stages.0.total_steps=2", "--set", "stages.1.total_steps=4",
              "--set", "checkpoint.every_steps=1", "--set", "eval.every_steps=0"), check=_chaos),
    ),
}

def _calculator_episode(_: Path, output: str) -> None:
    lines = output.strip().splitlines()
    assert lines[-1] == "reward 1.0  trajectories 1  trained tokens 88 of 820  splits 0", output[-2000:]
    assert [line.split()[0] for line in lines[-5:-1]] == ["masked", "trained,", "masked", "trained,"], output[-2000:]


AGENT_CHAIN = (
    Step("python docs/examples/calculator_agent.py", check=_calculator_episode),
    Step("python docs/examples/calculator_agent.py --http", check=_calculator_episode),
)

STATIC_CHECKS = (Step("ruff check asyncrl workflows scripts tests"),)  # mypy: .ci/run (a minute cold; too slow here)

# Chains in CHAINS that the default selection leaves to --runslow: over its time on the CI machine
# (tests/README.md); each command still runs here, by name.
SLOW_BY_TIME = {"agents", "lora", "plan"}

CHAINS = {"static": STATIC_CHECKS, "readme": README_CHAIN, "agents": AGENT_CHAIN, "lora": LORA_CHAIN, "plan": PLAN_CHAIN,
          **SLOW_CHAINS}

ELSEWHERE = {
    "pip install -e '.[dev]'": ".ci/run",
    "pytest": ".ci/run",
    "mypy": ".ci/run",
}
"""Documented commands this file does not run, and what runs them (checked below)."""

_AOT_PLUGIN = ("the compile-only venvs of docs/performance.md \"Compiled for the target\" (about 4 GB and 0.7 GB, kept out "
               "of the test venv); tests/run/test_plan_target.py compiles for h100 and v6e-8 where the plugin is importable "
               "and the cpu target always")
NOT_RUNNABLE_HERE = {
    "python -m venv ~/.cache/asyncrl-aot-cuda": _AOT_PLUGIN,
    "~/.cache/asyncrl-aot-cuda/bin/pip install -e '.[cuda]'": _AOT_PLUGIN,
    "~/.cache/asyncrl-aot-cuda/bin/python -m asyncrl.cli plan configs/gsm8k_grpo_qwen2.5_0.5b.yaml --set "
    "model.path=configs/models/qwen2.5-0.5b --target h100": _AOT_PLUGIN,
    "python -m venv ~/.cache/asyncrl-aot-tpu": _AOT_PLUGIN,
    "~/.cache/asyncrl-aot-tpu/bin/pip install -e '.[tpu]'": _AOT_PLUGIN,
    "~/.cache/asyncrl-aot-tpu/bin/python -m asyncrl.cli plan configs/gsm8k_grpo.yaml --set "
    "model.path=configs/models/qwen3-1.7b --set mesh.fsdp=8 --target v6e-8": _AOT_PLUGIN,
    "~/.cache/asyncrl-aot-cuda/bin/python -m asyncrl.cli plan configs/gsm8k_grpo.yaml --set "
    "model.path=configs/models/qwen3-1.7b --set mesh.fsdp=8 --target h100 --devices 8": _AOT_PLUGIN,
    "~/.cache/asyncrl-aot-cuda/bin/python -m asyncrl.cli plan configs/gsm8k_grpo.yaml --set "
    "model.path=configs/models/qwen3-8b --set mesh.fsdp=8 --target h100 --devices 8": _AOT_PLUGIN,
    "~/.cache/asyncrl-aot-tpu/bin/python -m asyncrl.cli plan configs/long_reasoning_grpo.yaml --set "
    "model.path=configs/models/qwen3-1.7b --target v6e-8": _AOT_PLUGIN,
    "~/.cache/asyncrl-aot-cuda/bin/python -m asyncrl.cli plan configs/long_reasoning_grpo.yaml --set "
    "model.path=configs/models/qwen3-1.7b --target h100 --devices 8": _AOT_PLUGIN,
    "~/.cache/asyncrl-aot-cuda/bin/python -m asyncrl.cli plan configs/long_reasoning_grpo.yaml --set "
    "model.path=configs/models/qwen3-8b --target h100 --devices 8": _AOT_PLUGIN,
    "python -m sglang.launch_server --model-path Qwen/Qwen2.5-1.5B-Instruct --host 0.0.0.0 --port 30000 "
    "--skip-tokenizer-init --weight-version 0 --api-key $ASYNCRL_API_KEY":
        "SGLang needs a GPU and is not a dependency; tests/engine/test_remote.py runs the same protocol against asyncrl serve",
    "python -u -m sgl_jax.launch_server --model-path Qwen/Qwen2.5-1.5B-Instruct --device=tpu --tp-size=4 "
    "--skip-tokenizer-init --host 0.0.0.0 --port 30000":
        "SGLang-Jax needs a TPU; tests/engine/test_remote.py runs the same protocol against asyncrl serve",
    "srun --nodes=4 --ntasks-per-node=1 asyncrl train configs/my_run.yaml --set mesh.distributed.enabled=true":
        "needs a SLURM cluster of 4 hosts; tests/cluster/test_launch.py runs processes with the same environment on loopback",
    "gcloud compute tpus tpu-vm ssh my-tpu-pod --zone=us-central2-b --worker=all --command=\"cd asyncrl && asyncrl "
    "train configs/my_run.yaml --set mesh.distributed.enabled=true\"":
        "needs a Cloud TPU pod slice; tests/cluster/test_launch.py runs processes with the same environment on loopback",
}
"""Commands the docs show that cannot run on this machine (third-party servers, clusters) or not yet."""


def documented_commands(root: Path = REPO_ROOT) -> dict[str, list[str]]:
    """Every command in a fenced shell block -> where it is shown (``file:line``).

    Continuation lines (trailing ``\\``) are joined, a leading ``$ `` and trailing comments
    are dropped, and whitespace is collapsed to single spaces."""
    found: dict[str, list[str]] = {}
    for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        text = path.read_text()
        for fence in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.S | re.M):
            if fence.group(1) not in SHELL_FENCES:
                continue
            first_line = text.count("\n", 0, fence.start(2)) + 1
            pending, start = "", first_line
            for offset, raw in enumerate(fence.group(2).splitlines()):
                line = raw.strip()
                if not pending:
                    start = first_line + offset
                if line.endswith("\\"):
                    pending += line[:-1] + " "
                    continue
                command = _normalise(pending + line)
                pending = ""
                if command:
                    found.setdefault(command, []).append(f"{path.relative_to(root)}:{start}")
    return found


def _normalise(line: str) -> str:
    line = line.removeprefix("$ ")
    lexer = shlex.shlex(line, posix=False, punctuation_chars=False)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return " ".join(lexer)


def test_every_documented_command_is_run():
    from tests.test_doc_examples import EXAMPLE_CHAINS  # the commands that run the docs' Python modules

    documented = documented_commands()
    covered = {_normalise(step.command) for chain in [*CHAINS.values(), *EXAMPLE_CHAINS.values()] for step in chain}
    covered |= set(ELSEWHERE) | {_normalise(c) for c in NOT_RUNNABLE_HERE}
    unrun = {c: where for c, where in documented.items() if c not in covered}
    assert not unrun, f"documented commands no test runs (add them to tests/test_doc_commands.py): {unrun}"
    gone = sorted(covered - set(documented))
    assert not gone, f"tests/test_doc_commands.py runs commands the docs no longer show: {gone}"
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert all(command in ci for command, runner in ELSEWHERE.items() if runner == ".ci/run")
    assert all(step.command in ci for step in STATIC_CHECKS)


def test_the_reader_finds_fenced_commands_only(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("Run `asyncrl inline` here.\n\n```bash\n$ asyncrl train a.yaml   # go\n"
                                        "python x.py --a 1 \\\n    --b '2 # 3'\n```\n\n```yaml\nkey: value\n```\n")
    (tmp_path / "docs" / "x.md").write_text("```\nasyncrl untagged\n```\n```sh\nasyncrl train a.yaml\n```\n")
    assert documented_commands(tmp_path) == {
        "asyncrl train a.yaml": ["README.md:4", "docs/x.md:5"],
        "python x.py --a 1 --b '2 # 3'": ["README.md:5"],
    }


def _chain_params():
    for name, chain in CHAINS.items():
        slow_limit = max(900, sum(step.timeout for step in chain) + 100)
        marks = [pytest.mark.slow, pytest.mark.timeout(slow_limit)] if name in SLOW_CHAINS or name in SLOW_BY_TIME \
            else [pytest.mark.timeout(600)]
        yield pytest.param(name, chain, id=name, marks=marks)


@pytest.mark.parametrize("name,chain", list(_chain_params()))
def test_documented_commands_run(name, chain, workspace, monkeypatch, capsys):
    run_chain(chain, workspace, monkeypatch, capsys)


def run_chain(chain: tuple[Step, ...], workspace: Path, monkeypatch, capsys) -> None:
    """Each step of ``chain`` as the docs show it, in ``workspace``: set the scene, run, check."""
    documented = documented_commands()
    monkeypatch.chdir(workspace)
    for step in chain:
        assert _normalise(step.command) in documented, f"{step.command!r} is no longer in the docs"
        if step.prepare is not None:
            step.prepare(workspace)
        output = _run(step, workspace, capsys)
        if step.check is not None:
            step.check(workspace, output)


def _run(step: Step, ws: Path, capsys) -> str:
    command = step.command
    for documented, local in step.swap:
        command = command.replace(documented, local.format(port=free_port(), tmp=ws, mp_port=_mp_port()))
    argv = shlex.split(command)
    background = argv[-1] == "&"
    argv = argv[:-1] + list(step.quick) if background else argv + list(step.quick)
    env_assignments = {}
    while argv and re.fullmatch(r"[A-Z_]+=.*", argv[0]):
        key, _, value = argv.pop(0).partition("=")
        env_assignments[key] = value
    if argv[0] == "asyncrl" and "JAX_PROCESS_ID" in env_assignments:
        return _process_of_a_run(argv, env_assignments, ws, background)
    if argv[:2] == ["asyncrl", "serve"]:
        return _serve(argv[1:], ws)
    if argv[0] == "asyncrl":
        from asyncrl.cli import main

        capsys.readouterr()
        code = main(argv[1:])
        printed = capsys.readouterr()
        assert code == 0, f"{command!r} exited {code}:\n{printed.out[-3000:]}\n{printed.err[-3000:]}"
        return printed.out
    assert argv[0] in ("python", "ruff"), argv
    python = [sys.executable] if argv[0] == "python" else [sys.executable, "-m", argv[0]]
    proc = subprocess.run([*python, *argv[1:]], cwd=ws, env=subprocess_env(**env_assignments),
                          capture_output=True, text=True, timeout=step.timeout)
    assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


_MP_PORT: list[int] = []
_BACKGROUND: list[subprocess.Popen] = []


def _mp_port() -> int:
    """The coordinator port of the documented multi-process run (one for all its commands)."""
    if not _MP_PORT:
        _MP_PORT.append(free_port())
    return _MP_PORT[0]


def _process_of_a_run(argv: list[str], env: dict[str, str], ws: Path, background: bool) -> str:
    """One process of a multi-process ``asyncrl train`` (its own interpreter: jax.distributed is
    per process). ``&``: started and left running; otherwise run to the end, then every
    background process must end with status 0 too."""
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", *argv[1:]], cwd=ws, env=subprocess_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if background:
        _BACKGROUND.append(proc)
        return ""
    procs = [proc, *_BACKGROUND]
    _BACKGROUND.clear()
    try:
        outputs = [p.communicate(timeout=800)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, f"{argv} (process {p.args!r}) exited {p.returncode}:\n{output[-3000:]}"
    return outputs[0]


def _serve(args: list[str], ws: Path) -> str:
    """``asyncrl serve`` until it answers one /generate, then SIGTERM: it must stop cleanly."""
    import httpx

    from asyncrl.engine import sglang_protocol as sp

    port = int(args[args.index("--port") + 1])
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=subprocess_env(), cwd=ws)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "asyncrl serve did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        answer = httpx.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
        assert len(sp.GenerateItem.model_validate(answer.json()).output_ids) == 2
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "asyncrl serve: stopped" in output, output
        return output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

