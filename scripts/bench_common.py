"""What the benchmark scripts share: a median timer, the machine's measured matmul and copy
speeds (the peaks and floors their figures are compared against), and the load average that
every JSON line carries (other work on a shared machine moves every figure)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Optional


def run_times(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Wall seconds of each of ``repeats`` calls of ``fn()``, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls, after one untimed warm-up call."""
    return statistics.median(run_times(fn, repeats))


def dot_flops(n: int = 1024, dtype: str = "float32") -> float:
    """FLOP/s of a jitted ``n x n`` ``jnp.dot`` in ``dtype`` (median of 5)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    dot = jax.jit(jnp.dot)
    return 2.0 * n**3 / median_time(lambda: dot(a, b).block_until_ready(), 5)


def copy_bandwidth(mib: int = 256) -> float:
    """Bytes/s of a jitted elementwise pass over ``mib`` MiB of float32 (read + write counted; median of 5)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((mib * 1024 * 1024 // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001 + 1.0)
    return 2 * x.nbytes / median_time(lambda: f(x).block_until_ready(), 5)


def load_avg() -> Optional[list[float]]:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
