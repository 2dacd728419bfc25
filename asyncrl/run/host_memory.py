"""Keep freed host memory for reuse, so a CPU train step does not zero-fill fresh pages each time.

On the CPU backend XLA allocates each execution's scratch buffer (every intermediate of the
jitted train step: about 1.6 GB for ``bench-40m`` at 32 x 80 tokens) with ``malloc`` and
frees it when the execution ends. glibc serves a block that large with its own ``mmap`` and
returns it with ``munmap``: every step maps fresh pages, and the kernel zero-fills each on its
first touch. Measured with ``getrusage`` around ``Trainer.step``, alone and inside the loop
alike: about 450,000 minor page faults per step, 1.7 GB of zeroing (docs/performance.md "Host memory on CPU").

:func:`keep_freed_host_memory` tells glibc (``mallopt``) to serve every thread from one arena
(``M_ARENA_MAX`` 1: a thread arena is at most 64 MB, so a larger block would be mapped
anyway), never to map blocks of their own (``M_MMAP_MAX`` 0) and never to give the top of the
heap back (``M_TRIM_THRESHOLD``): a freed scratch buffer stays mapped and the next step reuses
its pages: the same step then takes 7,000 to 20,000 page faults. The price is memory: freed
blocks stay in the heap, where fragmentation grows the peak (bench-40m's trainer process: 2.96
GB without, 4.42 GB with; ``scripts/bench.py train`` shapes, whole-process A/B in docs/benchmarks.md).
So it is opt-in: ``run.keep_host_memory: true``.

It must run before JAX starts its thread pools (a thread keeps the arena it first allocated
from), so :func:`asyncrl.run.loop.train` calls it first; elsewhere (non-glibc platforms, such as
macOS) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
from typing import Optional

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the largest is "never" for any real heap top

_applied: Optional[bool] = None


def keep_freed_host_memory() -> bool:
    """Set glibc's allocator to keep and reuse freed memory (once per process); returns whether
    it applies (False off glibc, or when ``mallopt`` refused a setting)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        log.info("run.keep_host_memory: not a glibc Linux; the allocator is left as it is")
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM))
    refused = [name for (name, value) in settings if libc.mallopt(ctypes.c_int(name), ctypes.c_int(value)) != 1]
    if refused:
        log.warning("run.keep_host_memory: mallopt refused parameter(s) %s; freed memory may go back to the OS", refused)
        return False
    _applied = True
    return True
