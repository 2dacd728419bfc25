"""The processes of a run agree on the checkpoint to resume from: each hashes only its share of
the files, so a damaged file is seen by one process; what each found is exchanged through the
coordinator, every process skips the damaged checkpoint naming the file, and all return the same
older one. Processes that see different checkpoints say so in one line.

Each reader is one of two JAX processes on loopback (gloo), started here."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from asyncrl.checkpoint import store as ck
from tests.helpers import REPO_ROOT, subprocess_env

# argv: OUT (this process's run.output_dir); env: the JAX_* variables of a 2-process run.
CHILD = textwrap.dedent(
    """
    import logging, sys
    from asyncrl.config import load_config
    from asyncrl.cluster.distributed import initialize_distributed
    initialize_distributed(load_config(data={}).mesh)
    import jax
    from asyncrl.checkpoint import store as ck
    from asyncrl.errors import CheckpointError
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
    try:
        path = ck.latest_checkpoint(sys.argv[1], share=(jax.process_index(), jax.process_count()), timeout_s=60)
    except CheckpointError as err:
        print("REFUSED", err, flush=True)
    else:
        print("CHOSEN", path.name if path is not None else None, flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(outs: list[Path]) -> list[str]:
    """The child as two JAX processes (process i reading ``outs[i]``); their outputs."""
    port = _free_port()
    procs = []
    for pid, out in enumerate(outs):
        env = subprocess_env(JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                             JAX_PROCESS_ID=str(pid))
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, str(out)], env=env, cwd=REPO_ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outputs = []
    try:
        for proc in procs:
            stdout, _ = proc.communicate(timeout=180)
            assert proc.returncode == 0, stdout[-4000:]
            outputs.append(stdout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return outputs


def _save(out: Path, step: int) -> Path:
    rng = np.random.default_rng(step)
    arrays = {"params": {"embed": rng.standard_normal((64, 32)).astype(np.float32),
                         "layers": [{"w": rng.standard_normal((32, 32)).astype(np.float32)} for _ in range(3)]}}
    return ck.save_checkpoint(out, step, arrays=arrays, state={"version": step}, config_yaml="{}\n")


@pytest.mark.timeout(400)
def test_a_file_damaged_in_one_process_share_is_skipped_by_both_naming_the_file(tmp_path):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    files = json.loads((newest / ck.MANIFEST_FILE).read_text())["files"]
    theirs = ck._my_share(list(files), (1, 2))  # hashed by process 1 alone
    assert theirs.isdisjoint(ck._my_share(list(files), (0, 2)))
    damaged = max(theirs, key=lambda name: files[name]["bytes"])
    data = bytearray((newest / damaged).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only its sha256 tells
    (newest / damaged).write_bytes(bytes(data))

    outputs = _two_processes([tmp_path, tmp_path])
    for pid, output in enumerate(outputs):
        assert "CHOSEN step_00000001" in output, (pid, output)
        skipped = [line for line in output.splitlines() if line.startswith("WARNING skipping checkpoint")]
        assert len(skipped) == 1 and str(newest) in skipped[0] and damaged in skipped[0], (pid, output)
        assert "does not match its sha256" in skipped[0]


@pytest.mark.timeout(400)
def test_processes_that_see_different_checkpoints_are_refused_in_one_line(tmp_path):
    both, older = tmp_path / "both", tmp_path / "older"
    _save(both, 1)
    _save(both, 2)
    _save(older, 1)
    outputs = _two_processes([both, older])  # as if run.output_dir were two local disks
    for output in outputs:
        refused = [line for line in output.splitlines() if line.startswith("REFUSED")]
        assert len(refused) == 1, output
        assert "sees step_00000002 where process" in refused[0] or "where process 0 sees step_00000002" in refused[0]
        assert "every process must see the same run.output_dir" in refused[0]
