"""The builders that training and ``asyncrl eval`` share: a stage's task (dataset), rewards
and workflow, the start-up checks of every stage (:func:`preflight`), the inference engine,
and the per-episode metric means that both the loop and eval report.

Nothing here imports the loop (:mod:`asyncrl.run.loop`) or eval (:mod:`asyncrl.run.evaluate`):
both import this module, so neither imports the other.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np

from asyncrl.config import Config, RewardSpec
from asyncrl.errors import AsyncRLError

log = logging.getLogger(__name__)

PROMPT_CHECK_SAMPLES = 2000
"""At most this many train prompts (evenly spaced over the split) are tokenized at start-up."""
ANSWER_CHECK_SAMPLES = 256
"""At most this many reference answers (eval split first) are walked through a decoding constraint at start-up."""


def build_task_and_workflow(cfg: Config, tokenizer: Any) -> tuple[Config, Any, Any]:
    """Resolve the dataset, default the rewards to the task's own, build the workflow."""
    from asyncrl.registry import resolve
    from asyncrl.rollout.reward_model import prepare_reward_functions
    from asyncrl.rollout.rewards import build_reward_functions, check_reward_signatures
    from asyncrl.rollout.workflow import build_workflow

    factory = resolve("dataset", cfg.data.dataset, where="data.dataset")
    try:
        task = factory(seed=cfg.run.seed)
    except ValueError as err:  # the dataset's own checks (a negative size; UnicodeDecodeError is one too)
        from asyncrl.data import DataError

        raise DataError(f"data.dataset ({_target(cfg.data.dataset)}): {err}") from None
    if not cfg.rewards:
        if task.reward is None:
            raise AsyncRLError("rewards: the config names no reward function and data.dataset has no default one")
        cfg = cfg.model_copy(update={"rewards": [RewardSpec(fn=task.reward)]})
    workflow = build_workflow(cfg, tokenizer)
    # Every reward function must accept the documented call with this dataset's fields: a wrong
    # signature is a config error now, not a run of fallback scores.
    first = next(iter(task.train), None) or next(iter(task.eval), None)
    functions = build_reward_functions(cfg)
    if first is not None:
        check_reward_signatures(functions, first, workflow.prompt_field)
    # Rewards that load something (reward_model: its checkpoint, tokenizer check, device
    # placement, a first compile) do it now, before step 1.
    prepare_reward_functions(functions, cfg, tokenizer, first)
    check_answers_under_constraint(cfg, task, tokenizer)
    return cfg, task, workflow


def check_answers_under_constraint(cfg: Config, task: Any, tokenizer: Any) -> None:
    """Refuse a decoding constraint under which most of the task's reference answers (the
    samples' ``answer`` fields) cannot be decoded: it was written for another catalog, seed or
    tokenizer, and nearly every completion would score as wrong. A few answers off it: a warning."""
    from asyncrl.data import DataError

    field = "rollout.decoding.constraint" if cfg.rollout.decoding.constraint else "eval.decoding.constraint"
    path = cfg.rollout.decoding.constraint or cfg.eval.decoding.constraint
    if not path:
        return
    from asyncrl.engine.constraints import load_trie

    trie = load_trie(path)
    samples = [*task.eval, *task.train[:ANSWER_CHECK_SAMPLES]]
    answers = [s["answer"] for s in samples if isinstance(s.get("answer"), str)][:ANSWER_CHECK_SAMPLES]
    if not answers:
        return

    def token_path(text: str) -> Optional[list[int]]:
        ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
        try:
            trie.walk(ids)
        except ValueError:
            return ids
        return None

    missed = [(a, ids) for a in answers if (ids := token_path(a)) is not None]
    kwargs = getattr(cfg.data.dataset, "kwargs", None) or {}
    dataset = f"data.dataset {_target(cfg.data.dataset)} (seed {kwargs.get('seed', cfg.run.seed)})"
    if 2 * len(missed) > len(answers):
        says = next((line.lstrip("# ").strip() for line in Path(path).read_text().splitlines() if line.startswith("#")), "")
        raise DataError(
            f"{field} {path}: {len(missed)} of {len(answers)} reference answers of {dataset} cannot be decoded under it "
            f"(e.g. {missed[0][0]!r} = tokens {missed[0][1]}), so those samples can never score; the file was written for "
            f"another catalog, seed or tokenizer{f' ({says})' if says else ''}: write it again for this run's data"
        )
    if missed:
        log.warning("%s %s: %d of %d reference answers of %s cannot be decoded under it (e.g. %r): those samples "
                    "can never be answered right", field, path, len(missed), len(answers), dataset, missed[0][0])


