"""run.keep_host_memory: a freed large block is reused without fresh page faults (glibc only).

Each case runs in a subprocess: the allocator settings are per process and permanent."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, subprocess_env

# Allocate, touch and free a 256 MB block twice; report the minor page faults of the second
# time. glibc maps a block this size with mmap and unmaps it on free, so without the setting
# the second block faults in all of its 65,536 pages again.
CHILD = """
import ctypes, json, resource, sys
from asyncrl.run.host_memory import keep_freed_host_memory
applied = keep_freed_host_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 256 * 2**20
def touch():  # as XLA's scratch buffer: malloc, written, freed (numpy's own blocks use huge pages)
    block = libc.malloc(ctypes.c_size_t(size))
    ctypes.memset(block, 1, size)
    libc.free(block)
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def second_block_faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120,
                         cwd=REPO_ROOT, env=subprocess_env())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_freed_block_is_reused_without_page_faults():
    default = second_block_faults("default")
    kept = second_block_faults("keep")
    assert default["faults"] > 50_000  # every page of the new mapping, zero-filled again
    assert kept["applied"] is True and kept["faults"] < 1_000


def test_the_setting_is_off_by_default_and_set_from_config():
    from asyncrl.config import load_config

    assert load_config(None).run.keep_host_memory is False
    assert load_config(None, ["run.keep_host_memory=true"]).run.keep_host_memory is True
