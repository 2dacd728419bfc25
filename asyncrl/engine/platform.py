"""Per-platform choices of the engine: XLA flags that only GPUs take, and the sampler.

Each choice is one function of the platform name (``cpu``, ``gpu``, ``tpu``), so that what a
GPU would get is testable on a machine without one.

XLA flags (:func:`xla_flags_for`, applied by :func:`apply_platform_xla_flags`)
    On a GPU a decode step is a few hundred small kernels; launched one by one their fixed
    cost dominates a small model's step (on an H100 at Qwen2.5-0.5B's shape: 6-8 ms per step
    whatever the slot count).
    XLA's command buffers (CUDA graphs) record a program's kernels once and replay them with
    one launch; by default they do not cover ``while`` loops and conditionals, which is what a
    decode chunk is (``lax.while_loop`` over steps), so the GPU flags add ``WHILE`` and
    ``CONDITIONAL`` to the command-buffer types. XLA reads ``XLA_FLAGS`` once, when the first
    backend starts, so the flags are set in the environment before that; flags the user set
    in ``XLA_FLAGS`` win. No flag is added on the CPU or a TPU.

Decode steps per loop iteration (:func:`resolve_inner_steps`, ``engine.decode_inner_steps``)
    The command buffer records the decode loop's body, but not the ``while`` loop itself (its trip
    count is not known: the chunk ends early for refills), so on a GPU every iteration ends with
    the loop's predicate copied to the host, which launches the next body. ``auto`` runs
    :data:`GPU_INNER_STEPS` decode steps per iteration there (one host round trip per 8 tokens,
    unrolled into one command buffer of about 8 x 250 kernels at Qwen2.5-0.5B shape); on the CPU
    and TPUs the loop runs without the host, and 1 keeps the program small and the early exit
    exact to the step.

Sampler (:func:`resolve_sampler`, ``engine.sampler``)
    ``inverse_cdf``: the two-level inverse CDF of
    :func:`~asyncrl.engine.jax_programs._sample`, one uniform per slot (tuned for
    XLA:CPU, where random bits are most of a sampling step); ``gumbel``: the Gumbel-max
    trick, ``argmax(scaled + Gumbel noise)``, one pass over ``[slots, vocab]`` that a GPU
    fuses into one reduction kernel. Both draw exactly from ``softmax(logits / T)``, but from
    different random numbers: a seed's tokens depend on the sampler (the log-probs of a
    given token do not). ``auto``: ``inverse_cdf`` on the CPU, ``gumbel`` elsewhere.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Mapping, MutableMapping, Optional, Union

logger = logging.getLogger("asyncrl.engine")

SAMPLERS = ("inverse_cdf", "gumbel")

COMMAND_BUFFER_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "WHILE", "CONDITIONAL")
"""What XLA:GPU records into command buffers under :func:`xla_flags_for`: its default types plus
``WHILE`` and ``CONDITIONAL`` (a decode chunk's loop and its early exit)."""

GPU_INNER_STEPS = 8
"""``engine.decode_inner_steps: auto`` on GPUs: one host round trip per this many tokens."""

_CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def xla_flags_for(platform: str) -> list[str]:
    """The ``XLA_FLAGS`` entries asyncrl adds on ``platform`` (``cpu``, ``gpu``, ``tpu``): the
    command-buffer types on a GPU, none elsewhere."""
    if platform != "gpu":
        return []
    return ["--xla_gpu_enable_command_buffer=" + ",".join(COMMAND_BUFFER_TYPES)]


def merge_xla_flags(existing: str, added: list[str]) -> str:
    """``existing`` (an ``XLA_FLAGS`` value) with each flag of ``added`` appended unless the same
    flag name is already there (the user's setting wins)."""
    present = {flag.split("=", 1)[0] for flag in existing.split()}
    extra = [flag for flag in added if flag.split("=", 1)[0] not in present]
    return " ".join([*existing.split(), *extra])


def expected_platform(env: Mapping[str, str]) -> str:
    """The platform jax will start on, guessed without starting a backend (which would read
    ``XLA_FLAGS`` too early): ``JAX_PLATFORMS``' first entry when set, else ``gpu`` when a CUDA
    plugin is installed, else ``cpu``. Only decides which flags to add: a wrong ``gpu`` guess on
    a CUDA image without a GPU adds flags the CPU backend ignores."""
    chosen = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if chosen:
        return "gpu" if chosen in ("cuda", "rocm", "gpu") else chosen
    for name in _CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return "gpu"
        except ModuleNotFoundError:  # a parent package (jax_plugins) is absent
            continue
    return "cpu"


def apply_platform_xla_flags(env: Optional[MutableMapping[str, str]] = None) -> list[str]:
    """Add :func:`xla_flags_for` the expected platform to ``env['XLA_FLAGS']`` (default
    ``os.environ``); returns the flags added. Call it before jax starts a backend (the CLI does,
    before training or evaluating); ``ASYNCRL_XLA_PLATFORM_FLAGS=0`` turns it off."""
    env = os.environ if env is None else env
    if env.get("ASYNCRL_XLA_PLATFORM_FLAGS", "1") == "0":
        return []
    existing = env.get("XLA_FLAGS", "")
    merged = merge_xla_flags(existing, xla_flags_for(expected_platform(env)))
    added = merged.split()[len(existing.split()):]
    if added:
        env["XLA_FLAGS"] = merged
        logger.info("XLA_FLAGS for this platform: %s", " ".join(added))
    return added


def resolve_sampler(choice: str, platform: str) -> str:
    """``engine.sampler`` on ``platform``: ``auto`` is ``inverse_cdf`` on the CPU (measured faster
    there) and ``gumbel`` on accelerators (one fused pass); an explicit choice is kept."""
    if choice == "auto":
        return "inverse_cdf" if platform == "cpu" else "gumbel"
    if choice not in SAMPLERS:
        raise ValueError(f"engine.sampler: {choice!r} is not one of auto, {', '.join(SAMPLERS)}")
    return choice


def resolve_inner_steps(choice: Union[int, str], platform: str) -> int:
    """``engine.decode_inner_steps`` on ``platform``: ``auto`` is :data:`GPU_INNER_STEPS` on a GPU
    (``gpu``/``cuda``/``rocm``), 1 elsewhere; a number is kept."""
    if choice == "auto":
        return GPU_INNER_STEPS if platform in ("gpu", "cuda", "rocm") else 1
    if not isinstance(choice, int) or choice < 1:
        raise ValueError(f"engine.decode_inner_steps: {choice!r} is not auto or a count >= 1")
    return choice
