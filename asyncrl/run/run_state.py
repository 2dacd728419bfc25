"""What the stages of one run share (:class:`Run`: the model, the mesh, the engine, the metric
sinks, the served version, the checkpoint it resumed from, the checkpoint in flight), and the
names the loop and its callers use with it (:class:`Stage`, :class:`RunEngine`, the engine
counters a resume continues, :class:`TrainingInterrupted`). The loop itself, which drives it
step by step, is :mod:`asyncrl.run.loop`."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, TextIO, Union

import numpy as np

from asyncrl.checkpoint.schema import RUN_STATE_FORMAT
from asyncrl.config import Config, dump_config
from asyncrl.engine.protocol import InferenceEngine
from asyncrl.errors import CheckpointError
from asyncrl.rollout.batch import BatchSource, PreparedBatch
from asyncrl.run.build import build_engine, episode_metric_means, weights_writer
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

log = logging.getLogger("asyncrl.run.loop")  # the run's records under the loop's logger, as before the split

Params = Any
"""A pytree of arrays: the model's parameters (or a LoRA run's adapters), on devices or as host numpy."""


class TrainingInterrupted(Exception):
    """A signal stopped the run after a checkpoint was written; ``exit_code`` is 130/143."""

    def __init__(self, exit_code: int, checkpoint: Optional[Path]):
        self.exit_code = exit_code
        self.checkpoint = checkpoint
        super().__init__(f"training interrupted (exit {exit_code}); checkpoint: {checkpoint or 'none'}")


class RunEngine(InferenceEngine, Protocol):
    """What the loop needs of the run's engine beyond what workflows use (in-process or remote)."""

    def metrics(self) -> dict[str, float]:
        """The engine's ``engine/*`` metrics (counters since it started, gauges now)."""
        ...

    def shutdown(self) -> None:
        """Stop serving: pending and later calls raise; returns once its threads ended."""
        ...


ENGINE_COUNTERS = ("engine/requests", "engine/samples_aborted", "engine/prefill_tokens", "engine/prefix_hit_tokens",
                   "engine/decode_tokens", "engine/decode_steps", "engine/swaps", "engine/preemptions")
"""Cumulative engine counters: saved in checkpoints and continued by a resumed run, so its
curves go on from where they were (the resumed process's engine counts from zero)."""


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


# ---------------------------------------------------------------------------- what the stages share


class Run:
    """The state one run shares across its stages: the loaded model (and LoRA adapters), the
    mesh, the engine, the metric sinks, the served version, and the checkpoint it resumed from."""

    def __init__(self, cfg: Config, out: Path, console: Optional[TextIO], resumed: Optional[Checkpoint],
                 guard: ShutdownGuard, hosts: Hosts, startup: StartupClock):
        from asyncrl.cluster.mesh import build_mesh
        from asyncrl.cluster.placement import resolve_placement
        from asyncrl.model import load_model
        from asyncrl.model.sharding import check_tensor_parallel
        from asyncrl.run.auto_slots import resolve_auto_remat, resolve_auto_tensor_parallel
        from asyncrl.run.metrics import ConsoleSink, JsonlSink, LogAppender
        from asyncrl.run.multihost import NoSink

        self.cfg, self.out, self.guard = cfg, out, guard
        self.hosts = hosts
        """This process's role (process 0 runs the engine and writes the run's files) and the
        agreements between processes (:class:`~asyncrl.run.multihost.Hosts`, already watching ``guard``)."""
        self.resumed = resumed
        """The :class:`~asyncrl.checkpoint.Checkpoint` this run continues, or None."""
        self.given_cfg = cfg
        """The config as given: what a checkpoint saves and a resume compares, ``auto`` kept (as
        ``engine.slots: auto`` is), so a resume chooses again on its own devices."""
        cfg = self.cfg = resolve_auto_remat(cfg)  # model.remat_policy: auto, from the devices' memory
        cfg = self.cfg = resolve_auto_tensor_parallel(cfg)  # engine.tensor_parallel: auto (a number: checked)
        self.placement = resolve_placement(cfg)
        """The trainer's and the engine's devices (docs/scaling.md "Placement")."""
        self.loaded = load_model(cfg.model)
        if cfg.engine.remote is None and cfg.engine.tensor_parallel != "auto":  # (auto is resolved above)
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
        self.eval_usage: dict[str, float] = {}
        """The engine work of the evals since the last counter read (their requests' own usage): a
        checkpoint adds it to the counters it keeps, since a resume does not redo those evals."""
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
        self.eval_usage = {}  # counted in the engine's own counters from here on
        for name in ENGINE_COUNTERS:
            if name in engine_metrics:
                engine_metrics[name] += self.engine_counter_base.get(name, 0.0)
                self.engine_counters[name] = engine_metrics[name]
        if "engine/prefix_hit_rate" in engine_metrics:  # the run's share, from the continued counters
            hit, computed = engine_metrics.get("engine/prefix_hit_tokens", 0.0), engine_metrics.get("engine/prefill_tokens", 0.0)
            engine_metrics["engine/prefix_hit_rate"] = hit / (hit + computed) if hit + computed else 0.0
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
        for name, value in result.engine_usage.items():
            self.eval_usage[name] = self.eval_usage.get(name, 0.0) + value
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
                # As of the step's publish, plus the evals run since (a resume does not redo them).
                "engine_counters": {name: value + self.eval_usage.get(name, 0.0)
                                    for name, value in self.engine_counters.items()},
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
            self.out, self.version, arrays=arrays, state=state, config_yaml=dump_config(self.given_cfg),
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


def _first_local_device(mesh: jax.sharding.Mesh) -> Optional[jax.Device]:
    import jax

    return next((d for d in mesh.devices.flat if d.process_index == jax.process_index()), None)
