"""Where a run's time to first step goes: loading, the engine, the first batch, compiling.

The first step of a run is logged once with the split (``perf/startup_*``, in seconds) and the
summary line repeats it, so a slow start names its part:

* ``perf/startup_load_s``: from :func:`asyncrl.run.loop.train` to a loaded model, mesh and sinks
  (distributed start-up, the checkpoint to resume, reading the weights);
* ``perf/startup_engine_s``: building the engine (placing its weights; compiling happens on use);
* ``perf/startup_first_batch_wait_s``: waiting for the first batch (the engine's compiles and the
  first rollouts; the step-0 eval, when configured, is before it and not counted);
* ``perf/startup_engine_compile_s`` and ``perf/startup_train_compile_s``: JAX's own compile
  durations (tracing, lowering, XLA; from ``jax.monitoring``) of the engine's programs (those
  compiled on the engine's thread) and of the train step (wherever compiled: the step's own call,
  or the background compile of :mod:`asyncrl.trainer.precompile`), up to the first step's end.
  A program loaded from the persistent compilation cache is not compiled and adds nothing;
* ``perf/time_to_first_step_s``: from the start of ``train`` to the first step's published weights;
* ``perf/startup_precompile_hit``: 1 when the train step's background compile had the first
  batch's shape, 0 when it did not (absent when none ran).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Optional

ENGINE_THREAD = "asyncrl-jax-engine"
"""Name of :class:`~asyncrl.engine.jax_engine.JaxEngine`'s scheduler thread: compiles there are the engine's."""
TRAIN_STEP_FUNCTION = "_train_step_impl"
"""The jitted train step's function name in JAX's compile events."""
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)

_totals: collections.defaultdict[str, float] = collections.defaultdict(float)
_lock = threading.Lock()
_installed = False


def _on_event(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event not in _COMPILE_EVENTS:
        return
    name = str(kwargs.get("fun_name", ""))
    if name.startswith("jit(") and name.endswith(")"):
        name = name[4:-1]
    if name == TRAIN_STEP_FUNCTION:
        part = "train"
    elif threading.current_thread().name.startswith(ENGINE_THREAD):
        part = "engine"
    else:
        part = "other"
    with _lock:
        _totals[part] += duration_secs


def compile_seconds() -> dict[str, float]:
    """Seconds JAX spent compiling in this process so far, by part: ``train`` (the train step),
    ``engine`` (programs compiled on the engine's thread), ``other``. Starts counting at the
    first :class:`StartupClock` of the process (the listener stays installed: JAX has no public
    way to remove one, and it costs a dictionary update per compile)."""
    with _lock:
        return {part: float(_totals[part]) for part in ("train", "engine", "other")}


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_event)


class StartupClock:
    """The split of one run's time to first step (this module's docstring); ``started`` is
    ``time.monotonic()`` at the start of ``train``. Single-threaded: the loop calls it."""

    def __init__(self, started: float):
        _install()
        self.started = started
        self.compiled_before = compile_seconds()
        self.parts: dict[str, float] = {}
        self.done = False
        """True once the first step's split was taken (:meth:`first_step`)."""

    def record(self, part: str, seconds: float) -> None:
        """``part`` (``load``, ``engine``, ``first_batch_wait``) took ``seconds``; only the first
        time counts (a later stage builds nothing new, waits are not start-up)."""
        if not self.done:
            self.parts.setdefault(part, seconds)

    def first_step(self, precompile_hit: Optional[bool]) -> dict[str, float]:
        """The ``perf/startup_*`` metrics, once: at the first step's end (empty afterwards)."""
        if self.done:
            return {}
        self.done = True
        compiled = compile_seconds()
        metrics = {f"perf/startup_{part}_s": seconds for part, seconds in self.parts.items()}
        metrics["perf/startup_engine_compile_s"] = compiled["engine"] - self.compiled_before["engine"]
        metrics["perf/startup_train_compile_s"] = compiled["train"] - self.compiled_before["train"]
        metrics["perf/time_to_first_step_s"] = time.monotonic() - self.started
        if precompile_hit is not None:
            metrics["perf/startup_precompile_hit"] = float(precompile_hit)
        self.metrics = metrics
        return metrics

    def summary(self) -> str:
        """``first step after 12 s (load 2.1, engine 0.3, ...)`` for the summary line, or ``''``
        when no step ran."""
        if not self.done:
            return ""
        m = self.metrics
        parts = [(label, m.get(f"perf/startup_{key}_s")) for label, key in (
            ("load", "load"), ("engine", "engine"), ("first batch", "first_batch_wait"),
            ("engine compile", "engine_compile"), ("train compile", "train_compile"))]
        split = ", ".join(f"{label} {value:.1f}" for label, value in parts if value is not None)
        return f"first step after {m['perf/time_to_first_step_s']:.1f} s ({split})"
