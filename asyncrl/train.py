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


class _Run:
    """The state one run shares across its stages: model, mesh, engine, sinks, version."""

    def __init__(self, cfg: Config, out: Path, console: Any):
        from asyncrl.metrics import ConsoleSink, JsonlSink
        from asyncrl.model import load_model
        from asyncrl.trainer import build_mesh

        self.cfg = cfg
        self.out = out
        self.loaded = load_model(cfg.model)
        self.graphdef, self.params = self.loaded.split()
        self.mesh = build_mesh(cfg.mesh)
        self.engine: Any = None
        self.version = 0
        """Completed trainer steps over all stages: the version the engine serves."""
        self.console = ConsoleSink(cfg.total_steps, stream=console)
        self.jsonl = JsonlSink(out / "metrics.jsonl")
        self.history: list[dict[str, float]] = []
        self.final_eval: dict[str, float] = {}
        self.generated_before = 0.0

    # ------------------------------------------------------------------ shared pieces

    def tracker_for(self, stage: Any) -> Any:
        """Sinks of one stage. With several stages, rows of metrics.jsonl carry ``stage`` and
        each stage writes its own TensorBoard run (``tensorboard/<stage>/``), so curves of
        different stages never collide under one name."""
        from asyncrl.metrics import StatsTracker, TensorBoardSink

        multi = bool(self.cfg.stages)
        self.jsonl.tags = {"stage": stage.name} if multi else {}
        self.console.prefix = f"[{stage.name}] " if multi else ""
        tensorboard = TensorBoardSink(self.out / "tensorboard" / stage.name if multi else self.out / "tensorboard")
        return StatsTracker([self.jsonl, tensorboard, self.console]), tensorboard

    def ensure_engine(self, trainer: Any, scfg: Config) -> Any:
        from asyncrl.engine.jax_engine import JaxEngine

        if self.engine is None:
            # The engine serves the trainer's own (never donated) arrays: publishing copies nothing.
            self.engine = JaxEngine(
                self.graphdef, trainer.params_for_publish(), stop_token_ids=self.loaded.stop_token_ids,
                config=scfg.engine, seed=scfg.run.seed, version=self.version,
            )
        return self.engine

    def publish(self, trainer: Any) -> None:
        self.engine.update_weights(trainer.params_for_publish(), self.version + 1)
        self.version += 1

    def evaluate(self, scfg: Config, workflow: Any, task: Any, tracker: Any) -> None:
        from asyncrl.evaluate import evaluate

        result = evaluate(self.engine, workflow, task.eval, scfg)
        self.final_eval = result.metrics
        tracker.scalars(result.metrics, reduce="last")

    def record_engine(self, tracker: Any, step_time: float) -> None:
        engine_metrics = self.engine.metrics()
        tracker.scalars(engine_metrics, reduce="last")
        generated = engine_metrics.get("engine/decode_tokens", 0.0)
        tracker.scalar("perf/gen_tokens_per_s", (generated - self.generated_before) / step_time)
        self.generated_before = generated

    def eval_due(self, scfg: Config, stage_step: int) -> bool:
        every = scfg.eval.every_steps
        return bool(every) and (stage_step % every == 0 or stage_step == scfg.run.total_steps)

    # ------------------------------------------------------------------ stages

    def rl_stage(self, stage: Any, scfg: Config, trainer: Any, first: bool) -> None:
        from asyncrl.data import SampleOrder
        from asyncrl.rollout.executor import WorkflowExecutor

        scfg, task, workflow = build_task_and_workflow(scfg, self.loaded.tokenizer)
        engine = self.ensure_engine(trainer, scfg)
        executor = WorkflowExecutor(
            workflow, engine, SampleOrder(task.train, scfg.run.seed), scfg, version=self.version,
            row_multiple=trainer.row_multiple,
        )
        tracker, tensorboard = self.tracker_for(stage)
        try:
            executor.start()
            if first and scfg.eval.every_steps:
                self.evaluate(scfg, workflow, task, tracker)
                self.history.append(tracker.commit(self.version))
            for stage_step in range(1, scfg.run.total_steps + 1):
                step_start = time.perf_counter()
                batch = executor.prepare_batch(self.version, timeout=scfg.rollout.batch_timeout_s)
                groups = list(executor.last_groups)
                train_metrics = trainer.step(batch)
                self.publish(trainer)
                executor.set_version(self.version)
                step_time = time.perf_counter() - step_start

                tracker.scalars(_rename_train_metrics(train_metrics))
                tracker.scalars(executor.metrics, reduce="last")
                self.record_engine(tracker, step_time)
                _reward_metrics(groups, tracker)
                tracker.scalar("perf/step_time", step_time)
                tracker.scalar("perf/trained_tokens_per_s", float(batch.loss_mask.sum()) / step_time)
                if scfg.logging.dump_every_steps and stage_step % scfg.logging.dump_every_steps == 0:
                    _dump_trajectories(
                        self.out / "trajectories.jsonl", self.version, groups, self.loaded.tokenizer, scfg.logging.dump_groups
                    )
                if self.eval_due(scfg, stage_step):
                    self.evaluate(scfg, workflow, task, tracker)
                self.history.append(tracker.commit(self.version))
        finally:
            executor.stop()
            tensorboard.close()

    def sft_stage(self, stage: Any, scfg: Config, trainer: Any, first: bool) -> None:
        raise NotImplementedError("SFT stages land with issue 10")


def train(cfg: Config, argv: Optional[list[str]] = None, console: Any = None) -> TrainResult:
    """Run the whole training job of ``cfg`` (all its stages); returns a summary (also printed)."""
    import jax

    from asyncrl.model import export_hf
    from asyncrl.provenance import write_provenance
    from asyncrl.trainer import Trainer

    started = time.monotonic()
    out = _prepare_output_dir(cfg)
    write_provenance(out, dump_config(cfg), argv)
    run = _Run(cfg, out, console)
    params = run.params
    try:
        for index, (stage, scfg) in enumerate(cfg.stage_configs()):
            # Each stage starts from the previous stage's weights with a fresh optimizer.
            trainer = Trainer(scfg, run.graphdef, params, mesh=run.mesh, version=run.version)
            runner = run.rl_stage if stage.type == "rl" else run.sft_stage
            runner(stage, scfg, trainer, first=index == 0)
            params = trainer.params_for_publish()
    finally:
        if run.engine is not None:
            run.engine.shutdown()
        run.jsonl.close()
        run.console.close()

    final_params = jax.tree.map(np.asarray, params)
    export_hf(run.graphdef, run.loaded.tokenizer, out / "hf", params=final_params)
    wall = time.monotonic() - started
    result = TrainResult(
        steps=run.version, final_eval=run.final_eval, wall_time_s=wall, output_dir=out, history=run.history,
        final_params=final_params,
    )
    evals = " ".join(f"{k}={v:.3f}" for k, v in run.final_eval.items() if k in ("eval/reward", "eval/accuracy"))
    stream = console or sys.stdout
    print(f"asyncrl: {run.version} steps, {evals or 'no eval'}, {wall:.0f} s, outputs in {out}", file=stream)
    print("training completed", file=stream)
    return result
