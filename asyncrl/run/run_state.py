"""What the stages of one run share (:class:`Run`: the model, the mesh, the engine, the metric
sinks, the served version, the checkpoint it resumed from, the checkpoint in flight), and the
names the loop and its callers use with it (:class:`Stage`, :class:`RunEngine`, the engine
counters a resume continues, :class:`TrainingInterrupted`). The loop itself, which drives it
step by step, is :mod:`asyncrl.run.loop`."""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Sequence, TextIO, Union

import numpy as np

from asyncrl.checkpoint.schema import RUN_STATE_FORMAT
from asyncrl.config import Config, dump_config
from asyncrl.engine.protocol import InferenceEngine
from asyncrl.errors import CheckpointError
from asyncrl.rollout.batch import BatchSource, PreparedBatch
from asyncrl.run.build import build_engine, weights_writer
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

THREAD_JOIN_S = 60.0
"""How long :meth:`Run.close` waits, in all, for the threads that call into the runtime (rollout
workers, the train step's background compile) to end after the engine stopped."""
SIGNAL_CLOSE_S = 12.0
"""Of the shutdown guard's grace after a signal, the seconds :meth:`Run.close` keeps for closing
the trackers (``logging.tracker_flush_timeout_s``, 10 s by default) and logs after it stops
waiting for threads."""

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
curves go on from where they were (the resumed process's engine counts from zero). In a
multi-process run they are totals over the hosts, and each host's ``engine/host{i}/requests`` and
``engine/host{i}/decode_tokens`` are kept beside them."""
HOST_COUNTERS = ("engine/requests", "engine/decode_tokens")
"""The counters logged per host of a multi-process run, as ``engine/host{i}/<name>``."""


def host_counter(index: int, name: str) -> str:
    """``engine/host{index}/requests`` for ``engine/requests``."""
    return f"engine/host{index}/{name.split('/', 1)[1]}"


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


def reward_summaries(groups: Sequence[TrajectoryGroup]) -> list[list[Any]]:
    """Per trajectory of a batch's groups, in batch order, what :func:`reward_metrics` reads:
    ``[reward, {component: value}, {episode metric: value}]`` (JSON-able: a process's part of the
    step's report in a multi-process run)."""
    return [[float(t.reward), {k: float(v) for k, v in t.reward_components.items()},
             {k: float(v) for k, v in (t.metadata or {}).get("episode_metrics", {}).items()}]
            for g in groups for t in g.trajectories]


def reward_metrics(summaries: Sequence[Sequence[Any]]) -> dict[str, float]:
    """``reward/mean``, ``reward/std``, ``reward/<component>`` and ``episode/<name>`` of a batch's
    trajectories (:func:`reward_summaries`, every process's in process order)."""
    if not summaries:
        return {}
    rewards = [summary[0] for summary in summaries]
    out = {"reward/mean": float(np.mean(rewards)), "reward/std": float(np.std(rewards))}
    for prefix, position in (("reward/", 1), ("episode/", 2)):
        values: dict[str, list[float]] = {}
        for summary in summaries:
            for name, value in summary[position].items():
                values.setdefault(name, []).append(value)
        out.update({f"{prefix}{name}": float(np.mean(v)) for name, v in values.items()})
    return out


# ---------------------------------------------------------------------------- what the stages share


class Run:
    """The state one run shares across its stages: the loaded model (and LoRA adapters), the
    mesh, the engine, the metric sinks, the served version, and the checkpoint it resumed from."""

    def __init__(self, cfg: Config, out: Path, console: Optional[TextIO], resumed: Optional[Checkpoint],
                 guard: ShutdownGuard, hosts: Hosts, startup: StartupClock):
        import jax

        from asyncrl.cluster.mesh import build_mesh
        from asyncrl.cluster.placement import resolve_placement
        from asyncrl.model import load_model
        from asyncrl.model.sharding import check_tensor_parallel
        from asyncrl.run.auto_slots import resolve_auto_remat, resolve_auto_tensor_parallel
        from asyncrl.run.metrics import ConsoleSink, JsonlSink, LogAppender
        from asyncrl.run.multihost import NoSink
        from asyncrl.run.provenance import record_placement

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
        if self.hosts.is_main:  # provenance.json: what ran on which device (every host's engine)
            engines = [d for host in range(jax.process_count())
                       for d in resolve_placement(cfg, process_index=host).engine_devices]
            record_placement(out, self.placement, self.mesh, len(cfg.engine.remote.urls) if cfg.engine.remote else 0,
                             engine_devices=engines)
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
            ConsoleSink(cfg.total_steps, start_step=self.version, stream=console, extra=cfg.logging.console_metrics)
            if main else NoSink())
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
        self.host_requests_before = [0.0] * hosts.count
        """Each host's ``engine/requests`` (its engine's own count) at the last step: ``engine/hosts_generating``."""
        self.last_checkpoint: Optional[Path] = None
        self.last_checkpoint_version = -1
        self.pending_checkpoint: Any = None  # the asynchronous checkpoint write in flight (PendingSave)
        self.reward_failures = {"reward_errors": 0.0, "reward_timeouts": 0.0}
        """Reward function calls of this process that failed or timed out (all stages, eval included)."""
        self.startup = startup
        """The split of the time to first step (:mod:`asyncrl.run.startup`), started by ``train``."""
        self._thread_joins: list[Callable[[float], list[str]]] = []
        """``join(timeout) -> names still running`` of the run's threads that call into the runtime
        (:meth:`join_on_close`)."""

    def join_on_close(self, join: Callable[[float], list[str]]) -> None:
        """Have :meth:`close` wait for threads that call into the runtime (XLA, tokenizers, user
        workflows) to end, after the engine stopped: a thread still inside native code when the
        interpreter exits aborts the process (SIGABRT) instead of letting it exit with its status."""
        self._thread_joins.append(join)

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
            self.engine.shutdown()  # ends the engine calls rollout workers wait in
        self._join_threads()
        from asyncrl.rollout.reward_model import close_reward_models

        close_reward_models()  # learned reward models' scoring threads end with the run that prepared them
        if self.trackers is not None:  # sends what is queued (bounded wait), also after a signal
            status = "finished" if failure is None else "killed" if isinstance(failure, TrainingInterrupted) else "failed"
            self.trackers.close(status)
        self.jsonl.close()
        self.trajectory_log.close()
        self.console.close()

    def _join_threads(self) -> None:
        budget = THREAD_JOIN_S
        remaining = self.guard.remaining_s()
        if remaining is not None:
            # After a signal the guard's deadline ends the process with a bare message: stop waiting
            # early enough that the run still closes its logs and exits with its own status and line
            # (a thread inside an XLA compile cannot be interrupted, only left behind).
            budget = min(budget, max(0.0, remaining - SIGNAL_CLOSE_S))
        deadline = time.monotonic() + budget
        running = [name for join in self._thread_joins for name in join(max(0.0, deadline - time.monotonic()))]
        self._thread_joins.clear()
        if running:
            log.warning("%d thread(s) still running %.0f s after the run stopped (%s); the command exits without "
                        "waiting for them", len(running), budget, ", ".join(running[:4]))

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
        """This process's engine, built once from the trainer's weights: every process of a
        multi-process run builds one on its own devices (the serving copy is made by one collective
        every process enters here, :mod:`asyncrl.engine.device_copy`). With ``engine.remote`` and
        several processes every process first writes its share of the current version, and its
        engine drives its share of the servers (:func:`~asyncrl.run.build.remote_share`)."""
        if self.engine is None:
            params = trainer.params_for_publish()
            if self.writer is not None:
                from asyncrl.run.build import remote_share

                written = self.writer.write(params, self.version) if self.hosts.multi else None
                self.hosts.barrier(f"weights-{self.version}")  # process 0 renamed it into place
                self.engine = build_engine(remote_share(scfg, self.hosts.index, self.hosts.count), self.loaded,
                                           self.graphdef, params, version=self.version, out=self.out, writer=self.writer,
                                           written=written)
            else:
                self.engine = build_engine(scfg, self.loaded, self.graphdef, params, version=self.version, out=self.out,
                                           placement=self.placement)
        return self.engine

    def publish(self, trainer: Trainer) -> None:
        """Version ``v + 1`` to every process's engine (every process calls this at the same point).
        With ``engine.remote`` every process writes its share of the version's files, then each
        process's engine has its servers load them; else each in-process engine receives the
        trainer's global params and lays them out on its devices (one collective)."""
        started = time.perf_counter()
        remote = self.cfg.engine.remote
        assert self.engine is not None, "ensure_engine built this process's engine"
        if self.writer is not None and remote is not None and remote.publish_adapters and trainer.lora is not None \
                and not self.hosts.multi:
            from asyncrl.engine.remote import RemoteEngine

            assert isinstance(self.engine, RemoteEngine), "a weights writer is built for engine.remote only"
            self.engine.update_lora(trainer.base_params, trainer.params, trainer.lora, self.version + 1)  # adapters only
        elif self.writer is not None:
            from asyncrl.engine.remote import RemoteEngine

            path = self.writer.write(trainer.params_for_publish(), self.version + 1)
            self.hosts.barrier(f"weights-{self.version + 1}")  # complete (renamed into place) for every process
            assert isinstance(self.engine, RemoteEngine), "a weights writer is built for engine.remote only"
            self.engine.load_version(path, self.version + 1)
        else:
            self.engine.update_weights(trainer.params_for_publish(), self.version + 1)
        self.publish_time = time.perf_counter() - started  # gathering, writing or moving to the engine, the swap
        self.version += 1

    def read_engine_counters(self) -> dict[str, float]:
        """This process's engine metrics, read now (before admission moves on: work started later is
        not counted, since a resume redoes it); :meth:`step_metrics` continues the counters."""
        engine_metrics = self.engine.metrics() if self.engine is not None else {}
        self.eval_usage = {}  # counted in the engine's own counters from here on
        return engine_metrics

    def _engine_totals(self, per_host: Sequence[Mapping[str, float]]) -> dict[str, float]:
        """Process 0: the step's ``engine/*`` metrics from every host's engine's own, combined over
        the hosts (:func:`~asyncrl.run.metrics.combine_hosts`), the counters continued from the resumed
        run's and kept for the next checkpoint, ``engine/hosts_generating`` (hosts whose engine
        finished a request since the last step) and, with several hosts, each host's counters."""
        from asyncrl.run.metrics import combine_hosts

        if len(per_host) > 1:  # each process's servers (engine.remote) under their index in engine.remote.urls
            per_host = [{_server_index(name, index, len(per_host)): value for name, value in metrics.items()}
                        for index, metrics in enumerate(per_host)]
        engine_metrics = combine_hosts(per_host)
        if not engine_metrics:
            return {}
        requests = [float(m.get("engine/requests", 0.0)) for m in per_host]
        engine_metrics["engine/hosts_generating"] = float(sum(
            now > before for now, before in zip(requests, self.host_requests_before)))
        self.host_requests_before = requests
        if len(per_host) > 1:
            for index, metrics in enumerate(per_host):
                for name in HOST_COUNTERS:
                    engine_metrics[host_counter(index, name)] = float(metrics.get(name, 0.0))
        for name in [*ENGINE_COUNTERS, *(host_counter(i, n) for i in range(len(per_host)) for n in HOST_COUNTERS)]:
            if name in engine_metrics:
                engine_metrics[name] += self.engine_counter_base.get(name, 0.0)
                self.engine_counters[name] = engine_metrics[name]
        if "engine/prefix_hit_rate" in engine_metrics:  # the run's share, from the continued counters
            hit, computed = engine_metrics.get("engine/prefix_hit_tokens", 0.0), engine_metrics.get("engine/prefill_tokens", 0.0)
            engine_metrics["engine/prefix_hit_rate"] = hit / (hit + computed) if hit + computed else 0.0
        return engine_metrics

    def step_metrics(self, got: PreparedBatch, train_metrics: dict[str, float], engine_metrics: dict[str, float],
                     step_time: float, dump: Sequence[dict] = ()) -> tuple[dict[str, float], list[dict]]:
        """One step's metrics and the trajectory records to dump (process 0's; the others return
        nothing), each name from the one part that made it (a name with two producers is an error):
        the trainer's, the source's, the engine's, the batch's rewards, the process's (RSS,
        threads, device memory: a leak shows as a rising curve) and the loop's own whole-step
        figures. With several processes every process calls this: its engine and rollout metrics,
        its trajectories' rewards and its ``dump`` records reach process 0 (:meth:`Hosts.gather
        <asyncrl.run.multihost.Hosts.gather>`), which combines the engine and rollout metrics over
        the hosts (:func:`~asyncrl.run.metrics.combine_hosts`) and computes the rewards of the whole batch."""
        from asyncrl.rollout.reward_model import reward_model_metrics
        from asyncrl.run.metrics import combine_hosts, merge_producers, process_metrics

        report: dict[str, Any] = {"engine": engine_metrics, "rollout": dict(got.metrics),
                                  "rewards": reward_summaries(got.groups), "dump": list(dump)}
        reports = self.hosts.gather("step", report)
        if reports is None:
            return {}, []
        engine = self._engine_totals([r["engine"] for r in reports])
        source: Mapping[str, float] = combine_hosts([r["rollout"] for r in reports]) if len(reports) > 1 else got.metrics
        generated = engine.get("engine/decode_tokens", 0.0)
        loop = {
            "perf/step_time": step_time,  # batch wait + train + publish
            # The whole batch's (a process's got.batch is its own block in a multi-process run).
            "perf/trained_tokens_per_s": float(train_metrics.get("train/trained_tokens", got.batch.loss_mask.sum()))
            / step_time,
            "perf/gen_tokens_per_s": (generated - self.generated_before) / step_time,
            "perf/publish_time": self.publish_time,  # part of step_time
        }
        self.generated_before = generated
        metrics = merge_producers(trainer=train_metrics, source=source, engine=engine,
                                  rewards=reward_metrics([s for r in reports for s in r["rewards"]]),
                                  reward_model=reward_model_metrics(), process=process_metrics(self.device), loop=loop)
        return metrics, [record for r in reports for record in r["dump"]]

    def eval_on_engine(self, stage: Stage, tracker: StatsTracker) -> None:
        """The stage's task eval through the engines (every process calls this: each runs its share of
        the eval samples on its own engine, process 0 combines the parts), recorded on ``tracker``
        (process 0's); the last one's metrics are the run's ``final_eval``."""
        from asyncrl.run.evaluate import combine_eval_parts, evaluate_part

        task = stage.task
        assert self.engine is not None, "every process holds its engine (Run.ensure_engine)"
        try:
            part = evaluate_part(self.engine, stage.workflow, task.eval, stage.cfg, eval_metrics=task.eval_metrics,
                                 share=(self.hosts.index, self.hosts.count))
        except Exception as err:
            if self.hosts.multi:  # process 0 names this process instead of waiting for its part
                self.hosts.gather("eval", {"error": f"{type(err).__name__}: {err}"})
            raise
        parts = self.hosts.gather("eval", part)
        if parts is None:
            return
        result = combine_eval_parts(parts, stage.workflow)
        usage = dict(result.engine_usage)
        if len(parts) > 1:  # each host's share of it, for its own counters
            usage.update({host_counter(index, name): float(part["usage"].get(name, 0.0))
                          for index, part in enumerate(parts) for name in HOST_COUNTERS})
        for name, value in usage.items():
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
        optimizer, counters and the source's position (RL: every process's rollout state; SFT: the
        data position). Every process writes its own shards of the arrays (never gathered) and its
        rollout state; process 0 the JSON. With ``checkpoint.asynchronous`` the write finishes while the next steps
        train (:meth:`finish_checkpoint` waits for it); at most one is in flight."""
        from asyncrl.checkpoint import start_checkpoint

        self.finish_checkpoint()
        arrays = {"params": trainer.params, "opt_state": trainer.opt_state}  # the live (sharded) trees
        if trainer.critic_spec is not None:  # the critic of algo.estimator gae: its live trees too
            arrays.update({name: getattr(trainer, name) for name in trainer.CRITIC_TREES})
        if stage.index > 0 and trainer.ref_params is not None:
            arrays["stage_start_params"] = stage.start_params
        state: dict[str, Any] = {}
        # Every process's own (its share of the samples), as of the step's publish, like the
        # engine counters below (read just before it).
        rollout_state = source.checkpoint_state() if stage.type == "rl" else None
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


def _server_index(name: str, process: int, processes: int) -> str:
    """``engine/server{i}/...`` of process ``process``'s remote engine (its i-th server) under the
    server's index in ``engine.remote.urls`` (:func:`~asyncrl.run.build.remote_share`); other names as they are."""
    found = re.match(r"engine/server(\d+)/", name)
    if found is None:
        return name
    return f"engine/server{process + int(found.group(1)) * processes}/{name[found.end():]}"


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
