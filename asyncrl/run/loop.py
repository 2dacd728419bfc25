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
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence, TextIO, Union

import numpy as np

from asyncrl.checkpoint.schema import RUN_STATE_FORMAT
from asyncrl.config import Config, dump_config
from asyncrl.engine.protocol import InferenceEngine
from asyncrl.errors import AsyncRLError, CheckpointError
from asyncrl.pytree import tree_to_host
from asyncrl.rollout.batch import BatchAbandoned, BatchSource, PreparedBatch
from asyncrl.run.build import build_engine, episode_metric_means, preflight, weights_writer
from asyncrl.run.rundir import check_output_dir_path, prepare_output_dir
from asyncrl.run.startup import StartupClock

if TYPE_CHECKING:
    import jax

    from asyncrl.checkpoint import Checkpoint
    from asyncrl.data import TaskData
    from asyncrl.rollout.trajectory import TrajectoryGroup
    from asyncrl.rollout.workflow import RolloutWorkflow
    from asyncrl.run.metrics import ConsoleSink, JsonlSink, LogAppender, StatsTracker, TensorBoardSink
    from asyncrl.run.multihost import Hosts, NoSink
    from asyncrl.run.shutdown import ShutdownGuard
    from asyncrl.run.trackers import TrackerSinks
    from asyncrl.trainer import Trainer

log = logging.getLogger(__name__)

Params = Any
"""A pytree of arrays: the model's parameters (or a LoRA run's adapters), on devices or as host numpy."""

class RunEngine(InferenceEngine, Protocol):
    """What the loop needs of the run's engine beyond what workflows use (in-process or remote)."""

    def metrics(self) -> dict[str, float]:
        """The engine's ``engine/*`` metrics (counters since it started, gauges now)."""
        ...

    def shutdown(self) -> None:
        """Stop serving: pending and later calls raise; returns once its threads ended."""
        ...


EvalHook = Callable[["StatsTracker"], None]
"""A stage's eval as the loop calls it: runs it and records its metrics on the stage's tracker
(called between publishes, so every eval request sees one version)."""

ENGINE_COUNTERS = ("engine/requests", "engine/samples_aborted", "engine/prefill_tokens", "engine/decode_tokens",
                   "engine/decode_steps", "engine/swaps")
"""Cumulative engine counters: saved in checkpoints and continued by a resumed run, so its
curves go on from where they were (the resumed process's engine counts from zero)."""


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
    final_params: Params = None
    """The trained weights as host numpy arrays (the same as the ``hf/`` export)."""


@dataclass(frozen=True)
class Stage:
    """One stage of the run, as the loop needs it."""

    index: int
    name: str
    type: str
    """``rl`` or ``sft``."""
    cfg: Config
    """The stage's config, rewards defaulted to the task's (:func:`~asyncrl.run.build.preflight`)."""
    task: TaskData
    workflow: RolloutWorkflow
    start_params: Params
    """The weights the stage started from: its KL reference, saved by checkpoints of stages > 0."""
    done: Optional[int]
    """Steps of this stage the resumed checkpoint holds (None: not resumed inside this stage)."""


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
            # Process 0 makes the batches (executor, workflows, engine) and evaluates; every
            # process trains on its block of each batch (asyncrl.run.multihost).
            source, record_eval = build(run, stage, trainer)
            source = run.hosts.batch_source(source, trainer.row_multiple)
            run_stage(run, stage, trainer, source, record_eval)
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

            tracker.scalars(run.step_metrics(got, train_metrics, engine_metrics, step_time), reduce="last")
            tracker.scalars(run.startup.first_step(trainer.precompile_hit), reduce="last")  # the run's first step only
            if scfg.logging.dump_every_steps and stage_step % scfg.logging.dump_every_steps == 0 and got.groups:
                records = _dump_trajectories(run.trajectory_log, run.version, got.groups, run.loaded.tokenizer,
                                             scfg.logging.dump_groups)
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


def _no_eval(tracker: StatsTracker) -> None:
    """The evaluation of a process other than 0: the engine and the logs are process 0's."""


