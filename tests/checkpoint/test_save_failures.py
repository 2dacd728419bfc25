"""A checkpoint write that fails in the background (Orbax's asynchronous array writes: disk full,
an I/O error) reaches the loop at the next step and stops the run with one line naming the step,
the directory, the cause and the previous complete checkpoint, in one process and in two.

The fault is injected where tensorstore reports it: Orbax's write of an array's shards
(``serialization.async_serialize_from_host``, awaited in Orbax's commit threads) raises the
``ValueError`` tensorstore raises for a failed file write, errno included, so everything above it
(Orbax's commit futures and background thread, ``PendingSave``, the loop) runs as on a full disk.
The run that stops at the next step is in ``test_hardening.py`` (it resumes that file's trained
run); a real full file system (a tmpfs) is exercised there too, where mounting is allowed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import textwrap
import time
from typing import Iterator

import pytest

from asyncrl.checkpoint import store as ck
from asyncrl.checkpoint.load import latest_checkpoint, load_checkpoint
from asyncrl.errors import CheckpointError
from tests.helpers import run_jax_processes, start_jax_processes, stop_processes


def tensorstore_error(code: int, path: str) -> ValueError:
    """The error tensorstore raises for a failed file write (its message, as a full disk gave it)."""
    status = "RESOURCE_EXHAUSTED" if code == errno.ENOSPC else "UNKNOWN"
    return ValueError(f'{status}: Error writing "0" in OCDBT database at local file "{path}": Failed writing: '
                      f'"{path}d/0": Failed to write 4096 bytes to file 7: {os.strerror(code)} '
                      f"[os_error_code='{code}']")


@contextlib.contextmanager
def failing_array_writes(code: int, step: int) -> Iterator[None]:
    """Orbax's shard writes into the temporary directory of ``step``'s checkpoint fail with ``code``."""
    from orbax.checkpoint._src.serialization import serialization

    real = serialization.async_serialize_from_host
    marker = f".tmp-{ck.step_dir_name(step)}"

    async def write(rslices_on_host, tensorstore_spec, *args, **kwargs):
        spec = json.dumps(tensorstore_spec, default=str)
        if marker in spec:
            raise tensorstore_error(code, spec[spec.index("/", spec.index('"path"')):].split('"')[0])
        return await real(rslices_on_host, tensorstore_spec, *args, **kwargs)

    serialization.async_serialize_from_host = write
    try:
        yield
    finally:
        serialization.async_serialize_from_host = real


def _arrays(step: int) -> dict:
    import jax.numpy as jnp

    return {"params": {"w": jnp.full((64, 16), step, jnp.float32)}, "opt_state": {"mu": jnp.zeros(32, jnp.float32)}}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EACCES])  # EACCES: a permission changed
def test_a_background_array_write_that_fails_is_seen_without_waiting_and_raised_as_one_line(tmp_path, code):
    ck.save_checkpoint(tmp_path, 1, arrays=_arrays(1), state={"version": 1}, config_yaml="{}\n")
    with failing_array_writes(code, 2):
        pending = ck.start_checkpoint(tmp_path, 2, arrays=_arrays(2), state={"version": 2}, config_yaml="{}\n")
        deadline = time.monotonic() + 30
        while not pending.failed():  # what the loop asks after every step: never blocks
            assert time.monotonic() < deadline, "the failed write was never reported"
            time.sleep(0.01)
    with pytest.raises(CheckpointError) as raised:
        pending.wait()
    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith(f"cannot write the checkpoint of step 2 in {tmp_path / 'checkpoints'}: "
                           f"[Errno {code}] {os.strerror(code)} (the previous complete checkpoint, step_00000001, "
                           "is intact"), line
    assert [p.name for p in ck.checkpoints_root(tmp_path).iterdir()] == ["step_00000001"]  # no temporary left
    assert load_checkpoint(ck.save_checkpoint(tmp_path, 2, arrays=_arrays(2), state={"version": 2},
                                                 config_yaml="{}\n")).step == 2  # the disk is back


# The two processes' child: saves step 1, then step 2 with process FAIL's array writes failing
# with CODE; then, as the loop after each step, polls its own write and agrees with the other
# process (Hosts.agree_stop) until one of them failed, and ends the run as the loop does.
CHILD = textwrap.dedent(
    """
    import contextlib, os, sys, time
    from asyncrl.config import load_config
    from asyncrl.cluster.distributed import initialize_distributed
    initialize_distributed(load_config(data={}).mesh)
    import jax, numpy as np
    from asyncrl.checkpoint import store as ck
    from asyncrl.errors import CheckpointError
    from asyncrl.run.run_state import Run
    from asyncrl.run.multihost import Hosts
    from asyncrl.run.shutdown import ShutdownGuard
    from tests.checkpoint.test_save_failures import failing_array_writes
    out, fail, code = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("d",)), jax.sharding.PartitionSpec("d"))
    def arrays(step):  # one global array, a shard on each process
        return {"params": {"w": jax.make_array_from_callback((64, 16), sharding, lambda i: np.full((64, 16), step, np.float32)[i])}}
    ck.save_checkpoint(out, 1, arrays=arrays(1), state={"version": 1}, config_yaml="{}\\n", timeout_s=120)
    hosts = Hosts(barrier_timeout_s=120)
    hosts.guard = ShutdownGuard()
    run = Run.__new__(Run)  # the loop's checkpoint bookkeeping alone
    run.hosts = hosts
    started = time.monotonic()
    with failing_array_writes(code, 2) if jax.process_index() == fail else contextlib.nullcontext():
        run.pending_checkpoint = ck.start_checkpoint(out, 2, arrays=arrays(2), state={"version": 2},
                                                     config_yaml="{}\\n", timeout_s=120)
        try:
            for step in range(600):
                time.sleep(0.05)  # a step
                stop, failed = hosts.agree_stop(save_failed=run.checkpoint_failed())
                if failed:
                    run.raise_failed_checkpoint(failed)
            print("NEVER FAILED", flush=True)
        except CheckpointError as err:
            print(f"STOPPED {time.monotonic() - started:.1f}", err, flush=True)
    from asyncrl.cluster.distributed import wait_at_barrier
    wait_at_barrier("asyncrl-test/done", 60)  # process 0 hosts the coordinator: it leaves last
    os._exit(0)  # as the CLI after a failure: no wait for Orbax's threads of the abandoned write
    """
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fail, code", [(1, errno.ENOSPC), pytest.param(0, errno.EIO, marks=pytest.mark.slow)])
def test_a_save_that_fails_on_one_of_two_processes_stops_both(tmp_path, fail, code):
    """Two JAX processes on loopback: the process whose write failed raises its own line, the
    other one naming that process and its cause, at the same step, within seconds (not after
    checkpoint.barrier_timeout_s); the previous checkpoint stays the newest complete one."""
    _, outputs = run_jax_processes(tmp_path / "logs", lambda pid: ["-c", CHILD, str(tmp_path), str(fail), str(code)],
                                   2, timeout=240)
    root = tmp_path / "checkpoints"
    cause = (f"cannot write the checkpoint of step 2 in {root}: [Errno {code}] {os.strerror(code)} (the previous "
             "complete checkpoint, step_00000001, is intact")
    for pid, output in enumerate(outputs):
        stopped = [line for line in output.splitlines() if line.startswith("STOPPED")]
        assert len(stopped) == 1, (pid, output)
        seconds, message = stopped[0].split(" ", 2)[1:]
        assert float(seconds) < 30, (pid, output)
        if pid == fail:
            assert message.startswith(cause), (pid, output)
        else:
            assert message.startswith(f"process {fail} of 2 failed to write its part of the checkpoint of step 2, "
                                      f"so every process stops: {cause}"), (pid, output)
    assert latest_checkpoint(tmp_path).name == "step_00000001"


# `asyncrl train` as one of two processes, its array writes of step FAIL_STEP's checkpoint failing
# with CODE on process FAIL (argv: config, fail, code, fail_step).
TRAIN_CHILD = textwrap.dedent(
    """
    import contextlib, os, sys
    from tests.checkpoint.test_save_failures import failing_array_writes
    config, fail, code, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    failing = failing_array_writes(code, step) if int(os.environ["JAX_PROCESS_ID"]) == fail else contextlib.nullcontext()
    from asyncrl.cli import main
    with failing:
        sys.exit(main(["train", config]))
    """
)


@pytest.mark.slow  # two training processes: about a minute; the agreement itself is tested above
@pytest.mark.timeout(400)
def test_asyncrl_train_on_two_processes_stops_both_when_one_save_fails(tmp_path):
    """The CLI on two processes (2 CPU devices each): process 1's part of step 2's checkpoint
    fails with ENOSPC; both stop at the same step with exit 1, process 1 with its own line,
    process 0 naming process 1 and its cause; step 1's checkpoint stays the newest complete one."""
    from tests.cluster.test_multiprocess import FAST_COMPILE_FLAGS, _config, _logs

    config = _config(tmp_path, "fail", run={"total_steps": 6}, checkpoint={"every_steps": 1, "keep": 5})
    procs = start_jax_processes(lambda pid: ["-c", TRAIN_CHILD, str(config), "1", str(errno.ENOSPC), "2"],
                                [config.with_suffix(f".p{pid}.log") for pid in range(2)], devices=2,
                                xla_flags=FAST_COMPILE_FLAGS)
    codes = stop_processes(procs, timeout=300)
    logs = [config.with_suffix(f".p{pid}.log").read_text() for pid in range(2)]
    assert codes == [1, 1], _logs(config, 2)
    out = tmp_path / "fail"
    cause = (f"cannot write the checkpoint of step 2 in {out / 'checkpoints'}: [Errno 28] No space left on device "
             "(the previous complete checkpoint, step_00000001, is intact")
    last = [[line for line in log.splitlines() if line.startswith("asyncrl:")][-1] for log in logs]
    assert last[1].startswith(f"asyncrl: error: {cause}"), _logs(config, 2)
    assert last[0].startswith("asyncrl: error: process 1 of 2 failed to write its part of the checkpoint of step 2, "
                              f"so every process stops: {cause}"), _logs(config, 2)
    assert "Traceback" not in logs[0] + logs[1], _logs(config, 2)
    assert latest_checkpoint(out).name == "step_00000001"
    assert max(json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()) < 6
