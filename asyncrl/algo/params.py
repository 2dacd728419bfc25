"""The static (hashable) form of the ``algo`` config section, for ``static_argnames``.

Jitted functions take an :class:`AlgoParams` rather than the mutable config section.
It is *derived* from :class:`~asyncrl.config.AlgoConfig`, not mirrored: a frozen subclass,
so it carries every field of the section (a new field needs one edit, in the config) and
hashes and compares by value, so two trainers with equal configs share one compilation.
It adds only the values resolved from elsewhere in the config (:data:`RESOLVED_FIELDS`).
This module imports no jax.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from asyncrl.config import AlgoConfig, Config
from asyncrl.errors import ConfigError

RESOLVED_FIELDS = ("estimator", "estimator_kwargs", "max_new_tokens", "loss_norm_tokens")
"""Fields of :class:`AlgoParams` whose value is not the ``algo`` section's own, as given:
the estimator spec split into alias and kwargs, ``rollout.max_new_tokens``, and the
resolved ``loss_norm_tokens``. Every other field is the section's value unchanged."""


class AlgoParams(AlgoConfig):
    """Everything the algorithm functions read, with ``None`` defaults already resolved.

    Build one with :meth:`from_config`; tests may also construct one directly with keywords
    (validated like the config section)."""

    model_config = ConfigDict(frozen=True)

    estimator: str = "grpo"
    """Registered alias or ``pkg.module:Symbol`` of the advantage estimator (``algo.estimator``'s target)."""
    estimator_kwargs: tuple[tuple[str, Any], ...] = ()
    """Sorted ``(name, value)`` pairs bound to the estimator (hashable form of ``algo.estimator.kwargs``)."""
    max_new_tokens: int = Field(default=32, ge=1)
    """``rollout.max_new_tokens``: DAPO's L_max for the overlong penalty."""
    loss_norm_tokens: int = Field(default=32, ge=1)
    """Resolved: ``algo.loss_norm_tokens`` or else ``rollout.max_new_tokens``."""

    def replace(self, **changes: Any) -> "AlgoParams":
        """A copy with ``changes``, validated like the constructor (``dataclasses.replace`` for this frozen model)."""
        return type(self)(**{**dict(self), **changes})

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
        """True when the trainer must evaluate the frozen reference model (KL penalty in the loss or, with gae, in the reward)."""
        return self.kl_coef > 0 or self.reward_kl_coef > 0

    @property
    def uses_critic(self) -> bool:
        """True for ``algo.estimator: gae``: per-token advantages from the critic's values (:mod:`asyncrl.algo.value`)."""
        return self.estimator == "gae"

    @classmethod
    def from_config(cls, cfg: Config) -> "AlgoParams":
        """Build from the root :class:`~asyncrl.config.Config` (reads ``algo`` and ``rollout``)."""
        algo = cfg.algo
        spec = algo.estimator
        target, kwargs = (spec, {}) if isinstance(spec, str) else (spec.target, dict(spec.kwargs))
        frozen = tuple(sorted(kwargs.items()))
        try:
            hash(frozen)
        except TypeError:
            raise ConfigError(
                f"algo.estimator.kwargs: values must be numbers, strings or booleans (given {kwargs!r})"
            ) from None
        values = {name: getattr(algo, name) for name in AlgoConfig.model_fields}
        values.update(
            estimator=target,
            estimator_kwargs=frozen,
            max_new_tokens=cfg.rollout.max_new_tokens,
            loss_norm_tokens=algo.loss_norm_tokens or cfg.rollout.max_new_tokens,
        )
        return cls(**values)
