"""JAX's persistent compilation cache for runs: a second run loads its programs from disk.

Compiling the train step and the engine's programs is most of a run's start-up on a small
model. With the cache on (``run.compile_cache: true``, the default) XLA's executables are
written under the user's cache directory and a later run with the same shapes, config and
jax version loads them instead of compiling again. Where the cache lives, first match wins:

1. a directory already configured in JAX: ``$JAX_COMPILATION_CACHE_DIR`` (JAX's own variable:
   the user's or the test suite's choice) or ``jax.config.update("jax_compilation_cache_dir", ...)``
   in the user's code before :func:`asyncrl.run.loop.train`;
2. ``$ASYNCRL_CACHE_DIR/jax``, else ``$XDG_CACHE_HOME/asyncrl/jax``, else ``~/.cache/asyncrl/jax``
   (:func:`asyncrl.model.tiny.default_cache_dir`, beside the built ``tiny`` models).

Off: ``run.compile_cache: false`` or ``ASYNCRL_COMPILE_CACHE=0`` in the environment (the
variable wins over the config, so one run can be made cold without editing its YAML).
JAX's size and compile-time thresholds are lowered to zero unless set in the environment
(``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``, ``..._MIN_ENTRY_SIZE_BYTES``), because on a
CPU most programs compile in under JAX's default one second and would not be cached.
JAX keys entries by the program, the compile options, the devices and the jax/XLA
versions, so a stale entry is never reused; the directory can be deleted at any time.

On GPUs XLA times candidate kernels for each fusion and matmul while compiling (autotuning):
on a real H100 most of the first train step's compile. The results are kept beside the
executables, in ``<cache>/xla_gpu_per_fusion_autotune_cache_dir`` (XLA's
``--xla_gpu_per_fusion_autotune_cache_dir``, which JAX sets from its
``jax_persistent_cache_enable_xla_caches``; asyncrl names it explicitly, unless
``$JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES`` says otherwise), so a program that misses the
executable cache (another batch shape or option) but shares fusions with one compiled before is
not tuned again; only process 0 writes them. An executable loaded from the cache is not tuned at all.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping, Optional

log = logging.getLogger(__name__)

ENV_SWITCH = "ASYNCRL_COMPILE_CACHE"
"""``0``/``false``/``off``/``no`` turns the cache off for a run whatever its config says."""
_OFF = ("0", "false", "off", "no")


def compile_cache_dir(enabled: bool, env: Mapping[str, str]) -> Optional[Path]:
    """Where a run's compilation cache goes, or None when it is off (pure: reads ``env`` only).

    Raises ValueError for an ``ASYNCRL_COMPILE_CACHE`` that is neither on nor off."""
    switch = env.get(ENV_SWITCH, "").strip().lower()
    if switch and switch not in _OFF and switch not in ("1", "true", "on", "yes"):
        raise ValueError(f"{ENV_SWITCH}={env[ENV_SWITCH]!r}: use 0 (off) or 1 (on)")
    if not enabled or switch in _OFF:
        return None
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(env["JAX_COMPILATION_CACHE_DIR"])
    from asyncrl.model.tiny import default_cache_dir

    return default_cache_dir(env) / "jax"


def enable_compile_cache(enabled: bool = True) -> Optional[Path]:
    """Point JAX's persistent compilation cache at :func:`compile_cache_dir` (call before the
    first compilation of the process; later calls with the same directory change nothing).

    Returns the directory, or None when the cache is off. A directory that cannot be created
    turns the cache off with one warning: a cache is never a reason for a run to fail."""
    import jax

    configured = jax.config.values.get("jax_compilation_cache_dir")  # set by the user's own code
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": configured} if configured else os.environ
    try:
        where = compile_cache_dir(enabled, env)
    except ValueError as err:
        from asyncrl.errors import ConfigError

        raise ConfigError([f"environment: {err}"]) from None
    if where is None:
        # An earlier call in this process (or JAX_COMPILATION_CACHE_DIR) may have set one.
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        log.warning("compilation cache off: cannot create %s ([Errno %s] %s); set ASYNCRL_CACHE_DIR or "
                    "JAX_COMPILATION_CACHE_DIR to a writable directory", where, err.errno, err.strerror)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    if jax.config.values.get("jax_compilation_cache_dir") != str(where):
        jax.config.update("jax_compilation_cache_dir", str(where))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES" not in os.environ:
        jax.config.update("jax_persistent_cache_enable_xla_caches", GPU_AUTOTUNE_CACHE)
    return where


GPU_AUTOTUNE_CACHE = "xla_gpu_per_fusion_autotune_cache_dir"
"""The XLA cache kept beside the executables (JAX's ``jax_persistent_cache_enable_xla_caches``): GPU
autotuning results, one file per fusion, under ``<cache>/xla_gpu_per_fusion_autotune_cache_dir``."""
