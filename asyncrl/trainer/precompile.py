"""The first train step compiled while the first rollouts run, not after them.

A run's first step waits for its first batch (the engine compiles its programs and generates),
then compiles the train step: two long waits in a row, each with the other part idle. The
batch's shape is known before the batch itself in the common cases, so the loop starts the
step's compilation in a background thread as soon as the trainer exists
(:func:`expected_first_shape`, :class:`Precompile`), from abstract batch arrays
(``jax.ShapeDtypeStruct``: nothing is placed on a device, no collective runs) and the trainer's
real parameters, which lowering only reads. The compiled program reaches the step through
JAX's persistent compilation cache (``run.compile_cache``, on by default; with it off nothing
is started): when the first batch has the predicted shape, the step's own jit finds the
program there instead of compiling it again.

The prediction is exact when one length bucket covers every sequence (``rollout.length_bucket
>= `` the length cap, as in the quickstart); otherwise it guesses the cap, which early RL
batches (with truncated completions) usually reach. Packed batches (``rollout.pack``), whose
row count depends on the lengths, are not predicted. A miss costs only
the background compile's CPU time: the step then compiles its own shape as before, without
waiting for the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

import jax
import numpy as np

from asyncrl.cluster.mesh import row_sharding

log = logging.getLogger(__name__)

_FIELD_DTYPES = {
    "input_ids": np.int32, "attention_mask": np.bool_, "loss_mask": np.bool_, "behavior_logprobs": np.float32,
    "rewards": np.float32, "group_index": np.int32, "truncated": np.bool_,
}
"""The jitted step's batch arrays (``trainer.BATCH_FIELDS``) and their dtypes (docs/design.md "TrainBatch")."""
_ROW_FIELDS = ("rewards", "group_index", "truncated")


def expected_first_shape(cfg: Any, local_rows: int, row_multiple: int) -> tuple[int, int, int]:
    """``(rows, length, window)`` of the stage's first batch on this process, as
    :func:`~asyncrl.rollout.batch.batch_shape` and :func:`~asyncrl.trainer.step.loss_window` would
    make them when the longest sequence reaches the length cap (``Config.max_seq_len``) and the
    trained span reaches ``rollout.max_new_tokens``. ``local_rows``: this process's real rows."""
    from asyncrl.rollout.batch import batch_shape

    rows, length = batch_shape(local_rows, cfg.max_seq_len, cfg, row_multiple, "precompile")
    bucket = cfg.rollout.length_bucket
    window = min(length, -(-cfg.rollout.max_new_tokens // bucket) * bucket)
    if bucket >= length:  # one bucket: every batch has this shape and this window
        window = length
    return rows, length, window


def abstract_batch(mesh: Any, rows: int, length: int, extra: tuple[str, ...] = ()) -> dict[str, jax.ShapeDtypeStruct]:
    """The step's batch arrays as ``ShapeDtypeStruct`` s with their row shardings: ``rows`` this
    process's rows (the global array has ``rows x`` processes). ``extra``: further ``[rows, length]``
    int32 fields the step is sent (``constraint_nodes``)."""
    global_rows = rows * jax.process_count()
    out = {}
    for name, dtype in {**_FIELD_DTYPES, **{field: np.int32 for field in extra}}.items():
        shape = (global_rows,) if name in _ROW_FIELDS else (global_rows, length)
        out[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=row_sharding(mesh, len(shape)))
    return out


class Precompile:
    """One background compilation of the train step for a predicted ``(rows, length, window)``.

    ``lower`` is a callable returning the jitted step's ``Lowered`` for those (the trainer's
    arguments with abstract batch arrays). The thread is a daemon; its failure is kept and
    logged by :meth:`settle` on the caller's thread, never lost and never fatal: the step
    compiles its own program as it would have without this."""

    def __init__(self, shape: tuple[int, int, int], lower: Any):
        self.shape = shape
        self.seconds: Optional[float] = None
        """Wall time of the background compile, once it finished (None before, or after a failure)."""
        self.error: Optional[BaseException] = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(lower,), name="asyncrl-precompile", daemon=True)
        self._thread.start()

    def _run(self, lower: Any) -> None:
        started = time.perf_counter()
        try:
            lower().compile()
            self.seconds = time.perf_counter() - started
        except BaseException as err:  # reported on the main thread by settle()
            self.error = err
        finally:
            self._done.set()

    def join(self, timeout: float) -> list[str]:
        """Wait at most ``timeout`` seconds for the compile to end (an XLA compile cannot be
        cancelled); returns the thread's name if it is still running, else nothing."""
        self._thread.join(timeout)
        return [self._thread.name] if self._thread.is_alive() else []

    def settle(self, shape: tuple[int, int, int], timeout_s: float) -> bool:
        """Before the first step of ``shape``: wait for the compile when it is of this shape (the
        step then loads it from the cache; waiting at most ``timeout_s``), not when it is of
        another. Returns whether the prediction was right. A failed compile is logged here."""
        hit = shape == self.shape
        if hit and not self._done.wait(timeout_s):
            log.warning("the train step's background compile of shape %s is still running after %.0f s; the step "
                        "compiles its own", self.shape, timeout_s)
        if self.error is not None:
            log.warning("the train step's background compile failed (%s: %s); the step compiles its own",
                        type(self.error).__name__, self.error)
        elif not hit:
            log.info("first batch shape %s, not the predicted %s: the step compiles its own", shape, self.shape)
        return hit