def eval_due(scfg: Config, stage_step: int) -> bool:
    every = scfg.eval.every_steps
    return bool(every) and (stage_step % every == 0 or stage_step == scfg.run.total_steps)


def rl_source(run: "Run", stage: Stage, trainer: Trainer) -> tuple[Optional[BatchSource], EvalHook]:
    """The RL stage's executor (its rollout state restored on a resume, started) and its eval
    (process 0's; None and no eval on the other processes)."""
    from asyncrl.data import SampleOrder
    from asyncrl.rollout.executor import WorkflowExecutor

    if not run.hosts.is_main:
        return None, _no_eval
    scfg = stage.cfg
    assert run.engine is not None, "process 0 holds the engine (Run.ensure_engine)"
    executor = WorkflowExecutor(stage.workflow, run.engine, SampleOrder(stage.task.train, scfg.run.seed), scfg,
                                version=run.version, row_multiple=trainer.row_multiple)
    if stage.done is not None:
        rollout_state = run.resumed_inside(stage).rollout_state
        assert rollout_state is not None, "check_run_checkpoint requires an RL stage's rollout state"
        executor.load_state_dict(rollout_state)
    executor.start()
    return executor, lambda tracker: run.eval_on_engine(stage, tracker)


def sft_source(run: "Run", stage: Stage, trainer: Trainer) -> tuple[Optional[BatchSource], EvalHook]:
    """The SFT stage's data (its position restored on a resume) and its eval: the task's
    greedy eval through the engine, as in RL, and the held-out loss. With several processes
    the data and the greedy eval are process 0's; every process computes the held-out loss on
    its block of each eval batch (the eval split is the same everywhere)."""
    from asyncrl.run.sft import SFTData, eval_loss

    scfg = stage.cfg
    eos = run.loaded.stop_token_ids[0] if run.loaded.stop_token_ids else None
    held_out = run.hosts.eval_blocks(SFTData.for_task(stage.task, stage.workflow, scfg, split="eval", eos_token_id=eos,
                                                      row_multiple=trainer.row_multiple), trainer.row_multiple)
    if not run.hosts.is_main:
        return None, lambda tracker: tracker.scalars(eval_loss(trainer, held_out), reduce="last")
    data = SFTData.for_task(stage.task, stage.workflow, scfg, eos_token_id=eos, row_multiple=trainer.row_multiple)
    if stage.done is not None:
        data.load_state_dict(run.resumed_inside(stage).state["sft"])

    def record_eval(tracker: StatsTracker) -> None:
        run.eval_on_engine(stage, tracker)
        tracker.scalars(eval_loss(trainer, held_out), reduce="last")

    return data, record_eval


def reward_metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """``reward/mean``, ``reward/std``, ``reward/<component>`` and ``episode/<name>`` of a batch's groups."""
    if not groups:
        return {}
    trajectories = [t for g in groups for t in g.trajectories]
    rewards = [t.reward for t in trajectories]
    components: dict[str, list[float]] = {}
    for traj in trajectories:
        for name, value in traj.reward_components.items():
            components.setdefault(name, []).append(value)
    out = {"reward/mean": float(np.mean(rewards)), "reward/std": float(np.std(rewards))}
    out.update({f"reward/{name}": float(np.mean(values)) for name, values in components.items()})
    out.update({f"episode/{name}": value for name, value in episode_metric_means(trajectories).items()})
    return out


def _dump_trajectories(log_file: Union[LogAppender, NoSink], step: int, groups: Sequence[TrajectoryGroup], tokenizer: Any,
                       limit: int) -> list[dict]:
    """Append the first ``limit`` groups of a step to ``trajectories.jsonl`` (a
    :class:`~asyncrl.run.metrics.LogAppender`: a failed write warns and the run goes on);
    returns the records (the trackers' trajectory table)."""
    lines, records = [], []
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
            records.append(record)
    log_file.append("".join(lines))
    return records


# ---------------------------------------------------------------------------- what the stages share


