"""The static (hashable) form of the ``algo`` config section, for ``static_argnames``.

Jitted functions take an :class:`AlgoParams` rather than the pydantic section: a frozen
dataclass of plain values hashes and compares by value, so two trainers with equal
configs share one compilation. This module imports no jax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from asyncrl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class AlgoParams:
    """Everything the algorithm functions read, with ``None`` defaults already resolved."""

    estimator: str = "grpo"
    """Registered alias or ``pkg.module:Symbol`` of the advantage estimator."""
    estimator_kwargs: tuple[tuple[str, Any], ...] = ()
    """Sorted ``(name, value)`` pairs bound to the estimator (hashable form of a dict)."""
    reward_scale: float = 1.0
    reward_bias: float = 0.0
    truncated: str = "keep"
    overlong_buffer: int = 8
    overlong_penalty: float = 1.0
    max_new_tokens: int = 32
    """``rollout.max_new_tokens``: DAPO's L_max for the overlong penalty."""
    ratio: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    decoupled: bool = False
    prox_logp: str = "recompute"
    mismatch_correction: bool = False
    behave_weight_cap: Optional[float] = 5.0
    behave_weight_mode: str = "truncate"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    aggregation: str = "token-mean"
    loss_norm_tokens: int = 32
    """Resolved: ``algo.loss_norm_tokens`` or else ``rollout.max_new_tokens``."""

    @property
    def weighted(self) -> bool:
        """True when the loss takes its ratio against pi_prox and carries w = pi_prox/pi_behave."""
        return self.decoupled or self.mismatch_correction

    @property
    def needs_prox_recompute(self) -> bool:
        """True when the trainer must evaluate pi_prox (weights at the step's start) on the batch."""
        return self.mismatch_correction or (self.decoupled and self.prox_logp == "recompute")

    @property
    def needs_reference(self) -> bool:
        """True when the trainer must evaluate the frozen reference model (KL penalty on)."""
        return self.kl_coef > 0

    @classmethod
    def from_config(cls, cfg: Any) -> "AlgoParams":
        """Build from the root :class:`asyncrl.config.Config` (reads ``algo`` and ``rollout``)."""
        algo = cfg.algo
        spec = algo.estimator
        if isinstance(spec, str):
            target, kwargs = spec, {}
        else:
            target, kwargs = spec.target, dict(spec.kwargs)
        frozen = tuple(sorted(kwargs.items()))
        try:
            hash(frozen)
        except TypeError:
            raise ConfigError(
                f"algo.estimator.kwargs: values must be numbers, strings or booleans (given {kwargs!r})"
            ) from None
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in algo.model_dump().items() if k in fields}
        values.update(
            estimator=target,
            estimator_kwargs=frozen,
            max_new_tokens=cfg.rollout.max_new_tokens,
            loss_norm_tokens=algo.loss_norm_tokens or cfg.rollout.max_new_tokens,
        )
        return cls(**values)
