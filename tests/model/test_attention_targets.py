"""``model.attention: auto`` compiled for accelerator targets on this CPU (asyncrl/model/attention.py):
the train step compiled for a compile-only H100 runs cuDNN's flash attention with no ``[T, T]``
mask operand, and for a v6e-8 splash attention (a Mosaic kernel), each with less XLA memory
than ``model.attention: xla`` in the same run. Skipped unless jax's CUDA plugin / libtpu are
importable (the aot venvs of tests/README.md: ``JAX_PLATFORMS=cpu ~/.cache/asyncrl-aot-cuda/bin/python -m pytest ...``).
The recipes' own figures (the 0.5B recipe on h100, Qwen3-1.7B fsdp 8 on v6e-8) are docs/benchmarks.md's."""

from __future__ import annotations

import re

import pytest

from asyncrl.config import load_config
from asyncrl.model.attention import kernels_seen
from asyncrl.model.tiny import TinySpec, tiny_decoder_config
from asyncrl.plan.compiled import CompiledMemory, lower_train_step
from asyncrl.plan.targets import get_target, plugin_installed, target_devices
from tests.helpers import REPO_ROOT

LENGTH = 256  # distinct from every model dimension, so a [T, T] operand is recognisable


def compiled(target: str, devices: int, attention: str, fsdp: int = 1, pack: bool = False) -> tuple[str, int, set[str]]:
    """The optimized HLO text, XLA peak bytes and the kernels taken (by name) of a tiny bfloat16
    model's train step (16 rows of LENGTH tokens, 2 micro-batches, remat, scanned layers; ``pack``:
    packed rows of at most 4 sequences) compiled for ``target``."""
    model_cfg = tiny_decoder_config(TinySpec(layers=2)).replace(
        compute_dtype="bfloat16", remat=True, scan_layers=True, attention=attention)
    cfg = load_config(data={"rollout": {"batch_size": 4, "group_size": 4, "max_seq_len": LENGTH, "max_new_tokens": 128,
                                        "pack": pack, "pack_max_segments": 4},
                            "data": {"max_prompt_tokens": 128},
                            "optim": {"micro_batches": 2}, "mesh": {"fsdp": fsdp}})
    with kernels_seen() as seen:
        lowered = lower_train_step(cfg, model_cfg, target_devices(get_target(target), devices), (16, LENGTH, LENGTH))
    executable = lowered.compile()
    stats = executable.memory_analysis()
    peak = CompiledMemory(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
                          int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes)).peak
    return executable.as_text(), peak, seen


def kernel_operands(text: str, marker: str) -> list[str]:
    """The operand lists of the custom calls whose line contains ``marker``."""
    return [line.split("custom-call(", 1)[1] for line in text.splitlines() if marker in line and "custom-call(" in line]


@pytest.mark.skipif(not plugin_installed("gpu"), reason="jax's CUDA plugin is not installed (tests/README.md: the aot venv)")
@pytest.mark.timeout(900)  # two compiles for the target: seconds alone, minutes beside other work
def test_h100_train_step_runs_cudnn_flash_attention_without_a_dense_mask():
    text, peak, seen = compiled("h100", 1, "auto")
    operands = kernel_operands(text, "__cudnn$fmha")
    assert operands and any("Backward" in line for line in text.splitlines() if "__cudnn$fmha" in line)
    assert not [o for o in operands if re.search(rf"\[[0-9,]*{LENGTH},{LENGTH}\]", o)]  # no [.., T, T] mask or bias
    assert seen == {"cudnn row lengths"}
    xla_text, xla_peak, _ = compiled("h100", 1, "xla")
    assert "__cudnn$fmha" not in xla_text and peak < xla_peak


@pytest.mark.skipif(not plugin_installed("gpu"), reason="jax's CUDA plugin is not installed (tests/README.md: the aot venv)")
@pytest.mark.timeout(900)
def test_h100_packed_train_step_runs_cudnn_packed_layout_without_a_dense_mask():
    """Packed rows reach cuDNN as segment offsets (its softmax statistics per cuDNN segment: the
    rows x (4 sequences + the padding run)), no ``[T, T]`` operand, less memory than the dense bias."""
    text, peak, seen = compiled("h100", 1, "auto", pack=True)
    assert seen == {"cudnn packed layout"}
    calls = [line for line in text.splitlines() if "__cudnn$fmha" in line and "custom-call(" in line]
    assert calls and not [c for c in calls if re.search(rf"\[[0-9,]*{LENGTH},{LENGTH}\]", c.split("custom-call(", 1)[1])]
    assert any(re.search(rf"f32\[{8 * 5},[0-9]+,{LENGTH}\]", c) for c in calls)  # 8 rows per micro-batch x 5 segments
    xla_text, xla_peak, _ = compiled("h100", 1, "xla", pack=True)
    assert peak < xla_peak
    # On 8 GPUs with fsdp 8 each device runs the kernel on its own row (cuDNN's partitioner): 1 x 5 segments.
    sharded, _, seen = compiled("h100", 8, "auto", fsdp=8, pack=True)
    assert seen == {"cudnn packed layout"} and re.search(rf"f32\[5,[0-9]+,{LENGTH}\]", sharded)


@pytest.mark.skipif(not plugin_installed("tpu"), reason="libtpu is not installed (tests/README.md: the aot venv)")
@pytest.mark.timeout(900)
def test_v6e_train_step_runs_splash_attention_per_chip():
    text, peak, seen = compiled("v6e-8", 8, "auto", fsdp=8)
    operands = kernel_operands(text, "tpu_custom_call")
    assert operands and "splash" in text
    assert not [o for o in operands if re.search(rf"\[[0-9,]*{LENGTH},{LENGTH}\]", o)]
    assert seen == {"splash"}
    xla_text, xla_peak, _ = compiled("v6e-8", 8, "xla", fsdp=8)
    assert "tpu_custom_call" not in xla_text and peak < xla_peak
    packed_text, _, packed_seen = compiled("v6e-8", 8, "auto", fsdp=8, pack=True)
    assert packed_seen == {"splash segment ids"} and "splash" in packed_text


@pytest.mark.skipif(not plugin_installed("tpu"), reason="libtpu is not installed (tests/README.md: the aot venv)")
@pytest.mark.timeout(900)
def test_v6e_decode_chunk_attends_through_ragged_paged_attention_per_layer():
    """The quickstart's decode chunk compiled for a v6e-8 (8 engine replicas) on a tiny model with
    heads of 128 (whole lane tiles): each layer's attention over the page pool is a TPU kernel
    (JAX's ragged paged attention), not XLA's einsum."""
    from asyncrl.cluster.placement import resolve_placement
    from asyncrl.plan.compiled import engine_args, lower_decode_chunk
    from asyncrl.plan.formulas import stage_decoder_config

    cfg = load_config(REPO_ROOT / "configs" / "quickstart.yaml", ["stages=[]", "rollout.batch_size=2", "engine.slots=16", "mesh.fsdp=8",
                                                                   "model.path=tiny:hidden=256,heads=2,kv_heads=2"])
    flat = next(flat for _, flat in cfg.stage_configs())
    model_cfg = stage_decoder_config(flat, backend="tpu")
    placement = resolve_placement(flat, target_devices(get_target("v6e-8"), 8), 1)
    text = lower_decode_chunk(flat, engine_args(flat, model_cfg, placement, "tpu")).compile().as_text()
    kernels = [line for line in text.splitlines() if "custom-call(" in line and "tpu_custom_call" in line]
    assert len(kernels) == model_cfg.num_layers and all("ragged_paged_attention" in k for k in kernels), kernels[:2]