class Run:
    """The state one run shares across its stages: the loaded model (and LoRA adapters), the
    mesh, the engine, the metric sinks, the served version, and the checkpoint it resumed from."""

    def __init__(self, cfg: Config, out: Path, console: Optional[TextIO], resumed: Optional[Checkpoint],
                 guard: ShutdownGuard, hosts: Hosts, startup: StartupClock):
        from asyncrl.cluster.placement import check_tensor_parallel, resolve_placement
        from asyncrl.model import load_model
        from asyncrl.run.metrics import ConsoleSink, JsonlSink, LogAppender
        from asyncrl.run.multihost import NoSink
        from asyncrl.trainer import build_mesh

        self.cfg, self.out, self.guard = cfg, out, guard
        self.hosts = hosts
        """This process's role (process 0 runs the engine and writes the run's files) and the
        agreements between processes (:class:`~asyncrl.run.multihost.Hosts`, already watching ``guard``)."""
        self.resumed = resumed
        """The :class:`~asyncrl.checkpoint.Checkpoint` this run continues, or None."""
        self.placement = resolve_placement(cfg)
        """The trainer's and the engine's devices (docs/scaling.md "Placement")."""
        self.loaded = load_model(cfg.model)
        if cfg.engine.remote is None:
            check_tensor_parallel(cfg.engine.tensor_parallel, self.loaded.config)
        self.graphdef, self.params = self.loaded.split()
        # With model.lora the trainer trains adapters on the frozen base; self.graphdef stays
        # the base model's (the engine serves merged weights, hf/ is the merged model).
        self.train_graphdef: Any = self.graphdef  # an nnx.GraphDef (flax ships no precise type for it)
        self.frozen: Optional[Params] = None
        self.lora_state: Optional[dict[str, str]] = None
        """With ``model.lora``: the base model's identity (adapters are of this base only)."""
        if cfg.model.lora is not None:
            self._attach_lora(cfg, resumed)
        from asyncrl.trainer.trainer import load_critic_of

        self.critic_model = load_critic_of(cfg, self.loaded.config)
        """``critic.path``'s critic (read before step 1; a bad directory fails here), or None: each RL
        stage's trainer then copies its start weights (``algo.estimator: gae``)."""
        self.final_critic: Optional[tuple[Any, Any]] = None
        """``(critic DecoderConfig, host params)`` of the last stage's critic, exported as ``hf_critic/``."""
        self.mesh = build_mesh(cfg.mesh, devices=self.placement.trainer_devices)
        self.device = _first_local_device(self.mesh)
        """The device whose memory ``perf/device_mem_gb`` reports (this process's first in the mesh)."""
        self.engine: Optional[RunEngine] = None
        self.writer = weights_writer(cfg, self.loaded, out) if cfg.engine.remote is not None else None
        """With ``engine.remote``: every process's :class:`~asyncrl.engine.publish.WeightsWriter`."""
        self.publish_time = 0.0
        """Seconds of the last ``engine.update_weights`` (``perf/publish_time``)."""
        self.version = resumed.step if resumed is not None else 0
        """Completed trainer steps over all stages: the version the engine serves."""
        main = self.hosts.is_main
        self.console: Union[ConsoleSink, NoSink] = (
            ConsoleSink(cfg.total_steps, start_step=self.version, stream=console) if main else NoSink())
        self.jsonl: Union[JsonlSink, NoSink] = JsonlSink(out / "metrics.jsonl") if main else NoSink()
        self.trajectory_log: Union[LogAppender, NoSink] = (
            LogAppender(out / "trajectories.jsonl", create=False) if main else NoSink())
        self.trackers = _open_trackers(cfg, out, resumed) if main else None
        """W&B/MLflow (:class:`~asyncrl.run.trackers.TrackerSinks`; process 0's), or None."""
        self.history: list[dict[str, float]] = []
        self.final_eval: dict[str, float] = dict(resumed.state.get("final_eval", {})) if resumed else {}
        self.engine_counter_base: dict[str, float] = dict(resumed.state.get("engine_counters", {})) if resumed else {}
        """The engine counters of the run before the resume: the new engine counts from zero."""
        self.engine_counters = dict(self.engine_counter_base)
        self.generated_before = self.engine_counter_base.get("engine/decode_tokens", 0.0)
        self.last_checkpoint: Optional[Path] = None
        self.last_checkpoint_version = -1
        self.pending_checkpoint: Any = None  # the asynchronous checkpoint write in flight (PendingSave)
        self.reward_failures = {"reward_errors": 0.0, "reward_timeouts": 0.0}
        """Reward function calls of this process that failed or timed out (all stages, eval included)."""
        self.startup = startup
        """The split of the time to first step (:mod:`asyncrl.run.startup`), started by ``train``."""

    def _attach_lora(self, cfg: Config, resumed: Optional[Checkpoint]) -> None:
        """Fresh adapters on the loaded base (``self.params`` become the adapters); a resumed
        run first checks that the base is the one its checkpoint's adapters were trained on."""
        from asyncrl.model.lora import LoraSpec, attach_lora, base_identity, check_same_base

        self.lora_state = base_identity(self.loaded.path, self.params)
        if resumed is not None:
            check_same_base(resumed.state.get("lora"), self.lora_state, str(resumed.path))
        lora = attach_lora(self.loaded.config, self.params, LoraSpec.from_config(cfg.model.lora), seed=cfg.run.seed)
        self.train_graphdef, self.params, self.frozen = lora.graphdef, lora.adapters, lora.frozen

    def close(self, failure: Optional[BaseException] = None) -> None:
        """Finish the checkpoint in flight, shut the engine down and close the run's logs;
        ``failure``: what ended the run early."""
        if failure is None:
            self.finish_checkpoint()
        elif self.pending_checkpoint is not None:
            # Complete it if it can be, briefly (another process may be gone); its own error is
            # logged: the run's failure is what is raised.
            pending, self.pending_checkpoint = self.pending_checkpoint, None
            try:
                pending.wait(timeout_s=min(60.0, self.cfg.checkpoint.barrier_timeout_s))
            except Exception as err:
                log.warning("the checkpoint in flight when the run failed was not completed: %s", err)
        if self.engine is not None:
            self.engine.shutdown()
        from asyncrl.rollout.reward_model import close_reward_models

        close_reward_models()  # learned reward models' scoring threads end with the run that prepared them
        if self.trackers is not None:  # sends what is queued (bounded wait), also after a signal
            status = "finished" if failure is None else "killed" if isinstance(failure, TrainingInterrupted) else "failed"
            self.trackers.close(status)
        self.jsonl.close()
        self.trajectory_log.close()
        self.console.close()

    def resumed_inside(self, stage: Stage) -> Checkpoint:
        """The checkpoint ``stage`` resumes inside of (only when ``stage.done`` is not None)."""
        assert self.resumed is not None and stage.done is not None, f"stage {stage.name} was not resumed"
        return self.resumed

    def resume_position(self, index: int) -> Optional[int]:
        """Steps of stage ``index`` already done according to the checkpoint (None: not resumed there)."""
        if self.resumed is None or self.resumed.state["stage_index"] != index:
            return None
        return int(self.resumed.state["stage_step"])

    def stage_start(self, index: int, previous: Params) -> Params:
        """The weights stage ``index`` started from: ``previous`` (the last stage's result), or
        on a resume inside this stage the saved ones (stage 0: the loaded model)."""
        resumed = self.resumed
        if resumed is None or self.resume_position(index) is None:
            return previous
        if "stage_start_params" in resumed.arrays:
            return resumed.tree("stage_start_params", self.params)
        if index == 0:
            return self.params
        return resumed.tree("params", self.params)

    def tracker_for(self, stage_name: str) -> tuple[StatsTracker, Union[TensorBoardSink, NoSink]]:
        """Sinks of one stage. With several stages, rows of metrics.jsonl carry ``stage`` and
        each stage writes its own TensorBoard run (``tensorboard/<stage>/``), so curves of
        different stages never collide under one name."""
        from asyncrl.run.metrics import StatsTracker, TensorBoardSink
        from asyncrl.run.multihost import NoSink

        multi = bool(self.cfg.stages)
        self.jsonl.tags = {"stage": stage_name} if multi else {}
        self.console.prefix = f"[{stage_name}] " if multi else ""
        if not self.hosts.is_main or "tensorboard" not in self.cfg.logging.trackers:
            tensorboard: Union[TensorBoardSink, NoSink] = NoSink()
        else:
            tensorboard = TensorBoardSink(self.out / "tensorboard" / stage_name if multi else self.out / "tensorboard")
        trackers: list[TrackerSinks] = []
        if self.trackers is not None:
            self.trackers.set_stage(stage_name)
            trackers.append(self.trackers)
        return StatsTracker([self.jsonl, tensorboard, *trackers, self.console]), tensorboard

    def ensure_engine(self, trainer: Trainer, scfg: Config) -> Optional[RunEngine]:
        """The run's engine (process 0's; None on the others), built once from the trainer's weights.
        With ``engine.remote`` and several processes every process first writes the current version
        (its share of it), which process 0's engine loads on servers that serve another one."""
        if self.engine is None:
            if self.writer is not None:
                params = trainer.params_for_publish()
                written = self.writer.write(params, self.version) if self.hosts.multi else None
                if self.hosts.is_main:
                    self.engine = build_engine(scfg, self.loaded, self.graphdef, params, version=self.version,
                                               out=self.out, writer=self.writer, written=written)
                return self.engine
            params = self.hosts.engine_copy(trainer.params_for_publish())  # every process joins the gather
            if self.hosts.is_main:
                self.engine = build_engine(scfg, self.loaded, self.graphdef, params, version=self.version, out=self.out,
                                           placement=self.placement)
        return self.engine

    def publish(self, trainer: Trainer) -> None:
        """Version ``v + 1`` to the engine (process 0's, from the global params; every process calls this).
        With ``engine.remote`` every process writes its share of the version's files, then process 0
        has the servers load them; else process 0's in-process engine receives the weights."""
        started = time.perf_counter()
        remote = self.cfg.engine.remote
        if self.writer is not None and remote is not None and remote.publish_adapters and trainer.lora is not None \
                and not self.hosts.multi:
            from asyncrl.engine.remote import RemoteEngine

            assert isinstance(self.engine, RemoteEngine), "a weights writer is built for engine.remote only"
            self.engine.update_lora(trainer.base_params, trainer.params, trainer.lora, self.version + 1)  # adapters only
        elif self.writer is not None:
            path = self.writer.write(trainer.params_for_publish(), self.version + 1)
            if self.engine is not None:
                from asyncrl.engine.remote import RemoteEngine

                assert isinstance(self.engine, RemoteEngine), "a weights writer is built for engine.remote only"
                self.engine.load_version(path, self.version + 1)
        else:
            params = self.hosts.engine_copy(trainer.params_for_publish())
            if self.engine is not None:
                self.engine.update_weights(params, self.version + 1)
        self.publish_time = time.perf_counter() - started  # gathering, writing or moving to the engine, the swap
        self.version += 1

    def read_engine_counters(self) -> dict[str, float]:
        """The engine's metrics, its counters continued from the resumed run's; the counters
        are kept for the next checkpoint (as of this call: work started later is not counted,
        since a resume redoes it)."""
        if self.engine is None:
            return {}  # a process other than 0: no engine, no metrics of its own in the logs
        engine_metrics = self.engine.metrics()
        for name in ENGINE_COUNTERS:
            if name in engine_metrics:
                engine_metrics[name] += self.engine_counter_base.get(name, 0.0)
                self.engine_counters[name] = engine_metrics[name]
        return engine_metrics

    def step_metrics(self, got: PreparedBatch, train_metrics: dict[str, float], engine_metrics: dict[str, float],
                     step_time: float) -> dict[str, float]:
        """One step's metrics, each name from the one part that made it (a name with two
        producers is an error): the trainer's, the source's, the engine's, the batch's rewards,
        the process's (RSS, threads, device memory: a leak shows as a rising curve) and the
        loop's own whole-step figures."""
        from asyncrl.rollout.reward_model import reward_model_metrics
        from asyncrl.run.metrics import merge_producers, process_metrics

        generated = engine_metrics.get("engine/decode_tokens", 0.0)
        loop = {
            "perf/step_time": step_time,  # batch wait + train + publish
            # The whole batch's (a process's got.batch is its own block in a multi-process run).
            "perf/trained_tokens_per_s": float(train_metrics.get("train/trained_tokens", got.batch.loss_mask.sum()))
            / step_time,
            "perf/gen_tokens_per_s": (generated - self.generated_before) / step_time,
            "perf/publish_time": self.publish_time,  # part of step_time
        }
        self.generated_before = generated
        return merge_producers(trainer=train_metrics, source=got.metrics, engine=engine_metrics,
                               rewards=reward_metrics(got.groups), reward_model=reward_model_metrics(),
                               process=process_metrics(self.device), loop=loop)

    def eval_on_engine(self, stage: Stage, tracker: StatsTracker) -> None:
        """The stage's task eval through the engine (process 0's), recorded on ``tracker``; the
        last one's metrics are the run's ``final_eval``."""
        from asyncrl.run.evaluate import evaluate_workflow

        task = stage.task
        assert self.engine is not None, "eval runs on process 0, which holds the engine"
        result = evaluate_workflow(self.engine, stage.workflow, task.eval, stage.cfg, eval_metrics=task.eval_metrics)
        self.final_eval = result.metrics
        tracker.scalars(result.metrics, reduce="last")

    def count_reward_failures(self, workflow: Optional[RolloutWorkflow]) -> None:
        """Add a finished stage's reward error and timeout counts (for the summary line)."""
        counts = workflow.metrics() if workflow is not None else {}
        for name in self.reward_failures:
            self.reward_failures[name] += float(counts.get(name, 0.0))

    def checkpoint_due(self, stage_step: int, stage_total: int, stopping: bool = False) -> bool:
        """After ``stage_step``: the stage's last step, every ``checkpoint.every_steps`` versions,
        or a stop every process agreed on (:meth:`~asyncrl.run.multihost.Hosts.agree_stop`)."""
        every = self.cfg.checkpoint.every_steps
        return stage_step == stage_total or (every > 0 and self.version % every == 0) or stopping

    def save(self, stage: Stage, stage_step: int, trainer: Trainer, source: BatchSource) -> None:
        """Start a checkpoint of the run after ``stage_step`` steps of ``stage``: weights,
        optimizer, counters and the source's position (RL: the rollout state; SFT: the data
        position). Every process writes its own shards of the arrays (never gathered); process
        0 the JSON. With ``checkpoint.asynchronous`` the write finishes while the next steps
        train (:meth:`finish_checkpoint` waits for it); at most one is in flight."""
        from asyncrl.checkpoint import start_checkpoint

        self.finish_checkpoint()
        arrays = {"params": trainer.params, "opt_state": trainer.opt_state}  # the live (sharded) trees
        if trainer.critic_spec is not None:  # the critic of algo.estimator gae: its live trees too
            arrays.update({name: getattr(trainer, name) for name in trainer.CRITIC_TREES})
        if stage.index > 0 and trainer.ref_params is not None:
            arrays["stage_start_params"] = stage.start_params
        state: dict[str, Any] = {}
        rollout_state = None
        if self.hosts.is_main:
            state = {
                "format": RUN_STATE_FORMAT, "version": self.version, "stage_index": stage.index,
                "stage_step": stage_step, "trainer": trainer.counters(), "final_eval": self.final_eval,
                "engine_counters": self.engine_counters,
            }
            if self.hosts.multi:
                state["process_count"] = self.hosts.count  # recorded; a resume may have another count
            # As of the step's publish, like the engine counters above (read just before it).
            rollout_state = source.checkpoint_state() if stage.type == "rl" else None
            if stage.type == "sft":
                state["sft"] = source.checkpoint_state()
            if self.lora_state is not None:
                state["lora"] = self.lora_state  # params are adapters: of this base only
            if self.trackers is not None and self.trackers.run_ids():
                state["trackers"] = self.trackers.run_ids()  # --resume continues these W&B/MLflow runs
        self.pending_checkpoint = start_checkpoint(
            self.out, self.version, arrays=arrays, state=state, config_yaml=dump_config(self.cfg),
            rollout_state=rollout_state, keep=self.cfg.checkpoint.keep, asynchronous=self.cfg.checkpoint.asynchronous,
            timeout_s=self.cfg.checkpoint.barrier_timeout_s,
        )
        # Counted as written from here: a stop waits for it (finish_checkpoint) before it exits.
        self.last_checkpoint = self.pending_checkpoint.final
        self.last_checkpoint_version = self.version
        if not self.cfg.checkpoint.asynchronous:
            self.finish_checkpoint()

    def checkpoint_failed(self) -> bool:
        """Whether this process's part of the checkpoint in flight has already failed (never blocks)."""
        return self.pending_checkpoint is not None and self.pending_checkpoint.failed()

    def raise_failed_checkpoint(self, processes: list[int]) -> None:
        """End the run because the checkpoint in flight failed on ``processes`` (every process
        calls this at the same step): a process among them raises its own write error; the
        others stop waiting for their part and raise one naming the process that failed."""
        pending, self.pending_checkpoint = self.pending_checkpoint, None
        if pending is None:
            raise CheckpointError(f"process {processes[0]} of {self.hosts.count} failed to write its part of the "
                                  "checkpoint in flight, so every process stops (its log has the cause)")
        if self.hosts.index in processes:
            pending.wait()  # raises this process's error
        pending.abandon()
        raise CheckpointError(pending.peer_failure() or (
            f"process {processes[0]} of {self.hosts.count} failed to write its part of the checkpoint of step "
            f"{pending.step}, so every process stops (its log has the cause)"))

    def finish_checkpoint(self) -> None:
        """Wait until the checkpoint in flight (if any) is complete on every process; raises its
        write error (disk full, ...) here. Called before the next save, at a stage's end, before
        a signal stops the run, and when the run closes."""
        pending, self.pending_checkpoint = self.pending_checkpoint, None
        if pending is not None:
            pending.wait()
            self.hosts.barrier(f"checkpoint-{pending.step}")  # complete (renamed into place) for everyone


