"""The training loop behind ``asyncrl train CONFIG``.

Per step, on the main thread::

    batch = executor.prepare_batch(v)          # groups with lag <= max_staleness
    metrics = trainer.step(batch)              # ppo_epochs x mini_batches optax updates
    engine.update_weights(params, v + 1)       # returns once every new token carries v+1
    executor.set_version(v + 1)                # only then may admission move on
    eval (between publishes: one version), metrics, trajectory dump

Rollouts run in the background the whole time, bounded by ``rollout.max_staleness``;
``0`` is synchronous on-policy training with the same code. Data only flows down this
list; the only thing that goes back up is published weights with their version.

Any thread's crash ends the run with that thread's traceback (the executor re-raises
rollout and engine failures in the main thread), and everything is stopped in a
``finally`` so nothing hangs.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from asyncrl.config import Config, RewardSpec, dump_config
from asyncrl.errors import AsyncRLError

log = logging.getLogger(__name__)


class RunDirError(AsyncRLError):
    """The output directory already holds a run."""


@dataclass
class TrainResult:
    steps: int
    final_eval: dict[str, float]
    wall_time_s: float
    output_dir: Path
    history: list[dict[str, float]]
    final_params: Any = None
    """The trained weights as host numpy arrays (the same as the ``hf/`` export)."""


@dataclass
class Components:
    """Everything a run is built from (the loop and ``asyncrl eval`` share the building)."""

    cfg: Config
    loaded: Any  # asyncrl.model.LoadedModel
    task: Any  # asyncrl.data.TaskData
    workflow: Any
    engine: Any


def build_task_and_workflow(cfg: Config, tokenizer: Any) -> tuple[Config, Any, Any]:
    """Resolve the dataset, default the rewards to the task's own, build the workflow."""
    from asyncrl.registry import resolve
    from asyncrl.rollout.workflow import build_workflow

    factory = resolve("dataset", cfg.data.dataset, where="data.dataset")
    task = factory(seed=cfg.run.seed)
    if not cfg.rewards:
        if task.reward is None:
            raise AsyncRLError("rewards: the config names no reward function and data.dataset has no default one")
        cfg = cfg.model_copy(update={"rewards": [RewardSpec(fn=task.reward)]})
    return cfg, task, build_workflow(cfg, tokenizer)


def _prepare_output_dir(cfg: Config) -> Path:
    out = cfg.run.resolved_output_dir
    if (out / "metrics.jsonl").exists() and not cfg.run.overwrite:
        raise RunDirError(
            f"run.output_dir {out} already holds a run (metrics.jsonl); choose another run.name or run.output_dir, "
            "or set run.overwrite: true to replace it"
        )
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "trajectories.jsonl"):
        (out / stale).unlink(missing_ok=True)
    return out


def _rename_train_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Loss terms under ``loss/`` (``train/loss`` -> ``loss/total``, ``train/pg_loss`` ->
    ``loss/pg``); the trainer's own compute time becomes ``perf/train_time``, since the
    loop's ``perf/step_time`` covers the whole step (batch wait, train, publish)."""
    renamed = {}
    for name, value in metrics.items():
        if name == "train/loss":
            name = "loss/total"
        elif name.startswith("train/") and name.endswith("_loss"):
            name = "loss/" + name[len("train/") : -len("_loss")]
        elif name == "perf/step_time":
            name = "perf/train_time"
        renamed[name] = value
    return renamed


def _reward_metrics(groups: list, tracker: Any) -> None:
    rewards, components = [], {}
    for group in groups:
        for traj in group.trajectories:
            rewards.append(traj.reward)
            for name, value in traj.reward_components.items():
                components.setdefault(name, []).append(value)
    tracker.scalar("reward/mean", float(np.mean(rewards)))
    tracker.scalar("reward/std", float(np.std(rewards)))
    for name, values in components.items():
        tracker.scalar(f"reward/{name}", float(np.mean(values)))


def _dump_trajectories(path: Path, step: int, groups: list, tokenizer: Any, limit: int) -> None:
    with path.open("a", encoding="utf-8") as handle:
        for group in groups[:limit]:
            for traj in group.trajectories:
                prompt_ids = traj.input_ids[~traj.loss_mask & (traj.versions < 0)]
                generated = traj.versions >= 0
                record = {
                    "step": step,
                    "prompt": tokenizer.decode(prompt_ids.tolist(), skip_special_tokens=False),
                    "completion": tokenizer.decode(traj.input_ids[generated].tolist(), skip_special_tokens=False),
                    "reward": traj.reward,
                    "reward_components": traj.reward_components,
                    "versions": sorted(set(traj.versions[generated].tolist())),
                    "stop_reason": traj.stop_reason,
                    "metadata": traj.metadata,
                }
                handle.write(json.dumps(record, default=str) + "\n")


