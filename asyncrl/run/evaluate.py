"""Evaluation on a task's held-out split: greedy reward and accuracy, and pass@k.

The loop calls :func:`evaluate_workflow` between publishes, so every eval request sees exactly one
weights version (checked: the result records it, and a version change mid-eval is an
error). ``asyncrl eval`` runs the same function alone.

Eval runs the workflow's own ``run_episode`` on every eval sample, so a custom or
multi-turn workflow is evaluated exactly as it trains (its whole episode, its own
rewards). The engine it gets is an :class:`EvalEngine`, which rewrites the sampling
fields of each request to the eval settings: greedy (``eval.max_new_tokens`` when set),
or for pass@k the ``eval.temperature``. Eval samples carry sample ids from
:data:`EVAL_SAMPLE_ID_BASE` on. A greedy request for ``n`` samples is computed once and
returned ``n`` times (greedy samples are identical), so eval scores one trajectory per
prompt: the first of its group.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from asyncrl.config import Config
from asyncrl.engine.protocol import GenerationRequest, GenerationResponse, InferenceEngine
from asyncrl.errors import AsyncRLError, EngineCrashed

EVAL_SAMPLE_ID_BASE = 1 << 30
"""Eval requests use sample ids from here on, so their random keys never coincide with
a training sample's (training ids count up from 0)."""
_MAX_EVAL_THREADS = 256


class EvalError(AsyncRLError):
    """Eval cannot run: a workflow without ``run_episode``, a failing episode, or weights changed mid-eval."""