# ---------------------------------------------------------------------------- resume and export


def _open_trackers(cfg: Config, out: Path, resumed: Optional[Checkpoint]) -> Optional[TrackerSinks]:
    """The run's W&B/MLflow trackers (None without any), given the resolved config and
    ``provenance.json`` as the run's config; a resumed run continues its trackers' runs."""
    import yaml

    from asyncrl.run.trackers import open_trackers

    try:
        provenance = json.loads((out / "provenance.json").read_text())
    except (OSError, ValueError):
        provenance = {}
    config = {**yaml.safe_load(dump_config(cfg)), "provenance": provenance}
    return open_trackers(cfg.logging, cfg.run.name, out, config,
                         saved_ids=resumed.state.get("trackers") if resumed is not None else None,
                         resumed_step=resumed.step if resumed is not None else None)


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
    trainer.start_precompile(expected_first_shape(scfg, rows, trainer.row_multiple))


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


def _first_local_device(mesh: jax.sharding.Mesh) -> Optional[jax.Device]:
    import jax

    return next((d for d in mesh.devices.flat if d.process_index == jax.process_index()), None)


def _export_adapter(cfg: Config, base_model: str, adapters: Params, overwrite: bool) -> None:
    """A LoRA run's final adapters as a PEFT adapter directory ``adapter/`` beside ``hf/``."""
    from asyncrl.model.lora import LoraSpec, export_peft_adapter

    export_peft_adapter(adapters, LoraSpec.from_config(cfg.model.lora), cfg.run.resolved_output_dir / "adapter",
                        base_model=base_model, overwrite=overwrite)
