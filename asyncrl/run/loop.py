"""The training loop behind ``asyncrl train CONFIG``.

A run is a list of stages (RL or SFT); :func:`train` builds what they share (:class:`Run`:
model, mesh, engine, sinks, the version, the checkpoint it resumed from) and runs each with
:func:`run_stage` over its batch source (:class:`~asyncrl.rollout.batch.BatchSource`: the RL
stage's :class:`~asyncrl.rollout.executor.WorkflowExecutor`, the SFT stage's
:class:`~asyncrl.run.sft.SFTData`). Per step, on the main thread::

    got = source.next_batch(v)                 # RL: groups with lag <= max_staleness
    metrics = trainer.step(got.batch)          # ppo_epochs x mini_batches optax updates
    engine.update_weights(params, v + 1)       # returns once every new token carries v+1
    counters = engine.metrics()                # before admission moves on: exact for a resume
    source.set_version(v + 1)                  # only then may admission move on
    metrics, trajectory dump, eval (between publishes: one version), checkpoint

Rollouts run in the background the whole time, bounded by ``rollout.max_staleness``;
``0`` is synchronous on-policy training with the same code. Data only flows down this
list; the only thing that goes back up is published weights with their version.

Run as N processes (``mesh.distributed``, or ``JAX_COORDINATOR_ADDRESS``...), the same loop
runs in each: process 0's source, engine and logs, every process's trainer step on its block
of each batch; :mod:`asyncrl.run.multihost` holds what differs by process (docs/scaling.md).

Any thread's crash ends the run with that thread's traceback (the executor re-raises
rollout and engine failures in the main thread), and everything is stopped in a
``finally`` so nothing hangs. A checkpoint write that failed in the background (disk full)
ends the run at the end of the step in progress, on every process, with one line. SIGINT/SIGTERM: the step in progress ends (or the wait for
its batch is abandoned), one checkpoint is written, :class:`TrainingInterrupted` is raised.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, TextIO

from asyncrl.config import Config, dump_config
from asyncrl.errors import AsyncRLError, CheckpointError
from asyncrl.pytree import tree_to_host
from asyncrl.rollout.batch import BatchAbandoned, BatchSource, PreparedBatch
from asyncrl.run.build import preflight
from asyncrl.run.run_state import (
    Params,
    Run,
    Stage,
    TrainingInterrupted,
)
from asyncrl.run.rundir import check_output_dir_path, prepare_output_dir
from asyncrl.run.startup import StartupClock

if TYPE_CHECKING:

    from asyncrl.checkpoint import Checkpoint
    from asyncrl.rollout.trajectory import TrajectoryGroup
    from asyncrl.run.metrics import StatsTracker
    from asyncrl.trainer import Trainer

log = logging.getLogger(__name__)


EvalHook = Callable[["StatsTracker"], None]
"""A stage's eval as the loop calls it: runs it and records its metrics on the stage's tracker
(called between publishes, so every eval request sees one version)."""



@dataclass
class TrainResult:
    steps: int
    final_eval: dict[str, float]
    wall_time_s: float
    output_dir: Path
    history: list[dict[str, float]]
    final_params: Params = None
    """The trained weights as host numpy arrays (the same as the ``hf/`` export)."""


# ---------------------------------------------------------------------------- the whole run


def train(cfg: Config, argv: Optional[list[str]] = None, console: Optional[TextIO] = None) -> TrainResult:
    """Run the whole training job of ``cfg`` (all its stages); returns a summary (also printed).

    With ``checkpoint.resume: auto`` it continues from the newest complete checkpoint in
    ``run.output_dir``. SIGINT/SIGTERM end the current step, write a checkpoint and raise
    :class:`TrainingInterrupted` (the CLI exits 130/143); a second signal exits at once.
    """
    from asyncrl.checkpoint import resume_checkpoint
    from asyncrl.cluster.distributed import initialize_distributed
    from asyncrl.imports import import_without
    from asyncrl.run.compile_cache import enable_compile_cache
    from asyncrl.run.host_memory import keep_freed_host_memory
    from asyncrl.run.multihost import Hosts
    from asyncrl.run.provenance import write_provenance
    from asyncrl.run.shutdown import ShutdownGuard
    from asyncrl.run.trackers import check_trackers_installed

    started = time.monotonic()
    if cfg.run.keep_host_memory:  # before JAX starts its thread pools (asyncrl.run.host_memory)
        keep_freed_host_memory()
    # tensorboardX without its torch import, before any thread (watchdog, engine, rollouts) starts.
    import_without("tensorboardX", "torch")
    enable_compile_cache(cfg.run.compile_cache)  # before the first compilation of the run
    initialize_distributed(cfg.mesh)  # before anything touches a JAX device
    hosts = Hosts(barrier_timeout_s=cfg.checkpoint.barrier_timeout_s)
    _check_shares(cfg, hosts.count)
    check_output_dir_path(cfg)
    if hosts.is_main:  # only process 0 logs to W&B/MLflow
        check_trackers_installed(cfg.logging.trackers)
    resumed = resume_checkpoint(cfg)
    hosts.same_everywhere(resumed.step if resumed is not None else -1, "the checkpoint to resume from (-1: none)",
                          "every process must see the same run.output_dir (a shared file system)")
    _check_resumed_state(resumed, cfg)

    def prepare() -> Path:
        out = prepare_output_dir(cfg, resumed.step if resumed is not None else None)
        write_provenance(out, dump_config(cfg), argv)
        return out

    # Only process 0 writes in run.output_dir (logs, provenance, checkpoints, exports).
    out = hosts.on_main(prepare, "preparing run.output_dir") or cfg.run.resolved_output_dir
    with ShutdownGuard() as guard:
        hosts.watch(guard)
        try:
            run = Run(cfg, out, console, resumed, guard, hosts, StartupClock(started))
            run.startup.record("load", time.monotonic() - started)
            try:
                _check_resumed_params(run)
                params, final_params = run_stages(run)
            except BaseException as failure:
                run.close(failure)
                raise
            run.close()
        finally:
            hosts.close()
    _check_all_steps_ran(run, cfg)
    return _finish(run, params, final_params, time.monotonic() - started, console)


def run_stages(run: "Run") -> tuple[Params, Params]:
    """Every stage not finished yet, in order; returns the trainable params of the last one
    and the final weights (merged with LoRA) as host arrays."""
    cfg = run.cfg
    parts = preflight(cfg, run.loaded.tokenizer)
    start_stage = run.resumed.state["stage_index"] if run.resumed is not None else 0
    params = run.params  # a resumed stage starts from its saved weights (run.stage_start)
    trainer: Optional[Trainer] = None
    for index, ((spec, _), (scfg, task, workflow)) in enumerate(zip(cfg.stage_configs(), parts)):
        if index < start_stage:
            continue
        # Each stage starts from the previous stage's weights with a fresh optimizer. A resumed
        # stage keeps its own start (its KL reference, saved again by every checkpoint).
        done = run.resume_position(index)
        stage = Stage(index, spec.name, spec.type, scfg, task, workflow,
                      start_params=run.stage_start(index, params), done=done)
        trainer = _stage_trainer(run, stage)
        if done != scfg.run.total_steps:
            if not run.startup.done:
                _start_precompile(run, stage, trainer)
            building = time.monotonic()
            run.ensure_engine(trainer, scfg)
            run.startup.record("engine", time.monotonic() - building)
            build = rl_source if stage.type == "rl" else sft_source
            # Every process makes its block of each batch (its executor, workflows and engine, or
            # its block of the SFT data), evaluates its share and trains (asyncrl.run.multihost).
            source, record_eval = build(run, stage, trainer)
            run_stage(run, stage, trainer, run.hosts.batch_source(source), record_eval)
        params = trainer.trainable_params()
    assert trainer is not None, "a config has at least one stage"
    if trainer.critic_spec is not None:
        run.final_critic = (trainer.critic_spec.model_cfg, tree_to_host(trainer.critic_params_for_export()))
    return params, tree_to_host(trainer.params_for_publish())


def _finish(run: "Run", params: Params, final_params: Params, wall: float, console: Optional[TextIO]) -> TrainResult:
    """Export ``hf/`` (and a LoRA run's ``adapter/``), print the summary line."""
    from asyncrl.model import export_hf

    cfg, out = run.cfg, run.out
    if not run.hosts.is_main:  # process 0 writes the exports and prints the summary
        return TrainResult(steps=run.version, final_eval=run.final_eval, wall_time_s=wall, output_dir=out,
                           history=run.history, final_params=final_params)
    # A resumed run (killed after its last checkpoint, or resumed when already finished)
    # may find its own earlier export: the final weights are the same, so replace it.
    overwrite = run.resumed is not None or cfg.run.overwrite
    export_hf(run.graphdef, run.loaded.tokenizer, out / "hf", params=final_params, overwrite=overwrite)
    if run.lora_state is not None:
        _export_adapter(cfg, run.lora_state["base_model_path"], params, overwrite=overwrite)
    if run.final_critic is not None:  # the value model beside the policy, as *ForTokenClassification
        from asyncrl.model.critic import export_critic

        export_critic(*run.final_critic, out / "hf_critic", tokenizer=run.loaded.tokenizer, overwrite=overwrite)
    evals = " ".join(f"{k}={v:.3f}" for k, v in run.final_eval.items() if k in ("eval/reward", "eval/accuracy"))
    failures = run.reward_failures
    stream = console or sys.stdout
    startup = run.startup.summary()
    print(
        f"asyncrl: {run.version} steps, {evals or 'no eval'}, reward errors {failures['reward_errors']:.0f} "
        f"timeouts {failures['reward_timeouts']:.0f}, {wall:.0f} s, {startup + ', ' if startup else ''}outputs in {out}",
        file=stream,
    )
    print("training completed", file=stream)
    return TrainResult(steps=run.version, final_eval=run.final_eval, wall_time_s=wall, output_dir=out,
                       history=run.history, final_params=final_params)


# ---------------------------------------------------------------------------- one stage


def run_stage(run: "Run", stage: Stage, trainer: Trainer, source: BatchSource, record_eval: EvalHook) -> None:
    """Train ``stage`` from its first step not done to its last, on batches from ``source``.

    ``record_eval(tracker)`` records the stage's eval metrics (between publishes: one version).
    Closes ``source`` and the stage's TensorBoard writer however it ends.
    """
    scfg = stage.cfg
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(run.count_reward_failures, stage.workflow)
        cleanup.callback(source.close)
        tracker, tensorboard = run.tracker_for(stage.name)
        cleanup.callback(tensorboard.close)
        if stage.index == 0 and stage.done is None and scfg.eval.every_steps:
            _timed_eval(record_eval, tracker)  # step 0: the model before any training
            run.history.append(tracker.commit(run.version))
        for stage_step in range((stage.done or 0) + 1, scfg.run.total_steps + 1):
            step_start = time.perf_counter()
            got = _next_batch(run, stage, stage_step, trainer, source)
            run.startup.record("first_batch_wait", time.perf_counter() - step_start)
            train_metrics = trainer.step(got.batch)
            run.publish(trainer)  # the engine serves v+1 when this returns
            # Engine counters (and the checkpoint's copy of them) are read before admission moves
            # on: with max_staleness 0 no request of the next step can have started, so the
            # counts are exact and a resume continues them without counting anything twice.
            engine_metrics = run.read_engine_counters()
            source.set_version(run.version)
            step_time = time.perf_counter() - step_start

            dump = []
            if scfg.logging.dump_every_steps and stage_step % scfg.logging.dump_every_steps == 0:
                # Every process renders its groups among the step's first dump_groups (its share's offset).
                first = run.hosts.share(scfg.rollout.batch_size).offset if stage.type == "rl" else 0
                dump = trajectory_records(run.version, got.groups, run.loaded.tokenizer,
                                          max(0, scfg.logging.dump_groups - first))
            metrics, records = run.step_metrics(got, train_metrics, engine_metrics, step_time, dump)
            tracker.scalars(metrics, reduce="last")
            tracker.scalars(run.startup.first_step(trainer.precompile_hit), reduce="last")  # the run's first step only
            if records:
                run.trajectory_log.append("".join(json.dumps(record, default=str) + "\n" for record in records))
                if run.trackers is not None:
                    run.trackers.log_trajectories(run.version, records)
            if eval_due(scfg, stage_step):
                _timed_eval(record_eval, tracker)
            run.history.append(tracker.commit(run.version))
            # The same answers on every process: a signal, and a checkpoint write that failed in
            # the background (disk full...), which ends the run here rather than at the next save.
            stop, failed_saves = run.hosts.agree_stop(save_failed=run.checkpoint_failed())
            if failed_saves:
                run.raise_failed_checkpoint(failed_saves)
            if run.checkpoint_due(stage_step, scfg.run.total_steps, stopping=stop is not None):
                saving = time.perf_counter()
                run.save(stage, stage_step, trainer, source)
                # Rows are committed before their checkpoint (a resume cuts the logs back to it),
                # so this lands in the next step's row; the stage's last checkpoint is not logged.
                tracker.scalar("perf/checkpoint_time", time.perf_counter() - saving, reduce="last")
            if stop is not None:
                run.finish_checkpoint()  # the checkpoint is complete before the run exits
                raise TrainingInterrupted(stop, run.last_checkpoint)
        run.finish_checkpoint()  # a stage boundary: its last checkpoint is complete


def _timed_eval(record_eval: EvalHook, tracker: StatsTracker) -> None:
    """``record_eval(tracker)`` and its wall time as ``perf/eval_time`` (outside ``perf/step_time``)."""
    start = time.perf_counter()
    record_eval(tracker)
    tracker.scalar("perf/eval_time", time.perf_counter() - start, reduce="last")


def _next_batch(run: "Run", stage: Stage, stage_step: int, trainer: Trainer, source: BatchSource) -> PreparedBatch:
    """The step's batch; a signal while waiting for it checkpoints the last step and stops."""
    try:
        return source.next_batch(run.version, timeout=stage.cfg.rollout.batch_timeout_s,
                                 abandon_if=run.hosts.stop_requested)
    except BatchAbandoned:
        # A signal (here, or on another process) came while waiting for rollouts (which may
        # take longer than the guard's grace period): the step never started, so checkpoint
        # the last one. Every process takes this path for the same batch.
        if run.last_checkpoint_version != run.version:
            run.save(stage, stage_step - 1, trainer, source)
        run.finish_checkpoint()
        raise TrainingInterrupted(run.hosts.abandon_code(), run.last_checkpoint) from None


def eval_due(scfg: Config, stage_step: int) -> bool:
    every = scfg.eval.every_steps
    return bool(every) and (stage_step % every == 0 or stage_step == scfg.run.total_steps)


def rl_source(run: "Run", stage: Stage, trainer: Trainer) -> tuple[BatchSource, EvalHook]:
    """The RL stage's executor over this process's share of the prompts (its rollout state restored
    on a resume, redistributed when the process count or batch size changed; started) and its eval
    (every process runs its share, process 0 records the whole)."""
    from asyncrl.data import SampleOrder
    from asyncrl.rollout.executor import WorkflowExecutor

    scfg = stage.cfg
    assert run.engine is not None, "every process holds its engine (Run.ensure_engine)"
    executor = WorkflowExecutor(stage.workflow, run.engine, SampleOrder(stage.task.train, scfg.run.seed), scfg,
                                version=run.version, row_multiple=trainer.row_multiple,
                                share=run.hosts.share(scfg.rollout.batch_size))
    if stage.done is not None:
        executor.load_state_dict(_own_rollout_state(run, stage))
    executor.start()
    run.join_on_close(functools.partial(_join_executor, executor))
    return executor, lambda tracker: run.eval_on_engine(stage, tracker)


def _own_rollout_state(run: "Run", stage: Stage) -> Any:
    """This process's rollout state from the checkpoint: its own where the checkpoint was written
    by as many processes with the same batch size, else its part of every writer's states
    redistributed (:func:`~asyncrl.rollout.redistribute.redistribute_states`: no sample lost or repeated)."""
    from asyncrl.rollout.redistribute import redistribute_states

    states = run.resumed_inside(stage).rollout_states
    assert states, "check_run_checkpoint requires an RL stage's rollout state"
    batch_size = stage.cfg.rollout.batch_size
    written_by = [int(s["meta"]["ledger"]["batch_size"]) for s in states]
    if len(states) == run.hosts.count and sum(written_by) == batch_size:
        return states[run.hosts.index]
    if len(states) != run.hosts.count:
        log.info("the checkpoint's rollout state was written by %d process(es); redistributing its samples over %d",
                 len(states), run.hosts.count)
    return redistribute_states(states, batch_size, run.hosts.count)[run.hosts.index]


def _join_executor(executor: Any, timeout: float) -> list[str]:
    """Stop the executor and wait for its workers (after the engine's shutdown, which ends the
    engine calls they wait in); returns the names of those still running."""
    from asyncrl.run.shutdown import join_threads

    executor.close(timeout)
    return join_threads(list(executor.workers), timeout)


def sft_source(run: "Run", stage: Stage, trainer: Trainer) -> tuple[BatchSource, EvalHook]:
    """The SFT stage's data (its position restored on a resume) and its eval: the task's
    greedy eval through the engines, as in RL, and the held-out loss. With several processes
    every process reads the same data and takes its block of each batch, and computes the
    held-out loss on its block of each eval batch (the eval split is the same everywhere)."""
    from asyncrl.run.sft import SFTData, eval_loss

    scfg = stage.cfg
    eos = run.loaded.stop_token_ids[0] if run.loaded.stop_token_ids else None
    held_out = run.hosts.eval_blocks(SFTData.for_task(stage.task, stage.workflow, scfg, split="eval", eos_token_id=eos,
                                                      row_multiple=trainer.row_multiple), trainer.row_multiple)
    data = SFTData.for_task(stage.task, stage.workflow, scfg, eos_token_id=eos, row_multiple=trainer.row_multiple)
    if stage.done is not None:
        data.load_state_dict(run.resumed_inside(stage).state["sft"])

    def record_eval(tracker: StatsTracker) -> None:
        run.eval_on_engine(stage, tracker)
        tracker.scalars(eval_loss(trainer, held_out), reduce="last")

    return run.hosts.own_blocks(data, trainer.row_multiple), record_eval


def trajectory_records(step: int, groups: Sequence[TrajectoryGroup], tokenizer: Any, limit: int) -> list[dict]:
    """The ``trajectories.jsonl`` records of a step's first ``limit`` groups (the trackers'
    trajectory table too)."""
    records = []
    for group in groups[:limit]:
        for traj in group.trajectories:
            prompt_ids = traj.input_ids[~traj.loss_mask & (traj.versions < 0)]
            generated = traj.versions >= 0
            records.append({
                "step": step,
                "prompt": tokenizer.decode(prompt_ids.tolist(), skip_special_tokens=False),
                "completion": tokenizer.decode(traj.input_ids[generated].tolist(), skip_special_tokens=False),
                "reward": traj.reward,
                "reward_components": traj.reward_components,
                "versions": sorted(set(traj.versions[generated].tolist())),
                "stop_reason": traj.stop_reason,
                "metadata": traj.metadata,
            })
    # JSON's own types (a numpy scalar in metadata, ...), as they are written and gathered.
    return json.loads(json.dumps(records, default=str))


# ---------------------------------------------------------------------------- resume and export


def _start_precompile(run: Run, stage: Stage, trainer: Trainer) -> None:
    """Compile the run's first train step while the engine starts and generates the first batch
    (:mod:`asyncrl.trainer.precompile`): for RL stages of a one-process run with the persistent
    compilation cache on (the way the compiled program reaches the step), unpacked (a packed
    batch's row count depends on its lengths)."""
    import jax

    from asyncrl.trainer.precompile import expected_first_shape

    if stage.type != "rl" or run.hosts.multi or stage.cfg.rollout.pack \
            or not jax.config.values.get("jax_enable_compilation_cache"):
        return
    scfg = stage.cfg
    rows = scfg.rollout.batch_size * scfg.rollout.group_size
    precompile = trainer.start_precompile(expected_first_shape(scfg, rows, trainer.row_multiple))
    run.join_on_close(precompile.join)  # a failure before the step settles it must not exit under the compile


def _stage_trainer(run: Run, stage: Stage) -> Trainer:
    """A fresh trainer (and optimizer) for ``stage`` starting from its start weights, or, on a
    resume inside the stage, the saved one (its start weights are then the KL reference)."""
    from asyncrl.trainer import Trainer

    # On a resume the optimizer state is only described (shapes and shardings) and read straight
    # from the checkpoint: a freshly initialised one would sit beside the restored one.
    trainer = Trainer(stage.cfg, run.train_graphdef, stage.start_params, mesh=run.mesh, version=run.version,
                      objective=stage.type, frozen=run.frozen, critic=run.critic_model,
                      state_from_checkpoint=stage.done is not None)
    if stage.done is not None:
        _load_trainer_state(trainer, run.resumed_inside(stage))
    return trainer


def _check_shares(cfg: Config, processes: int) -> None:
    """Every process generates a share of each RL batch: at least one group each."""
    from asyncrl.errors import ConfigError

    for index, (spec, scfg) in enumerate(cfg.stage_configs()):
        if spec.type == "rl" and scfg.rollout.batch_size < processes:
            where = f"stages.{index} ({spec.name}): " if cfg.stages else ""
            raise ConfigError(f"{where}rollout.batch_size = {scfg.rollout.batch_size} is smaller than the {processes} "
                              f"processes of the run: every process generates and trains its share of each batch; use "
                              f"rollout.batch_size >= {processes}")


def _check_resumed_state(resumed: Optional[Checkpoint], cfg: Config) -> None:
    """A resumed checkpoint's JSON files parse and agree with each other and with the config's
    stages, before anything of it is used (or any log is cut back to its step)."""
    if resumed is not None:
        from asyncrl.checkpoint.schema import check_run_checkpoint

        check_run_checkpoint(resumed, cfg)


def _check_resumed_params(run: Run) -> None:
    """A resumed checkpoint's parameters have the loaded model's names, shapes and dtypes."""
    if run.resumed is not None:
        from asyncrl.checkpoint.schema import check_checkpoint_params

        check_checkpoint_params(run.resumed, run.params)


def _load_trainer_state(trainer: Trainer, resumed: Checkpoint) -> None:
    """The saved optimizer state and counters into ``trainer``; a mismatch names the checkpoint."""
    from asyncrl.errors import TrainerError

    try:
        critic = {name: resumed.tree(name, getattr(trainer, name)) for name in trainer.CRITIC_TREES
                  if getattr(trainer, name) is not None}
        trainer.load_state_dict(
            {"params": resumed.tree("params", trainer.params), "opt_state": resumed.tree("opt_state", trainer.opt_state),
             **critic, **resumed.state["trainer"]}
        )
    except TrainerError as err:
        raise CheckpointError(f"checkpoint {resumed.path}: arrays/opt_state: {err}") from None
    except CheckpointError as err:  # the saved trees do not fit this trainer's
        raise CheckpointError(f"{err} (model or optimizer config changed?)") from None


def _check_all_steps_ran(run: Run, cfg: Config) -> None:
    """A run that ends without error has trained every configured step (never exit 0 short)."""
    if run.version < cfg.total_steps:
        raise AsyncRLError(
            f"the run stopped at step {run.version} of {cfg.total_steps} without an error: this is a bug or a "
            f"damaged checkpoint ({run.resumed.path if run.resumed is not None else 'no checkpoint'}); not exporting"
        )


def _export_adapter(cfg: Config, base_model: str, adapters: Params, overwrite: bool) -> None:
    """A LoRA run's final adapters as a PEFT adapter directory ``adapter/`` beside ``hf/``."""
    from asyncrl.model.lora import LoraSpec, export_peft_adapter

    export_peft_adapter(adapters, LoraSpec.from_config(cfg.model.lora), cfg.run.resolved_output_dir / "adapter",
                        base_model=base_model, overwrite=overwrite)