@dataclass
class EvalResult:
    metrics: dict[str, float]
    """``eval/reward``, ``eval/reward/<component>``, ``eval/accuracy``, ``eval/pass@k``..., ``eval/<metric>``,
    ``eval/episode/<name>``, ``eval/n_prompts``, ``eval/skipped``, ``eval/aborted``, ``eval/version``, ``eval/time_s``."""
    rows: list[dict]
    """Per prompt: prompt, greedy completion, reward and components."""
    engine_usage: dict[str, float] = dataclasses.field(default_factory=dict)
    """What the eval's requests cost the engine, under its counter names (``engine/requests``,
    ``engine/prefill_tokens``, ...: :class:`~asyncrl.engine.protocol.RequestUsage`); empty where the
    engine does not count per request."""


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``correct`` succeeded (Chen et al., 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt (have {n})")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


class EvalEngine:
    """An engine adapter that gives every request the eval sampling settings.

    Greedy mode: ``greedy=True`` and ``max_new_tokens`` (when given); the ``n`` samples of a
    request are computed once (``n=1``) and repeated, and identical greedy requests (the same
    prompt and limits, e.g. the per-sample calls of a multi-turn workflow) share one
    computation. Sampling mode: ``temperature`` and ``max_new_tokens`` (when given). Every
    request gets ``timeout_s``. Anything else is the wrapped engine's.

    ``beam_width`` > 0 (greedy mode; ``eval.decoding.strategy: beam``): the one computation is a
    beam search of that width (``length_penalty``) and its best beam stands for the ``n``
    samples. ``constraint`` (a :class:`~asyncrl.engine.constraints.TokenTrie`; ``eval.decoding.constraint``):
    every request without a constraint of its own decodes under it.
    """

    def __init__(self, engine: InferenceEngine, *, greedy: bool, temperature: float, max_new_tokens: Optional[int],
                 timeout_s: float, beam_width: int = 0, length_penalty: float = 1.0, constraint: Any = None):
        self.engine = engine
        self.beam_width = beam_width
        self.length_penalty = length_penalty
        self.constraint = constraint
        self.greedy = greedy
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._greedy_cache: dict[tuple, Future] = {}
        self._usage_lock = threading.Lock()  # apart: a callback may run inside submit, under self._lock
        self.usage: dict[str, float] = {}
        """The summed :class:`~asyncrl.engine.protocol.RequestUsage` of the requests sent to the engine (each once)."""

    def _tally(self, done: Future) -> None:
        """Add a finished engine request's usage (a callback of the engine's own future)."""
        if done.exception() is not None:
            return
        responses = done.result()
        usage = responses[0].usage if responses else None
        if usage is not None:
            with self._usage_lock:
                for name, value in usage.counters().items():
                    self.usage[name] = self.usage.get(name, 0.0) + value

    def _send(self, request: GenerationRequest) -> Future:
        future = self.engine.submit(request)
        future.add_done_callback(self._tally)
        return future

    @property
    def version(self) -> int:
        return self.engine.version

    def rewrite(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with the eval sampling fields."""
        max_new = self.max_new_tokens or request.max_new_tokens
        limited = dataclasses.replace(request, max_new_tokens=max_new, min_new_tokens=min(request.min_new_tokens, max_new),
                                      timeout_s=self.timeout_s)
        if self.constraint is not None and request.constraint is None:
            limited = dataclasses.replace(limited, constraint=self.constraint, min_new_tokens=0)
        if self.greedy and self.beam_width:
            return dataclasses.replace(limited, beam=True, n=self.beam_width, length_penalty=self.length_penalty,
                                       greedy=False, top_k=0, top_p=1.0, min_new_tokens=0)
        if self.greedy:
            return dataclasses.replace(limited, greedy=True, n=1)
        return dataclasses.replace(limited, greedy=False, temperature=self.temperature)

    def submit(self, request: GenerationRequest) -> "Future[list[GenerationResponse]]":
        rewritten = self.rewrite(request)
        if not self.greedy:
            return self._send(rewritten)
        key = (tuple(int(t) for t in rewritten.prompt_ids), rewritten.max_new_tokens, rewritten.min_new_tokens,
               None if rewritten.stop_token_ids is None else tuple(rewritten.stop_token_ids),
               tuple(tuple(seq) for seq in rewritten.stop_sequences),
               None if rewritten.constraint is None else rewritten.constraint.fingerprint)
        with self._lock:
            inner = self._greedy_cache.get(key)
            if inner is None:
                inner = self._greedy_cache[key] = self._send(rewritten)
        outer: Future = Future()

        def repeat(done: Future) -> None:
            error = done.exception()
            if error is not None:
                outer.set_exception(error)
            else:
                outer.set_result(list(done.result())[:1] * request.n)  # greedy: the one; beam: the best

        inner.add_done_callback(repeat)
        return outer

    def generate(self, request: GenerationRequest) -> list[GenerationResponse]:
        # The engine aborts a request after timeout_s; the margin covers queueing.
        return self.submit(request).result(timeout=self.timeout_s + 60)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def _check_workflow(workflow: Any) -> None:
    if not callable(getattr(type(workflow), "run_episode", None)):
        raise EvalError(
            f"eval: workflow '{type(workflow).__name__}' has no run_episode(engine, sample); eval runs the workflow's "
            "own episodes (subclass asyncrl.RolloutWorkflow, or set eval.every_steps: 0 to turn eval off)"
        )


class _EpisodePool:
    """Daemon threads that run eval episodes and live from one eval to the next (an eval used
    to start and end a thread per episode, up to 256, at every eval of a run).

    A thread is busy from :meth:`start` until its job returns. A job that never returns (an
    episode past its timeout, reported by the caller) keeps its thread: that thread is left
    behind and :meth:`reserve` starts another, so one stuck episode never shrinks later evals.
    """

    def __init__(self) -> None:
        self._jobs: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._busy = 0

    def reserve(self, workers: int) -> None:
        """Make sure ``workers`` threads are idle (each job then starts the moment it is submitted)."""
        with self._lock:
            missing = workers - (self._threads - self._busy)
            for _ in range(max(0, missing)):
                self._threads += 1
                threading.Thread(target=self._work, name=f"asyncrl-eval-{self._threads}", daemon=True).start()

    def start(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._busy += 1
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()  # an idle daemon thread waits here between evals
            try:
                job()  # jobs catch their own errors (see _run_concurrently)
            finally:
                with self._lock:
                    self._busy -= 1

    @property
    def threads(self) -> int:
        return self._threads


_POOL = _EpisodePool()


def _run_concurrently(jobs: Sequence[Callable[[], Any]], workers: int, timeout_s: float) -> list[tuple[str, Any]]:
    """Run ``jobs`` on the eval pool's daemon threads, at most ``workers`` at once: ``[("ok", value) or
    ("error", exc)]``. A job running past ``timeout_s`` is an :class:`EvalError` (its thread is abandoned)."""
    outcomes: list[Optional[tuple[str, Any]]] = [None] * len(jobs)
    started: dict[int, float] = {}
    cond = threading.Condition()
    running = [0]

    def run(index: int) -> None:
        try:
            outcome: tuple[str, Any] = ("ok", jobs[index]())
        except BaseException as err:  # noqa: BLE001 - reported to the caller
            outcome = ("error", err)
        with cond:
            outcomes[index] = outcome
            running[0] -= 1
            cond.notify_all()

    def wait() -> None:
        now = time.monotonic()
        late = [i for i, t in started.items() if outcomes[i] is None and now - t > timeout_s]
        if late:
            raise EvalError(f"eval: the episode of eval sample {late[0]} ran past rollout.episode_timeout_s = {timeout_s} s")
        cond.wait(1.0)

    _POOL.reserve(workers)
    with cond:
        for index in range(len(jobs)):
            while running[0] >= workers:
                wait()
            running[0] += 1
            started[index] = time.monotonic()
            _POOL.start(functools.partial(run, index))
        while any(outcome is None for outcome in outcomes):
            wait()
    return outcomes  # type: ignore[return-value]


def _episode_group(outcome: tuple[str, Any], workflow: Any, index: int) -> Any:
    """The group of one eval episode, or None when the workflow skipped the sample."""
    from asyncrl.rollout.workflow import SkipSample

    kind, value = outcome
    if kind == "ok":
        return value if value is not None and value.trajectories else None
    if isinstance(value, SkipSample):
        return None
    if isinstance(value, (EngineCrashed, EvalError)):
        raise value
    raise EvalError(f"eval: workflow '{type(workflow).__name__}' failed on eval sample {index}: "
                    f"{type(value).__name__}: {value}") from value


def _skip_reason(outcome: tuple[str, Any]) -> tuple[str, str]:
    """``(reason, detail)`` of an eval episode that gave no group."""
    kind, value = outcome
    if kind == "error":  # a SkipSample (other errors were raised by _episode_group)
        return value.reason, str(value)
    return "returned_none", "run_episode returned no trajectories"


_SKIP_ADVICE = {
    "prompt_too_long": "raise data.max_prompt_tokens (with engine.kv_capacity), or shorten the prompts "
                       "(the limit counts the chat template's tokens too)",
}


def _describe_skips(skips: Mapping[str, list[str]]) -> str:
    """``16 prompt_too_long (e.g. prompt_too_long: 40 tokens > data.max_prompt_tokens = 32): raise ...``."""
    parts = []
    for reason, details in sorted(skips.items(), key=lambda item: -len(item[1])):
        advice = _SKIP_ADVICE.get(reason)
        parts.append(f"{len(details)} {reason} (e.g. {details[0]})" + (f": {advice}" if advice else ""))
    return "; ".join(parts)


def _texts(workflow: Any, sample: Mapping[str, Any], group: Any) -> tuple[str, str]:
    """The prompt text and the completion text (the whole episode after the prompt) of a group's first trajectory."""
    traj = group.trajectories[0]
    generated = np.flatnonzero(traj.versions >= 0)
    first = int(generated[0]) if generated.size else len(traj.input_ids)
    prompt = (group.metadata or {}).get("prompt")
    if not isinstance(prompt, str):
        try:
            prompt = workflow.messages(sample)[1]
        except Exception:  # noqa: BLE001 - a workflow whose samples have no prompt field
            prompt = workflow.tokenizer.decode(traj.input_ids[:first].tolist(), skip_special_tokens=True)
    completion = (traj.metadata or {}).get("completion")
    if not isinstance(completion, str):
        completion = workflow.tokenizer.decode(traj.input_ids[first:].tolist(), skip_special_tokens=True)
    return prompt, completion


def evaluate_workflow(engine: InferenceEngine, workflow: Any, samples: Sequence[Mapping[str, Any]], cfg: Config,
             eval_metrics: Optional[Mapping[str, Callable[..., float]]] = None) -> EvalResult:
    """Run the workflow's episodes on the eval samples: greedily (reward, accuracy, components,
    ``eval_metrics``) and, with ``eval.n_samples``, sampled (pass@k)."""
    return combine_eval_parts([evaluate_part(engine, workflow, samples, cfg, eval_metrics, rows=True)], workflow)


def eval_samples(samples: Sequence[Mapping[str, Any]], cfg: Config) -> list[Mapping[str, Any]]:
    """The eval samples an eval runs: the first ``eval.max_prompts`` (all when 0); none is an error."""
    samples = list(samples)[: cfg.eval.max_prompts or None]
    if not samples:
        raise EvalError("eval: the eval split is empty (raise the dataset's eval_size, or set eval.every_steps: 0)")
    return samples


def share_of(count: int, process: int, processes: int) -> range:
    """The eval samples process ``process`` of ``processes`` runs: a contiguous block, the blocks in
    process order and as equal as they can be (so the combined order is the one-process order)."""
    return range(count * process // processes, count * (process + 1) // processes)


def evaluate_part(engine: InferenceEngine, workflow: Any, samples: Sequence[Mapping[str, Any]], cfg: Config,
                  eval_metrics: Optional[Mapping[str, Callable[..., float]]] = None, *, share: tuple[int, int] = (0, 1),
                  rows: bool = False) -> dict[str, Any]:
    """One process's part of an eval (``share``: ``(process, processes)``; its block of the eval
    samples, :func:`share_of`): per kept prompt its greedy reward, components, episode and task
    metrics (``rows``: also its texts), the skipped prompts, pass@k's correct counts, the engine
    work, as JSON-able data that :func:`combine_eval_parts` turns into the eval's metrics. Every
    sample keeps its sample id (``EVAL_SAMPLE_ID_BASE`` + its index among all eval samples), so
    its seeds do not depend on the process count."""
    _check_workflow(workflow)
    ev = cfg.eval
    every = eval_samples(samples, cfg)
    block = share_of(len(every), *share)
    version = engine.version
    start = time.perf_counter()
    decoding = ev.decoding
    constraint = None
    if decoding.constraint:
        from asyncrl.engine.constraints import load_trie

        constraint = load_trie(decoding.constraint)
    greedy = EvalEngine(engine, greedy=True, temperature=1.0, max_new_tokens=ev.max_new_tokens, timeout_s=ev.timeout_s,
                        beam_width=decoding.beam_width if decoding.strategy == "beam" else 0,
                        length_penalty=decoding.length_penalty, constraint=constraint)
    sampling = EvalEngine(engine, greedy=False, temperature=ev.temperature or cfg.rollout.temperature,
                          max_new_tokens=ev.max_new_tokens, timeout_s=ev.timeout_s, constraint=constraint)
    repeats = math.ceil(ev.n_samples / cfg.rollout.group_size) if ev.n_samples else 0
    n = len(every)

    def job(eval_engine: EvalEngine, index: int, sample_id: int) -> Callable[[], Any]:
        return lambda: workflow.run_episode(eval_engine, {**every[index], "sample_id": sample_id})

    jobs = [job(greedy, i, EVAL_SAMPLE_ID_BASE + i) for i in block]
    jobs += [job(sampling, i, EVAL_SAMPLE_ID_BASE + (r + 1) * n + i) for r in range(repeats) for i in block]
    outcomes = _run_concurrently(jobs, min(len(jobs), _MAX_EVAL_THREADS), cfg.rollout.episode_timeout_s) if jobs else []

    prompts: list[dict[str, Any]] = []
    skips: dict[str, list[str]] = {}  # reason -> details, for the error when nothing is left
    mine = len(block)
    for position, index in enumerate(block):
        group = _episode_group(outcomes[position], workflow, index)
        if group is None:
            reason, detail = _skip_reason(outcomes[position])
            skips.setdefault(reason, []).append(detail)
            continue
        traj = group.trajectories[0]
        served = traj.versions[traj.versions >= 0]
        if np.any(served != version):
            raise EvalError(f"eval: weights changed during eval (served version {version}, got {sorted(set(served.tolist()))})")
        prompt, completion = _texts(workflow, every[index], group)
        record: dict[str, Any] = {
            "reward": float(traj.reward), "components": {k: float(v) for k, v in traj.reward_components.items()},
            "episode": {k: float(v) for k, v in (traj.metadata or {}).get("episode_metrics", {}).items()},
            "task": _task_values(eval_metrics or {}, prompt, completion, every[index]),
            "aborted": traj.stop_reason == "aborted",
        }
        if rows:
            record["row"] = {"prompt": prompt, "completion": completion, "reward": traj.reward,
                             **{f"reward/{k}": v for k, v in traj.reward_components.items()}}
        prompts.append(record)
    correct = [_correct_count([outcomes[mine * (r + 1) + position] for r in range(repeats)], workflow, index,
                              ev.n_samples, ev.success_threshold) for position, index in enumerate(block)] if repeats else []
    if engine.version != version:
        raise EvalError(f"eval: weights were published during eval (version {version} -> {engine.version})")
    usage = {name: greedy.usage.get(name, 0.0) + sampling.usage.get(name, 0.0)
             for name in {*greedy.usage, *sampling.usage}}
    return {"n": mine, "prompts": prompts, "skips": skips, "correct": correct, "version": version, "usage": usage,
            "n_samples": ev.n_samples if repeats else 0, "threshold": ev.success_threshold,
            "time_s": time.perf_counter() - start}


def combine_eval_parts(parts: Sequence[Mapping[str, Any]], workflow: Any) -> EvalResult:
    """The eval's :class:`EvalResult` from every process's :func:`evaluate_part`, in process order
    (the means run over the prompts in the one-process order, so one process and several give the
    same figures)."""
    prompts = [record for part in parts for record in part["prompts"]]
    n = sum(int(part["n"]) for part in parts)
    if not prompts:
        skips: dict[str, list[str]] = {}
        for part in parts:
            for reason, details in part["skips"].items():
                skips.setdefault(reason, []).extend(details)
        raise EvalError(f"eval: workflow '{type(workflow).__name__}' skipped every one of the {n} eval samples: "
                        + _describe_skips(skips))
    threshold = float(parts[0]["threshold"])
    rewards = np.asarray([r["reward"] for r in prompts], dtype=np.float64)
    metrics = {"eval/reward": float(rewards.mean()), "eval/accuracy": float((rewards >= threshold).mean())}
    for prefix, field in (("eval/reward/", "components"), ("eval/episode/", "episode"), ("eval/", "task")):
        values: dict[str, list[float]] = {}
        for record in prompts:
            for name, value in record[field].items():
                values.setdefault(name, []).append(value)
        metrics.update({f"{prefix}{name}": float(np.mean(v)) for name, v in values.items()})
    metrics.update({"eval/n_prompts": float(len(prompts)), "eval/skipped": float(n - len(prompts)),
                    "eval/aborted": float(sum(r["aborted"] for r in prompts)),
                    "eval/version": float(parts[0]["version"])})
    n_samples = int(parts[0]["n_samples"])
    correct = [c for part in parts for c in part["correct"] if c is not None]
    if n_samples and correct:
        metrics.update({f"eval/pass@{k}": float(np.mean([pass_at_k(n_samples, c, k) for c in correct]))
                        for k in sorted({1, n_samples})})
    metrics["eval/time_s"] = max(float(part["time_s"]) for part in parts)
    usage: dict[str, float] = {}
    for part in parts:
        for name, value in part["usage"].items():
            usage[name] = usage.get(name, 0.0) + float(value)
    return EvalResult(metrics=metrics, rows=[r["row"] for r in prompts if "row" in r], engine_usage=usage)


def _task_values(eval_metrics: Mapping[str, Callable[..., float]], prompt: str, completion: str,
                 sample: Mapping[str, Any]) -> dict[str, float]:
    """``{name: fn(prompt, completion, **sample_fields)}`` of the task's eval metrics for one greedy completion."""
    from asyncrl.rollout.rewards import reward_fields

    out = {}
    for name, fn in eval_metrics.items():
        try:
            out[name] = float(fn(prompt, completion, **reward_fields(sample)))
        except Exception as err:  # noqa: BLE001 - named, with the prompt
            raise EvalError(f"eval: the task's eval metric '{name}' raised on prompt {prompt[:60]!r}: "
                            f"{type(err).__name__}: {err}") from err
    return out


def _correct_count(outcomes: list, workflow: Any, index: int, n_samples: int, threshold: float) -> Optional[int]:
    """How many of a prompt's first ``n_samples`` sampled completions succeed (None: a skipped prompt)."""
    scores: list[float] = []
    for outcome in outcomes:
        group = _episode_group(outcome, workflow, index)
        scores += [t.reward for t in group.trajectories] if group is not None else []
    if len(scores) < n_samples:
        return None
    return int(sum(s >= threshold for s in scores[:n_samples]))


def evaluate_model(cfg: Config, stream: Any = None) -> EvalResult:
    """``asyncrl eval``: load ``model.path``, evaluate it on the dataset's eval split, print
    a table and one JSON line of the metrics."""
    import json
    import sys

    from asyncrl.model import load_model
    from asyncrl.run.build import build_local_engine, build_task_and_workflow

    stream = stream or sys.stdout
    loaded = load_model(cfg.model)
    cfg, task, workflow = build_task_and_workflow(cfg, loaded.tokenizer)
    graphdef, params = loaded.split()
    engine = build_local_engine(cfg, graphdef, params, loaded.stop_token_ids)
    try:
        result = evaluate_workflow(engine, workflow, task.eval, cfg, eval_metrics=getattr(task, "eval_metrics", None))
    finally:
        engine.shutdown()
    width = max(len(name) for name in result.metrics)
    print(f"{'metric'.ljust(width)}  value", file=stream)
    for name, value in result.metrics.items():
        print(f"{name.ljust(width)}  {value:.4f}", file=stream)
    for row in result.rows[:5]:
        print(f"  {row['prompt']!r} -> {row['completion']!r}  reward {row['reward']:.3f}", file=stream)
    print(json.dumps({"model": cfg.model.path, **result.metrics}), file=stream)
    return result
