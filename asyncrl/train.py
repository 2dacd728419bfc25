"""The training loop behind ``asyncrl train CONFIG``.

Per step, on the main thread::

    got = executor.next_batch(v)               # groups with lag <= max_staleness
    metrics = trainer.step(got.batch)          # ppo_epochs x mini_batches optax updates
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

from asyncrl.checkpoint_schema import RUN_STATE_FORMAT
from asyncrl.build import build_engine, episode_metric_means, preflight
from asyncrl.config import Config, dump_config
from asyncrl.rundir import check_output_dir_path, prepare_output_dir
from asyncrl.errors import AsyncRLError, CheckpointError

log = logging.getLogger(__name__)


class TrainingInterrupted(Exception):
    """A signal stopped the run after a checkpoint was written; ``exit_code`` is 130/143."""

    def __init__(self, exit_code: int, checkpoint: Optional[Path]):
        self.exit_code = exit_code
        self.checkpoint = checkpoint
        super().__init__(f"training interrupted (exit {exit_code}); checkpoint: {checkpoint or 'none'}")


@dataclass
class TrainResult:
    steps: int
    final_eval: dict[str, float]
    wall_time_s: float
    output_dir: Path
    history: list[dict[str, float]]
    final_params: Any = None
    """The trained weights as host numpy arrays (the same as the ``hf/`` export)."""


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
    for name, value in episode_metric_means([t for g in groups for t in g.trajectories]).items():
        tracker.scalar(f"episode/{name}", value)


def _dump_trajectories(log_file: Any, step: int, groups: list, tokenizer: Any, limit: int) -> None:
    """Append the first ``limit`` groups of a step to ``trajectories.jsonl`` (a
    :class:`~asyncrl.metrics.LogAppender`: a failed write warns and the run goes on)."""
    lines = []
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
            lines.append(json.dumps(record, default=str) + "\n")
    log_file.append("".join(lines))


ENGINE_COUNTERS = ("engine/requests", "engine/samples_aborted", "engine/prefill_tokens", "engine/decode_tokens",
                   "engine/decode_steps", "engine/swaps")
"""Cumulative engine counters: saved in checkpoints and continued by a resumed run, so its
curves go on from where they were (the resumed process's engine counts from zero)."""


class _Run:
    """The state one run shares across its stages: model, mesh, engine, sinks, version,
    and the checkpoint it resumed from."""

    def __init__(self, cfg: Config, out: Path, console: Any, resumed: Any, guard: Any):
        from asyncrl.metrics import ConsoleSink, JsonlSink, LogAppender
        from asyncrl.model import load_model
        from asyncrl.trainer import build_mesh

        self.cfg = cfg
        self.out = out
        self.guard = guard
        self.resumed = resumed
        """The :class:`~asyncrl.checkpoint.Checkpoint` this run continues, or None."""
        self.loaded = load_model(cfg.model)
        self.graphdef, self.params = self.loaded.split()
        # With model.lora the trainer trains adapters on the frozen base; self.graphdef stays
        # the base model's (the engine serves merged weights, hf/ is the merged model).
        self.train_graphdef, self.frozen, self.lora_state = self.graphdef, None, None
        if cfg.model.lora is not None:
            self._attach_lora(cfg, resumed)
        self.mesh = build_mesh(cfg.mesh)
        self.device = _first_local_device(self.mesh)
        """The device whose memory ``perf/device_mem_gb`` reports (this process's first in the mesh)."""
        self.engine: Any = None
        self.version = resumed.step if resumed is not None else 0
        """Completed trainer steps over all stages: the version the engine serves."""
        self.console = ConsoleSink(cfg.total_steps, start_step=self.version, stream=console)
        self.jsonl = JsonlSink(out / "metrics.jsonl")
        self.trajectory_log = LogAppender(out / "trajectories.jsonl", create=False)
        self.history: list[dict[str, float]] = []
        self.final_eval: dict[str, float] = dict(resumed.state.get("final_eval", {})) if resumed else {}
        self.engine_counter_base: dict[str, float] = dict(resumed.state.get("engine_counters", {})) if resumed else {}
        """The engine counters of the run before the resume: the new engine counts from zero."""
        self.engine_counters = dict(self.engine_counter_base)
        self.generated_before = self.engine_counter_base.get("engine/decode_tokens", 0.0)
        self.last_checkpoint: Optional[Path] = None
        self.last_checkpoint_version = -1
        self.reward_failures = {"reward_errors": 0.0, "reward_timeouts": 0.0}
        """Reward function calls of this process that failed or timed out (all stages, eval included)."""
        self.parts: list[tuple[Config, Any, Any]] = []
        """Per stage: its config (rewards defaulted), its task data and its workflow (:func:`preflight`)."""

    def count_reward_failures(self, workflow: Any) -> None:
        """Add a finished stage's reward error and timeout counts (for the summary line)."""
        counts = workflow.metrics() if workflow is not None else {}
        for name in self.reward_failures:
            self.reward_failures[name] += float(counts.get(name, 0.0))

    def _attach_lora(self, cfg: Config, resumed: Any) -> None:
        """Fresh adapters on the loaded base (``self.params`` become the adapters); a resumed
        run first checks that the base is the one its checkpoint's adapters were trained on."""
        from asyncrl.model.lora import LoraSpec, attach_lora, base_identity, check_same_base

        self.lora_state = base_identity(self.loaded.path, self.params)
        if resumed is not None:
            check_same_base(resumed.state.get("lora"), self.lora_state, str(resumed.path))
        lora = attach_lora(self.loaded.config, self.params, LoraSpec.from_config(cfg.model.lora), seed=cfg.run.seed)
        self.train_graphdef, self.params, self.frozen = lora.graphdef, lora.adapters, lora.frozen

    def new_trainer(self, scfg: Config, params: Any, objective: str) -> Any:
        from asyncrl.trainer import Trainer

        return Trainer(scfg, self.train_graphdef, params, mesh=self.mesh, version=self.version, objective=objective,
                       frozen=self.frozen)

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

    def stage_start(self, index: int, previous: Any) -> Any:
        """The weights stage ``index`` started from: ``previous`` (the last stage's result), or
        on a resume inside this stage the saved ones (stage 0: the loaded model)."""
        if self.resume_position(index) is None:
            return previous
        if "stage_start_params" in self.resumed.arrays:
            return self.resumed.arrays["stage_start_params"]
        if index == 0:
            from asyncrl.checkpoint import flatten_tree, unflatten_nested

            # In the saved trees' spelling (nested dicts, str keys), like the params it is loaded with.
            return unflatten_nested(flatten_tree(self.params))
        return self.resumed.arrays["params"]

    def trainer_for(self, index: int, stage: Any, scfg: Config, params: Any) -> Any:
        """A fresh trainer (and optimizer) for stage ``index`` starting from ``params``, or the
        saved one on resume."""
        objective = stage.type

        resumed = self.resumed
        if resumed is not None and resumed.state["stage_index"] == index:
            # ``params`` are the stage's starting weights (the KL reference): saved for stages > 0,
            # the loaded model for stage 0.
            trainer = self.new_trainer(scfg, params, objective)
            _load_trainer_state(trainer, resumed)
            return trainer
        return self.new_trainer(scfg, params, objective)

    def ensure_engine(self, trainer: Any, scfg: Config) -> Any:
        if self.engine is None:
            self.engine = build_engine(scfg, self.loaded, self.graphdef, trainer.params_for_publish(), version=self.version,
                                       out=self.out)
        return self.engine

    def publish(self, trainer: Any) -> None:
        self.engine.update_weights(trainer.params_for_publish(), self.version + 1)
        self.version += 1

    def evaluate(self, scfg: Config, workflow: Any, task: Any, tracker: Any) -> None:
        from asyncrl.evaluate import evaluate

        result = evaluate(self.engine, workflow, task.eval, scfg, eval_metrics=task.eval_metrics)
        self.final_eval = result.metrics
        tracker.scalars(result.metrics, reduce="last")

    def engine_metrics(self) -> dict[str, float]:
        """The engine's metrics, its counters continued from the resumed run's; the counters
        are kept for the next checkpoint (as of this call: work started later is not counted,
        since a resume redoes it)."""
        engine_metrics = self.engine.metrics()
        for name in ENGINE_COUNTERS:
            if name in engine_metrics:
                engine_metrics[name] += self.engine_counter_base.get(name, 0.0)
                self.engine_counters[name] = engine_metrics[name]
        return engine_metrics

    def record_engine(self, tracker: Any, step_time: float, engine_metrics: dict[str, float]) -> None:
        tracker.scalars(engine_metrics, reduce="last")
        generated = engine_metrics.get("engine/decode_tokens", 0.0)
        tracker.scalar("perf/gen_tokens_per_s", (generated - self.generated_before) / step_time)
        self.generated_before = generated

    def record_process(self, tracker: Any) -> None:
        """Host RSS, live threads and device memory: a leak shows as a rising curve."""
        from asyncrl.metrics import process_metrics

        tracker.scalars(process_metrics(self.device), reduce="last")

    def eval_due(self, scfg: Config, stage_step: int) -> bool:
        every = scfg.eval.every_steps
        return bool(every) and (stage_step % every == 0 or stage_step == scfg.run.total_steps)

    def checkpoint_due(self, stage_step: int, stage_total: int) -> bool:
        every = self.cfg.checkpoint.every_steps
        return stage_step == stage_total or (every > 0 and self.version % every == 0) or self.guard.requested

    def save(self, index: int, stage_step: int, trainer: Any, stage_start: Any, rollout_state: Any = None,
             extra: Optional[dict] = None) -> None:
        from asyncrl.checkpoint import save_checkpoint

        trainer_state = trainer.state_dict()
        arrays = {"params": trainer_state.pop("params"), "opt_state": trainer_state.pop("opt_state")}
        if index > 0 and trainer.ref_params is not None:
            arrays["stage_start_params"] = jax_to_numpy(stage_start)
        state = {
            "format": RUN_STATE_FORMAT, "version": self.version, "stage_index": index, "stage_step": stage_step, "trainer": trainer_state,
            "final_eval": self.final_eval, "engine_counters": self.engine_counters, **(extra or {}),
        }
        if self.lora_state is not None:
            state["lora"] = self.lora_state  # params are adapters: of this base only
        self.last_checkpoint = save_checkpoint(
            self.out, self.version, arrays=arrays, state=state, config_yaml=dump_config(self.cfg),
            rollout_state=rollout_state, keep=self.cfg.checkpoint.keep,
        )
        self.last_checkpoint_version = self.version

    def resume_position(self, index: int) -> Optional[int]:
        """Steps of stage ``index`` already done according to the checkpoint (None: not resumed there)."""
        if self.resumed is None or self.resumed.state["stage_index"] != index:
            return None
        return int(self.resumed.state["stage_step"])

    def stop_if_requested(self) -> None:
        if self.guard.requested:
            raise TrainingInterrupted(self.guard.exit_code, self.last_checkpoint)

    # ------------------------------------------------------------------ stages

    def rl_stage(self, index: int, stage: Any, scfg: Config, trainer: Any, stage_start: Any) -> None:
        from asyncrl.data import SampleOrder
        from asyncrl.rollout.executor import BatchAbandoned, WorkflowExecutor

        scfg, task, workflow = self.parts[index]
        engine = self.ensure_engine(trainer, scfg)
        executor = WorkflowExecutor(
            workflow, engine, SampleOrder(task.train, scfg.run.seed), scfg, version=self.version,
            row_multiple=trainer.row_multiple,
        )
        done = self.resume_position(index)
        if done is not None:
            executor.load_state_dict(self.resumed.rollout_state)
        tracker, tensorboard = self.tracker_for(stage)
        try:
            executor.start()
            if index == 0 and done is None and scfg.eval.every_steps:
                self.evaluate(scfg, workflow, task, tracker)
                self.history.append(tracker.commit(self.version))
            for stage_step in range((done or 0) + 1, scfg.run.total_steps + 1):
                step_start = time.perf_counter()
                try:
                    got = executor.next_batch(
                        self.version, timeout=scfg.rollout.batch_timeout_s, abandon_if=lambda: self.guard.requested
                    )
                except BatchAbandoned:
                    # A signal came while waiting for rollouts (which may take longer than the
                    # guard's grace period): the step never started, so checkpoint the last one.
                    if self.last_checkpoint_version != self.version:
                        self.save(index, stage_step - 1, trainer, stage_start, rollout_state=executor.state_dict())
                    self.stop_if_requested()
                    raise
                batch, groups = got.batch, list(got.groups)
                train_metrics = trainer.step(batch)
                self.publish(trainer)
                # Engine counters (and the checkpoint's copy of them) are read before admission moves
                # on: with max_staleness 0 no request of the next step can have started, so the
                # counts are exact and a resume continues them without counting anything twice.
                engine_metrics = self.engine_metrics()
                executor.set_version(self.version)
                step_time = time.perf_counter() - step_start

                tracker.scalars(train_metrics)
                tracker.scalars(got.metrics, reduce="last")
                self.record_engine(tracker, step_time, engine_metrics)
                _reward_metrics(groups, tracker)
                tracker.scalar("perf/step_time", step_time)
                tracker.scalar("perf/trained_tokens_per_s", float(batch.loss_mask.sum()) / step_time)
                self.record_process(tracker)
                if scfg.logging.dump_every_steps and stage_step % scfg.logging.dump_every_steps == 0:
                    _dump_trajectories(
                        self.trajectory_log, self.version, groups, self.loaded.tokenizer, scfg.logging.dump_groups
                    )
                if self.eval_due(scfg, stage_step):
                    self.evaluate(scfg, workflow, task, tracker)
                self.history.append(tracker.commit(self.version))
                if self.checkpoint_due(stage_step, scfg.run.total_steps):
                    self.save(index, stage_step, trainer, stage_start, rollout_state=executor.state_dict())
                self.stop_if_requested()
        finally:
            executor.close()
            tensorboard.close()
            self.count_reward_failures(workflow)

    def sft_stage(self, index: int, stage: Any, scfg: Config, trainer: Any, stage_start: Any) -> None:
        """Cross-entropy on reference responses; publishes every step like RL, so eval and
        the next stage's engine see exactly these weights."""
        from asyncrl.sft import SFTData, eval_loss

        scfg, task, workflow = self.parts[index]
        self.ensure_engine(trainer, scfg)
        eos = self.loaded.stop_token_ids[0] if self.loaded.stop_token_ids else None
        data = SFTData.for_task(task, workflow, scfg, eos_token_id=eos, row_multiple=trainer.row_multiple)
        eval_data = SFTData.for_task(task, workflow, scfg, split="eval", eos_token_id=eos, row_multiple=trainer.row_multiple)
        done = self.resume_position(index)
        if done is not None:
            data.load_state_dict(self.resumed.state["sft"])
        tracker, tensorboard = self.tracker_for(stage)

        def run_eval() -> None:
            self.evaluate(scfg, workflow, task, tracker)
            tracker.scalars(eval_loss(trainer, eval_data), reduce="last")

        try:
            if index == 0 and done is None and scfg.eval.every_steps:
                run_eval()
                self.history.append(tracker.commit(self.version))
            for stage_step in range((done or 0) + 1, scfg.run.total_steps + 1):
                step_start = time.perf_counter()
                got = data.next_batch()
                batch = got.batch
                train_metrics = trainer.step(batch)
                self.publish(trainer)
                step_time = time.perf_counter() - step_start
                self.engine_metrics()  # the counters (weight swaps) for the checkpoint
                tracker.scalars(train_metrics)
                tracker.scalars(got.metrics, reduce="last")
                tracker.scalar("perf/step_time", step_time)
                tracker.scalar("perf/trained_tokens_per_s", float(batch.loss_mask.sum()) / step_time)
                self.record_process(tracker)
                if self.eval_due(scfg, stage_step):
                    run_eval()
                self.history.append(tracker.commit(self.version))
                if self.checkpoint_due(stage_step, scfg.run.total_steps):
                    self.save(index, stage_step, trainer, stage_start, extra={"sft": data.state_dict()})
                self.stop_if_requested()
        finally:
            tensorboard.close()
            self.count_reward_failures(workflow)


def _check_resumed_state(resumed: Any, cfg: Config) -> None:
    """A resumed checkpoint's JSON files parse and agree with each other and with the config's
    stages, before anything of it is used (or any log is cut back to its step)."""
    if resumed is not None:
        from asyncrl.checkpoint_schema import check_run_checkpoint

        check_run_checkpoint(resumed, cfg)


def _check_resumed_params(run: _Run) -> None:
    """A resumed checkpoint's parameters have the loaded model's names, shapes and dtypes."""
    if run.resumed is not None:
        from asyncrl.checkpoint_schema import check_checkpoint_params

        check_checkpoint_params(run.resumed, run.params)


def _load_trainer_state(trainer: Any, resumed: Any) -> None:
    """The saved optimizer state and counters into ``trainer``; a mismatch names the checkpoint."""
    from asyncrl.errors import TrainerError

    try:
        trainer.load_state_dict(
            {"params": resumed.arrays["params"], "opt_state": resumed.arrays["opt_state"], **resumed.state["trainer"]}
        )
    except TrainerError as err:
        raise CheckpointError(f"checkpoint {resumed.path}: opt_state.safetensors: {err}") from None


def _check_all_steps_ran(run: _Run, cfg: Config) -> None:
    """A run that ends without error has trained every configured step (never exit 0 short)."""
    if run.version < cfg.total_steps:
        raise AsyncRLError(
            f"the run stopped at step {run.version} of {cfg.total_steps} without an error: this is a bug or a "
            f"damaged checkpoint ({run.resumed.path if run.resumed is not None else 'no checkpoint'}); not exporting"
        )


def _first_local_device(mesh: Any) -> Any:
    import jax

    return next((d for d in mesh.devices.flat if d.process_index == jax.process_index()), None)


def jax_to_numpy(tree: Any) -> Any:
    import jax

    return jax.tree.map(np.asarray, tree)


def _export_adapter(cfg: Config, run: "_Run", adapters: Any, overwrite: bool) -> None:
    """A LoRA run's final adapters as a PEFT adapter directory ``adapter/`` beside ``hf/``."""
    from asyncrl.model.lora import LoraSpec, export_peft_adapter

    export_peft_adapter(adapters, LoraSpec.from_config(cfg.model.lora), cfg.run.resolved_output_dir / "adapter",
                        base_model=run.lora_state["base_model_path"], overwrite=overwrite)


def train(cfg: Config, argv: Optional[list[str]] = None, console: Any = None) -> TrainResult:
    """Run the whole training job of ``cfg`` (all its stages); returns a summary (also printed).

    With ``checkpoint.resume: auto`` it continues from the newest complete checkpoint in
    ``run.output_dir``. SIGINT/SIGTERM end the current step, write a checkpoint and raise
    :class:`TrainingInterrupted` (the CLI exits 130/143); a second signal exits at once.
    """
    from asyncrl.checkpoint import resume_checkpoint
    from asyncrl.model import export_hf
    from asyncrl.provenance import write_provenance
    from asyncrl.shutdown import ShutdownGuard

    started = time.monotonic()
    check_output_dir_path(cfg)
    resumed = resume_checkpoint(cfg)
    _check_resumed_state(resumed, cfg)
    out = prepare_output_dir(cfg, resumed.step if resumed is not None else None)
    write_provenance(out, dump_config(cfg), argv)
    with ShutdownGuard() as guard:
        run = _Run(cfg, out, console, resumed, guard)
        start_stage = resumed.state["stage_index"] if resumed is not None else 0
        params = resumed.arrays["params"] if resumed is not None else run.params
        try:
            _check_resumed_params(run)
            run.parts = preflight(cfg, run.loaded.tokenizer)
            for index, (stage, scfg) in enumerate(cfg.stage_configs()):
                if index < start_stage:
                    continue
                # Each stage starts from the previous stage's weights with a fresh optimizer.
                # A resumed stage keeps its own start (its KL reference, saved again by every checkpoint).
                stage_start = run.stage_start(index, params)
                trainer = run.trainer_for(index, stage, scfg, stage_start)
                if run.resume_position(index) != scfg.run.total_steps:
                    runner = run.rl_stage if stage.type == "rl" else run.sft_stage
                    runner(index, stage, scfg, trainer, stage_start=stage_start)
                params = trainer.trainable_params()
            final_params = jax_to_numpy(trainer.params_for_publish())
        finally:
            if run.engine is not None:
                run.engine.shutdown()
            run.jsonl.close()
            run.trajectory_log.close()
            run.console.close()

    _check_all_steps_ran(run, cfg)
    # A resumed run (killed after its last checkpoint, or resumed when already finished)
    # may find its own earlier export: the final weights are the same, so replace it.
    export_hf(run.graphdef, run.loaded.tokenizer, out / "hf", params=final_params,
              overwrite=resumed is not None or cfg.run.overwrite)
    if run.lora_state is not None:
        _export_adapter(cfg, run, params, overwrite=resumed is not None or cfg.run.overwrite)
    wall = time.monotonic() - started
    result = TrainResult(
        steps=run.version, final_eval=run.final_eval, wall_time_s=wall, output_dir=out, history=run.history,
        final_params=final_params,
    )
    evals = " ".join(f"{k}={v:.3f}" for k, v in run.final_eval.items() if k in ("eval/reward", "eval/accuracy"))
    failures = run.reward_failures
    stream = console or sys.stdout
    print(
        f"asyncrl: {run.version} steps, {evals or 'no eval'}, reward errors {failures['reward_errors']:.0f} "
        f"timeouts {failures['reward_timeouts']:.0f}, {wall:.0f} s, outputs in {out}",
        file=stream,
    )
    print("training completed", file=stream)
    return result
