"""The processes of a run agree on the checkpoint to resume from: each hashes only its share of
the files, so a damaged file is seen by one process; what each found is exchanged through the
coordinator, every process skips the damaged checkpoint naming the file, and all return the same
older one. Processes that see different checkpoints say so in one line.

Each reader is one of two JAX processes on loopback (gloo), started here."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from asyncrl.checkpoint import store as ck
from asyncrl.checkpoint.layout import _my_share
from tests.helpers import run_jax_processes

# argv: OUT (this process's run.output_dir); env: the JAX_* variables of a 2-process run.
CHILD = textwrap.dedent(
    """
    import logging, sys
    from asyncrl.config import load_config
    from asyncrl.cluster.distributed import initialize_distributed
    initialize_distributed(load_config(data={}).mesh)
    import jax
    from asyncrl.checkpoint.load import latest_checkpoint
    from asyncrl.errors import CheckpointError
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
    try:
        path = latest_checkpoint(sys.argv[1], share=(jax.process_index(), jax.process_count()), timeout_s=60)
    except CheckpointError as err:
        print("REFUSED", err, flush=True)
    else:
        print("CHOSEN", path.name if path is not None else None, flush=True)
    """
)


def _two_processes(tmp_path: Path, outs: list[Path]) -> list[str]:
    """The child as two JAX processes (process i reading ``outs[i]``); their outputs."""
    codes, logs = run_jax_processes(tmp_path / "logs", lambda pid: ["-c", CHILD, str(outs[pid])], 2, timeout=180)
    assert codes == [0, 0], logs
    return logs


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
    theirs = _my_share(list(files), (1, 2))  # hashed by process 1 alone
    assert theirs.isdisjoint(_my_share(list(files), (0, 2)))
    damaged = max(theirs, key=lambda name: files[name]["bytes"])
    data = bytearray((newest / damaged).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only its sha256 tells
    (newest / damaged).write_bytes(bytes(data))

    outputs = _two_processes(tmp_path, [tmp_path, tmp_path])
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
    outputs = _two_processes(tmp_path, [both, older])  # as if run.output_dir were two local disks
    for output in outputs:
        refused = [line for line in output.splitlines() if line.startswith("REFUSED")]
        assert len(refused) == 1, output
        assert "sees step_00000002 where process" in refused[0] or "where process 0 sees step_00000002" in refused[0]
        assert "every process must see the same run.output_dir" in refused[0]