def preflight(cfg: Config, tokenizer: Any) -> list[tuple[Config, Any, Any]]:
    """Build and check every stage's dataset, rewards and workflow before the first step of the
    first stage, so a later stage's bad input is reported before anything trains. Returns
    ``(stage config, task, workflow)`` per stage; errors name the stage and the field."""
    from asyncrl.data import DataError

    parts = []
    for index, (stage, scfg) in enumerate(cfg.stage_configs()):
        where = f"stages.{index} ({stage.name}): " if cfg.stages else ""
        try:
            built = build_task_and_workflow(scfg, tokenizer)
        except AsyncRLError as err:
            raise _in_stage(err, where) from None
        if len(built[1].train) == 0:
            raise DataError(f"{where}data.dataset ({_target(scfg.data.dataset)}): the train split is empty")
        if stage.type == "rl":
            _check_prompts_fit(built[0], built[1].train, built[2], tokenizer, where)
        parts.append(built)
    return parts


def _in_stage(err: AsyncRLError, where: str) -> AsyncRLError:
    from asyncrl.errors import ConfigError

    if not where:
        return err
    if isinstance(err, ConfigError):
        return ConfigError([where + err.problems[0], *err.problems[1:]])
    return AsyncRLError(f"{where}{err}")


def _target(spec: Any) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "target", str(spec))


def _check_prompts_fit(scfg: Config, train: Any, workflow: Any, tokenizer: Any, where: str) -> None:
    """Fail at start-up, with the counts, when no train prompt fits ``data.max_prompt_tokens``
    (each would be dropped and the first batch would wait for its timeout). Checks workflows
    that say how they render a prompt (``messages(sample)``, like the single-turn one)."""
    from asyncrl.data import DataError
    from asyncrl.rollout.workflow import render_prompt

    if not callable(getattr(workflow, "messages", None)):
        return
    limit = scfg.data.max_prompt_tokens
    checked = sorted({int(i) for i in np.linspace(0, len(train) - 1, min(len(train), PROMPT_CHECK_SAMPLES))})
    lengths = []
    for position in checked:
        try:
            messages, _ = workflow.messages(train[position])
        except (KeyError, ValueError, TypeError) as err:
            raise DataError(f"{where}data.dataset: train sample {position}: {err}") from None
        lengths.append(len(render_prompt(tokenizer, messages, scfg.data.chat_template_kwargs)))
    fit = sum(length <= limit for length in lengths)
    if fit == 0:
        raise DataError(
            f"{where}data.dataset ({_target(scfg.data.dataset)}): no usable prompt: 0 of {len(lengths)} train prompts "
            f"checked (of {len(train)}) fit data.max_prompt_tokens = {limit} (the shortest has {min(lengths)} tokens, "
            "chat template included); raise data.max_prompt_tokens (with engine.kv_capacity) or shorten "
            "the prompts"
        )
    if fit < len(lengths):
        log.info("%sdata.dataset: %d of %d train prompts checked are longer than data.max_prompt_tokens = %d and "
                 "will be dropped (dropped:prompt_too_long)", where, len(lengths) - fit, len(lengths), limit)


