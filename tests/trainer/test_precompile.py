"""The first train step compiled in the background (asyncrl/trainer/precompile.py) and the
start-up split's compile accounting (asyncrl/run/startup.py)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.run.startup import ENGINE_THREAD, StartupClock, compile_seconds
from asyncrl.trainer.precompile import expected_first_shape
from tests.trainer_fixtures import make_batch, tiny_model, trainer_config


def _backend_compiles_of_the_step() -> list[float]:
    """A list that collects the train step's XLA compile durations from now on."""
    seen: list[float] = []

    def listen(event: str, duration_secs: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and kwargs.get("fun_name") == "jit(_train_step_impl)":
            seen.append(duration_secs)

    jax.monitoring.register_event_duration_secs_listener(listen)
    return seen


@pytest.fixture
def fresh_cache(tmp_path):
    """An empty persistent compilation cache for this test (the suite's may already hold the
    step), on even where an earlier run in this process turned the cache off (``-p no:cacheprovider``)."""
    from jax._src import compilation_cache

    names = ("jax_compilation_cache_dir", "jax_enable_compilation_cache")
    before = {name: jax.config.values[name] for name in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax-cache"))
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def test_the_first_step_loads_the_background_compile_from_the_cache(fresh_cache):
    from asyncrl.trainer import Trainer

    graphdef, params = tiny_model(seed=3)
    cfg = trainer_config(optim={"lr": 1e-3}, rollout={"length_bucket": 24, "max_new_tokens": 18},
                         data={"max_prompt_tokens": 6})
    trainer = Trainer(cfg, graphdef, params)
    batch = make_batch(rows=16, length=24, group_size=4)
    shape = expected_first_shape(cfg, 16, trainer.row_multiple)
    assert shape == (16, 24, 24)  # one bucket covers the cap: the first batch's shape is certain
    compiles = _backend_compiles_of_the_step()
    precompile = trainer.start_precompile(shape)
    metrics = trainer.step(batch)
    assert trainer.precompile_hit is True and trainer.precompile is None
    assert precompile.error is None and precompile.seconds is not None and precompile.seconds > 0
    # XLA compiled the step once, in the background; the step's own jit loaded it from the cache.
    assert len(compiles) == 1, compiles
    assert np.isfinite(metrics["loss/total"])


@pytest.mark.slow  # compiles the step twice; the hit is in the default selection
def test_a_wrong_prediction_costs_no_wait_and_the_step_compiles_its_own(fresh_cache):
    from asyncrl.trainer import Trainer

    graphdef, params = tiny_model(seed=3)
    cfg = trainer_config(optim={"lr": 1e-3})
    trainer = Trainer(cfg, graphdef, params)
    reference = Trainer(cfg, graphdef, params)
    batch = make_batch(rows=16, length=24, group_size=4)
    trainer.start_precompile((16, 32, 32))
    metrics = trainer.step(batch)
    assert trainer.precompile_hit is False
    np.testing.assert_array_equal(metrics["loss/total"], reference.step(batch)["loss/total"])


def test_compile_seconds_are_split_into_the_train_step_the_engine_and_the_rest():
    clock = StartupClock(started=0.0)
    before = compile_seconds()

    def engine_work():
        jax.jit(lambda x: jnp.tanh(x) * 3.0).lower(jnp.ones(5)).compile()

    thread = threading.Thread(target=engine_work, name=ENGINE_THREAD)
    thread.start()
    thread.join(timeout=60)
    jax.jit(lambda x: jnp.cos(x) + 1.5).lower(jnp.ones(7)).compile()
    after = compile_seconds()
    assert after["engine"] > before["engine"] and after["other"] > before["other"]
    assert after["train"] == before["train"]
    clock.record("load", 1.5)
    clock.record("load", 9.0)  # only the first time counts
    metrics = clock.first_step(precompile_hit=None)
    assert metrics["perf/startup_load_s"] == 1.5 and metrics["perf/startup_engine_compile_s"] > 0
    assert "perf/startup_precompile_hit" not in metrics
    assert clock.first_step(precompile_hit=True) == {}  # once per run
    assert clock.summary().startswith("first step after ") and "load 1.5" in clock.summary()