def train(cfg: Config, argv: Optional[list[str]] = None, console: Any = None) -> TrainResult:
    """Run the whole training job of ``cfg``; returns a summary (also printed)."""
    import jax

    from asyncrl.data import SampleOrder
    from asyncrl.engine.jax_engine import JaxEngine
    from asyncrl.evaluate import evaluate
    from asyncrl.metrics import ConsoleSink, JsonlSink, StatsTracker, TensorBoardSink
    from asyncrl.model import export_hf, load_model
    from asyncrl.provenance import write_provenance
    from asyncrl.rollout.executor import WorkflowExecutor
    from asyncrl.trainer import Trainer, build_mesh

    started = time.monotonic()
    out = _prepare_output_dir(cfg)
    write_provenance(out, dump_config(cfg), argv)

    loaded = load_model(cfg.model)
    cfg, task, workflow = build_task_and_workflow(cfg, loaded.tokenizer)
    graphdef, initial_params = loaded.split()
    trainer = Trainer(cfg, graphdef, initial_params, mesh=build_mesh(cfg.mesh))
    # The engine serves the trainer's own (never donated) arrays: publishing copies nothing.
    engine = JaxEngine(
        graphdef, trainer.params_for_publish(), stop_token_ids=loaded.stop_token_ids,
        config=cfg.engine, seed=cfg.run.seed, version=trainer.version,
    )
    executor = WorkflowExecutor(
        workflow, engine, SampleOrder(task.train, cfg.run.seed), cfg, version=trainer.version,
        row_multiple=trainer.row_multiple,
    )
    tracker = StatsTracker(
        [
            JsonlSink(out / "metrics.jsonl"),
            TensorBoardSink(out / "tensorboard"),
            ConsoleSink(cfg.run.total_steps, stream=console),
        ]
    )
    history: list[dict[str, float]] = []
    final_eval: dict[str, float] = {}

    def run_eval(step: int) -> None:
        nonlocal final_eval
        result = evaluate(engine, workflow, task.eval, cfg)
        final_eval = result.metrics
        tracker.scalars(result.metrics, reduce="last")

    version = 0
    generated_before = 0.0
    try:
        executor.start()
        if cfg.eval.every_steps:
            run_eval(0)
            history.append(tracker.commit(0))
        for step in range(1, cfg.run.total_steps + 1):
            step_start = time.perf_counter()
            batch = executor.prepare_batch(version, timeout=cfg.rollout.batch_timeout_s)
            groups = list(getattr(executor, "last_groups", []))
            train_metrics = trainer.step(batch)
            engine.update_weights(trainer.params_for_publish(), version + 1)
            executor.set_version(version + 1)
            version += 1
            step_time = time.perf_counter() - step_start

            tracker.scalars(_rename_train_metrics(train_metrics))
            tracker.scalars(executor.metrics, reduce="last")
            engine_metrics = engine.metrics()
            tracker.scalars(engine_metrics, reduce="last")
            generated = engine_metrics.get("engine/decode_tokens", 0.0)
            tracker.scalar("perf/gen_tokens_per_s", (generated - generated_before) / step_time)
            generated_before = generated
            if groups:
                _reward_metrics(groups, tracker)
            trained_tokens = float(batch.loss_mask.sum())
            tracker.scalar("perf/step_time", step_time)
            tracker.scalar("perf/trained_tokens_per_s", trained_tokens / step_time)
            tracker.scalar("perf/version", version, reduce="last")
            if cfg.logging.dump_every_steps and step % cfg.logging.dump_every_steps == 0 and groups:
                _dump_trajectories(out / "trajectories.jsonl", step, groups, loaded.tokenizer, cfg.logging.dump_groups)
            if cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or step == cfg.run.total_steps):
                run_eval(step)
            history.append(tracker.commit(step))
    finally:
        executor.stop()
        engine.shutdown()
        tracker.close()

    final_params = jax.tree.map(np.asarray, trainer.params_for_publish())
    export_hf(graphdef, loaded.tokenizer, out / "hf", params=final_params)
    wall = time.monotonic() - started
    result = TrainResult(
        steps=version, final_eval=final_eval, wall_time_s=wall, output_dir=out, history=history, final_params=final_params
    )
    evals = " ".join(f"{k}={v:.3f}" for k, v in final_eval.items() if k in ("eval/reward", "eval/accuracy"))
    print(f"asyncrl: {version} steps, {evals or 'no eval'}, {wall:.0f} s, outputs in {out}", file=console or sys.stdout)
    print("training completed", file=console or sys.stdout)
    return result