def build_local_engine(cfg: Config, graphdef: Any, params: Any, stop_token_ids: Any, *, version: int = 0,
                       placement: Any = None) -> Any:
    """An in-process :class:`~asyncrl.engine.jax_engine.JaxEngine` serving ``params`` on its
    placement (``placement``, a :class:`~asyncrl.cluster.placement.Placement`; None: resolved from
    ``cfg`` now). On one device it serves the given arrays as they are; on more, colocated or not,
    it gets its own mesh on its devices (:func:`~asyncrl.cluster.placement.engine_mesh`) and a
    serving copy of ``params`` laid out there, with ``engine.slots`` (``auto`` sized first) moved to
    a multiple of its replicas."""
    from asyncrl.cluster.placement import engine_mesh, resolve_placement
    from asyncrl.engine.jax_engine import JaxEngine
    from asyncrl.engine.jax_programs import graphdef_config
    from asyncrl.run.auto_slots import resolve_auto_slots, round_slots_to_replicas

    cfg = resolve_auto_slots(cfg, graphdef_config(graphdef, params))  # engine.slots: auto, from the memory left
    placement = placement if placement is not None else resolve_placement(cfg)
    mesh = None if placement.shares_trainer_arrays else engine_mesh(placement)
    if mesh is not None:
        cfg = round_slots_to_replicas(cfg, placement.engine_replicas)
    return JaxEngine(graphdef, params, stop_token_ids=stop_token_ids, config=cfg.engine, seed=cfg.run.seed,
                     version=version, mesh=mesh)


def build_engine(cfg: Config, loaded: Any, graphdef: Any, params: Any, *, version: int, out: Path,
                 placement: Any = None, writer: Any = None, written: Optional[Path] = None) -> Any:
    """The run's inference engine: in-process on its ``placement`` (:func:`build_local_engine`), or
    on servers when ``engine.remote`` is set (their weights written by ``writer``, default
    :func:`weights_writer`; ``written``: version ``version`` already written by every process).
    ``loaded`` is the :class:`~asyncrl.model.LoadedModel` (tokenizer, stop ids)."""
    remote = cfg.engine.remote
    if remote is None:
        return build_local_engine(cfg, graphdef, params, loaded.stop_token_ids, version=version, placement=placement)
    from asyncrl.engine.remote import RemoteEngine

    writer = writer if writer is not None else weights_writer(cfg, loaded, out)
    engine = RemoteEngine.from_config(
        remote, version=version, graphdef=graphdef, tokenizer=loaded.tokenizer, stop_token_ids=loaded.stop_token_ids,
        writer=writer,
    )
    engine.ensure_version(params, written)  # fresh servers of a resumed run
    return engine


def remote_share(cfg: Config, index: int, count: int) -> Config:
    """``cfg`` with ``engine.remote.urls`` cut to the servers process ``index`` of ``count`` drives
    (server ``i`` to process ``i % count``; one process: all of them): every process of a
    multi-process run generates its share of the prompts on servers of its own."""
    remote = cfg.engine.remote
    if remote is None or count == 1:
        return cfg
    if len(remote.urls) < count:
        from asyncrl.errors import ConfigError

        raise ConfigError(f"engine.remote.urls: {len(remote.urls)} server(s) for {count} processes; every process "
                          f"generates on servers of its own (server i goes to process i % {count}): give at least {count}")
    engine = cfg.engine.model_copy(update={"remote": remote.model_copy(update={"urls": remote.urls[index::count]})})
    return cfg.model_copy(update={"engine": engine})


def weights_writer(cfg: Config, loaded: Any, out: Path) -> Any:
    """The :class:`~asyncrl.engine.publish.WeightsWriter` of an ``engine.remote`` run: into
    ``engine.remote.weights_dir`` (default ``<out>/weights``), in ``engine.remote.dtype``."""
    from asyncrl.engine.publish import WeightsWriter

    remote = cfg.engine.remote
    assert remote is not None
    return WeightsWriter(loaded.config, Path(remote.weights_dir) if remote.weights_dir else out / "weights",
                         dtype=remote.dtype, keep=remote.keep_weights, tokenizer=loaded.tokenizer,
                         stop_token_ids=loaded.stop_token_ids)


def episode_metric_means(trajectories: list) -> dict[str, float]:
    """Mean of each ``metadata["episode_metrics"][name]`` over the trajectories that report it."""
    values: dict[str, list[float]] = {}
    for traj in trajectories:
        for name, value in (traj.metadata or {}).get("episode_metrics", {}).items():
            values.setdefault(name, []).append(float(value))
    return {name: float(np.mean(v)) for name, v in values.items()}
