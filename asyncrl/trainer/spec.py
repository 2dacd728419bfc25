"""The static descriptions :func:`asyncrl.trainer.step.train_step` is compiled for: the step's
shape (:class:`StepSpec`), the critic's (:class:`CriticSpec`) and the model graphdef, hashed once
(:class:`HashedGraphDef`). Hashable, so equal configs share one compilation."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from asyncrl.cluster.mesh import row_shards
from asyncrl.trainer.optim import OptimParams


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static shape of a step: the mesh, the model config, and the update structure."""

    mesh: Any
    """``jax.sharding.Mesh`` (hashable)."""
    model_cfg: Any
    """``asyncrl.model.DecoderConfig`` (for the partition rules)."""
    ppo_epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    objective: str = "rl"
    """``rl``: the policy loss of ``asyncrl.algo``; ``sft``: cross-entropy on trained tokens
    (one optimizer update per step: ``ppo_epochs == mini_batches == 1``)."""
    lora_dropout: float = 0.0
    """LoRA adapter-input dropout of the gradient passes (0: none; see :mod:`asyncrl.model.lora`)."""
    trie_branch: int = 0
    """With a decoding constraint (the ``trie`` argument of :func:`train_step`): the width of its
    per-token allowed-token gather (the trie pool's ``max_branch``); 0 without one."""
    entropy: bool = True
    """Compute the policy's token entropy (a pass over ``[tokens, vocab]``): needed when
    ``algo.entropy_coef > 0``, else only for the ``train/entropy`` diagnostic (``algo.log_entropy``)."""
    packed_segments: int = 0
    """With packed batches (``rollout.pack``): the most sequences one packed row holds
    (``rollout.pack_max_segments``), the static bound of cuDNN's packed layout; 0 unpacked."""

    @property
    def row_shards(self) -> int:
        return row_shards(self.mesh)


@dataclasses.dataclass(frozen=True)
class CriticSpec:
    """Static description of the critic of ``algo.estimator: gae`` (:mod:`asyncrl.model.critic`)."""

    graphdef: Any
    """The critic decoder's graphdef (a :class:`HashedGraphDef`)."""
    model_cfg: Any
    """Its ``DecoderConfig`` (partition rules)."""
    optim: OptimParams
    """``critic.optim``, resolved."""
    value_clip: Optional[float] = 0.2
    loss_coef: float = 1.0
    lora_dropout: float = 0.0
    """LoRA adapter dropout of the critic's gradient passes (``critic.lora.dropout``; 0: none)."""


class HashedGraphDef:
    """A model graphdef as :func:`train_step`'s static argument, hashed once.

    jit hashes its static arguments on every call, and an NNX graphdef hashes its whole node
    tree each time (about half a millisecond for ``tiny``: a visible share of a small step's
    fixed cost). Equal to another wrapper of an equal graphdef, so equal models still share
    one compilation."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef: Any):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, HashedGraphDef) and self._hash == other._hash
                                 and self.graphdef == other.graphdef)
