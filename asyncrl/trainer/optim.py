"""The optimizer: an optax chain built from the ``optim`` config section.

``clip_by_global_norm(optim.max_grad_norm)`` (once per update, after every micro-batch's
gradient has been accumulated) followed by AdamW (or SGD) whose learning rate follows
:func:`learning_rate_schedule`, counted in optimizer updates. Static configuration is an
:class:`OptimParams` (frozen, hashable), so the chain can be rebuilt inside a jitted
function from a ``static_argnames`` argument and instances with equal configs share
compilations.

Weight decay (AdamW, decoupled) applies to every parameter whose dotted path
(``layers.0.mlp.up_proj.kernel``) matches none of the ``optim.no_decay`` regexes; the
default ``("embed", "norm", "bias")`` exempts the embedding table (and with it a tied lm
head), every RMSNorm weight and every bias, as in GPT-2/nanoGPT and most RL trainers.

Non-finite updates are not handled here: the train step checks the loss and gradient
norm and keeps the old parameters and optimizer state (see :mod:`asyncrl.trainer.step`),
which is ``optax.apply_if_finite``'s rule without its "apply anyway after N errors" escape.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec
from pydantic import ConfigDict, Field

from asyncrl.config import Config, OptimConfig
from asyncrl.pytree import dotted_name as dotted_path  # the rules' name of a parameter path


class OptimParams(OptimConfig):
    """Hashable form of the ``optim`` section, with ``decay_steps`` resolved.

    Derived, not mirrored: a frozen subclass of :class:`~asyncrl.config.OptimConfig`, so it
    carries every field of the section (a new field needs one edit, in the config) and hashes
    by value (a ``static_argnames`` argument: equal configs share compilations). Only the
    fields in :data:`RESOLVED_FIELDS` differ from the section's values as given."""

    model_config = ConfigDict(frozen=True)

    decay_steps: int = Field(default=1, ge=1)
    """Resolved: ``optim.decay_steps``, or the run's optimizer updates after warm-up (at least 1)."""

    @classmethod
    def from_config(cls, cfg: Config, *, updates_per_step: Optional[int] = None) -> "OptimParams":
        """From the root config (reads ``optim``, ``run.total_steps`` and ``algo``).

        ``updates_per_step``: optimizer updates per trainer step, for the cosine decay's
        default length; default ``algo.ppo_epochs * algo.mini_batches`` (an SFT step is 1)."""
        o = cfg.optim
        if updates_per_step is None:
            updates_per_step = cfg.algo.ppo_epochs * cfg.algo.mini_batches
        updates_per_run = cfg.run.total_steps * updates_per_step
        decay = o.decay_steps if o.decay_steps is not None else max(updates_per_run - o.warmup_steps, 1)
        values = {name: getattr(o, name) for name in OptimConfig.model_fields}
        values.update(decay_steps=decay)
        return cls(**values)


RESOLVED_FIELDS = ("decay_steps",)
"""Fields of :class:`OptimParams` whose value is not the ``optim`` section's own, as given."""


def learning_rate_schedule(p: OptimParams):
    """``count -> lr`` (count = optimizer updates applied so far, from 0).

    Warm-up: ``lr * min(1, (count + 1) / warmup_steps)`` (the first update already moves).
    Then ``constant``, or ``cosine``: ``lr * (m + (1 - m) * (1 + cos(pi * k / decay_steps)) / 2)``
    with ``k = count - warmup_steps`` clipped to ``[0, decay_steps]`` and ``m = min_lr_ratio``.
    """

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warm = jnp.minimum(1.0, (count + 1.0) / p.warmup_steps) if p.warmup_steps > 0 else 1.0
        if p.schedule == "constant":
            return p.lr * warm
        k = jnp.clip(count - p.warmup_steps, 0.0, float(p.decay_steps))
        cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * k / p.decay_steps))
        return p.lr * warm * (p.min_lr_ratio + (1.0 - p.min_lr_ratio) * cosine)

    return schedule


def weight_decay_mask(params: Any, no_decay: tuple[str, ...]) -> Any:
    """Pytree of bools like ``params``: True where weight decay applies (no ``no_decay`` regex matches)."""
    patterns = [re.compile(p) for p in no_decay]
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(p.search(dotted_path(path)) for p in patterns), params
    )


def build_optimizer(p: OptimParams) -> optax.GradientTransformation:
    """The optax chain: optional global-norm clipping, then AdamW (masked decay) or SGD, on the schedule."""
    schedule = learning_rate_schedule(p)
    parts = []
    if p.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(p.max_grad_norm))
    if p.optimizer == "adamw":
        parts.append(
            optax.adamw(
                schedule, b1=p.b1, b2=p.b2, eps=p.eps, weight_decay=p.weight_decay,
                mask=lambda params: weight_decay_mask(params, p.no_decay),
            )
        )
    elif p.optimizer == "sgd":
        parts.append(optax.sgd(schedule))
    else:
        raise ValueError(f"optim.optimizer: unknown optimizer {p.optimizer!r}")
    return optax.chain(*parts)


def update_count(opt_state: Any) -> jax.Array:
    """Optimizer updates applied so far (the schedule's count), read from the optax state."""
    counts = [
        s.count for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByScheduleState))
        if isinstance(s, optax.ScaleByScheduleState)
    ]
    if not counts:
        raise ValueError("optimizer state has no schedule count")
    return counts[0]


def opt_state_shardings(optimizer: optax.GradientTransformation, opt_state: Any, p_shardings: Any, mesh: Any) -> Any:
    """Shardings of an optax state: per-parameter leaves follow their parameter, the rest replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, opt_state, p_shardings, transform_non_params=lambda _: replicated
    )
