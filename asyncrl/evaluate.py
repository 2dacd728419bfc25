"""Evaluation on a task's held-out split: greedy reward and accuracy, and pass@k.

The loop calls :func:`evaluate` between publishes, so every eval request sees exactly one
weights version (checked: the result records it, and a version change mid-eval is an
error). ``asyncrl eval`` runs the same function alone.

Prompts and scores come from the workflow (``messages(sample)``, ``tokenizer`` and
``scorer``, as :class:`~asyncrl.rollout.workflow.SingleTurnWorkflow` has them), so
eval formats and grades exactly as training does.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from asyncrl.config import Config
from asyncrl.engine.protocol import GenerationRequest, InferenceEngine
from asyncrl.errors import AsyncRLError

EVAL_SAMPLE_ID_BASE = 1 << 30
"""Eval requests use sample ids from here on, so their random keys never coincide with
a training sample's (training ids count up from 0)."""


class EvalError(AsyncRLError):
    """Eval cannot run: a workflow without prompts/scores, or weights changed mid-eval."""


@dataclass
class EvalResult:
    metrics: dict[str, float]
    """``eval/reward``, ``eval/accuracy``, ``eval/pass@k``..., ``eval/n_prompts``, ``eval/version``."""
    rows: list[dict]
    """Per prompt: prompt, greedy completion, reward and components."""


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``correct`` succeeded (Chen et al., 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt (have {n})")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def _check_workflow(workflow: Any) -> None:
    missing = [name for name in ("messages", "tokenizer", "scorer") if not hasattr(workflow, name)]
    if missing:
        raise EvalError(
            f"eval: workflow '{type(workflow).__name__}' has no {', '.join(missing)}; eval formats prompts and "
            "scores completions like SingleTurnWorkflow (subclass it, or set eval.every_steps: 0 to turn eval off)"
        )


def evaluate(
    engine: InferenceEngine,
    workflow: Any,
    samples: Sequence[Mapping[str, Any]],
    cfg: Config,
    eval_metrics: Optional[Mapping[str, Callable[..., float]]] = None,
) -> EvalResult:
    """Greedy completions of every sample (and ``eval.n_samples`` sampled ones for pass@k).

    ``eval_metrics`` (a task's ``TaskData.eval_metrics``): each ``fn(prompt, completion,
    **sample_fields)`` averaged over the greedy completions, reported as ``eval/<name>``.
    """
    from asyncrl.rollout.workflow import _token_ids

    _check_workflow(workflow)
    ev = cfg.eval
    samples = list(samples)[: ev.max_prompts or None]
    if not samples:
        raise EvalError("eval: the eval split is empty (raise the dataset's eval_size, or set eval.every_steps: 0)")
    max_new_tokens = ev.max_new_tokens or cfg.rollout.max_new_tokens
    version = engine.version
    start = time.perf_counter()

    prompts, greedy_futures, sampled_futures = [], [], []
    for index, sample in enumerate(samples):
        messages, prompt = workflow.messages(sample)
        ids = _token_ids(workflow.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        prompts.append(prompt)
        sample_id = EVAL_SAMPLE_ID_BASE + index
        greedy_futures.append(
            engine.submit(GenerationRequest(prompt_ids=ids, greedy=True, max_new_tokens=max_new_tokens, sample_id=sample_id, timeout_s=ev.timeout_s))
        )
        if ev.n_samples > 0:
            sampled_futures.append(
                engine.submit(
                    GenerationRequest(
                        prompt_ids=ids, n=ev.n_samples, temperature=ev.temperature or cfg.rollout.temperature,
                        max_new_tokens=max_new_tokens, sample_id=sample_id, timeout_s=ev.timeout_s,
                    )
                )
            )

    def outputs(future: Future) -> list:
        return future.result(timeout=ev.timeout_s + 5)

    def score(sample: Mapping[str, Any], prompt: str, response: Any, index: int) -> tuple[float, dict[str, float], str]:
        completion = workflow.tokenizer.decode(list(response.output_ids), skip_special_tokens=True)
        fields = {k: v for k, v in sample.items() if k not in ("prompt", "messages", "completion")}
        reward, components = workflow.scorer.score(prompt, completion, fields, EVAL_SAMPLE_ID_BASE + index)
        return reward, components, completion

    rows, rewards, aborted = [], [], 0
    for index, (sample, prompt, future) in enumerate(zip(samples, prompts, greedy_futures)):
        (response,) = outputs(future)
        aborted += response.stop_reason == "aborted"
        if np.any(response.versions != version):
            raise EvalError(f"eval: weights changed during eval (served version {version}, got {sorted(set(response.versions.tolist()))})")
        reward, components, completion = score(sample, prompt, response, index)
        rewards.append(reward)
        rows.append({"prompt": prompt, "completion": completion, "reward": reward, **{f"reward/{k}": v for k, v in components.items()}})
        # issue-18 glue (the lead merges it with issue 13's eval): the task's own eval metrics.
        fields = {k: v for k, v in sample.items() if k not in ("prompt", "messages", "completion")}
        rows[-1].update({f"eval/{name}": float(fn(prompt, completion, **fields)) for name, fn in (eval_metrics or {}).items()})

    rewards_np = np.asarray(rewards, dtype=np.float64)
    metrics = {
        "eval/reward": float(rewards_np.mean()),
        "eval/accuracy": float((rewards_np >= ev.success_threshold).mean()),
        "eval/n_prompts": float(len(samples)),
        "eval/aborted": float(aborted),
        "eval/version": float(version),
    }
    for name in eval_metrics or {}:  # issue-18 glue, as above
        metrics[f"eval/{name}"] = float(np.mean([row[f"eval/{name}"] for row in rows]))
    if sampled_futures:
        correct = []
        for index, (sample, prompt, future) in enumerate(zip(samples, prompts, sampled_futures)):
            scores = [score(sample, prompt, response, index)[0] for response in outputs(future)]
            correct.append(sum(s >= ev.success_threshold for s in scores))
        for k in sorted({1, ev.n_samples}):
            metrics[f"eval/pass@{k}"] = float(np.mean([pass_at_k(ev.n_samples, c, k) for c in correct]))
    if engine.version != version:
        raise EvalError(f"eval: weights were published during eval (version {version} -> {engine.version})")
    metrics["eval/time_s"] = time.perf_counter() - start
    return EvalResult(metrics=metrics, rows=rows)


def evaluate_model(cfg: Config, stream: Any = None) -> EvalResult:
    """``asyncrl eval``: load ``model.path``, evaluate it on the dataset's eval split, print
    a table and one JSON line of the metrics."""
    import json
    import sys

    from asyncrl.engine.jax_engine import JaxEngine
    from asyncrl.model import load_model
    from asyncrl.train import build_task_and_workflow

    stream = stream or sys.stdout
    loaded = load_model(cfg.model)
    cfg, task, workflow = build_task_and_workflow(cfg, loaded.tokenizer)
    graphdef, params = loaded.split()
    engine = JaxEngine(graphdef, params, stop_token_ids=loaded.stop_token_ids, config=cfg.engine, seed=cfg.run.seed)
    try:
        result = evaluate(engine, workflow, task.eval, cfg, eval_metrics=getattr(task, "eval_metrics", None))
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
