"""asyncrl: asynchronous reinforcement-learning post-training of language models in JAX.

The public names below are imported lazily, so ``import asyncrl`` (and the CLI's config
handling) stays free of jax, flax and transformers until a command needs them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
# The stable public API (docs/design.md "Public API"); everything else is importable from its
# module and may change.
_EXPORTS: dict[str, str] = {
    "load_config": "asyncrl.config",
    "Config": "asyncrl.config",
    "load_model": "asyncrl.model",
    "export_hf": "asyncrl.model",
    "per_token_logprobs": "asyncrl.model",
    "register": "asyncrl.registry",
    "resolve": "asyncrl.registry",
    "InferenceEngine": "asyncrl.engine.protocol",
    "GenerationRequest": "asyncrl.engine.protocol",
    "GenerationResponse": "asyncrl.engine.protocol",
    "FakeEngine": "asyncrl.engine.fake",
    "JaxEngine": "asyncrl.engine.jax_engine",
    "Trajectory": "asyncrl.rollout.trajectory",
    "TrajectoryGroup": "asyncrl.rollout.trajectory",
    "TrainBatch": "asyncrl.rollout.trajectory",
    "SimpleDataQueue": "asyncrl.rollout.queue",
    "RolloutWorkflow": "asyncrl.rollout.workflow",
    "SingleTurnWorkflow": "asyncrl.rollout.workflow",
    "WorkflowExecutor": "asyncrl.rollout.executor",
    "prepare_batch": "asyncrl.rollout.batch",
    "train": "asyncrl.run.loop",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
