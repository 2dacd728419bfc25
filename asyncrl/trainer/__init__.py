"""The trainer: jitted optax updates of the policy on a device mesh.

- :mod:`asyncrl.trainer.trainer`: :class:`Trainer` (``step``, ``params_for_publish``,
  ``state_dict``/``load_state_dict``);
- :mod:`asyncrl.trainer.step`: the module-level jitted :func:`train_step` (mask and advantages,
  pi_prox / pi_ref, the scan over optimizer updates and micro-batches);
- :mod:`asyncrl.trainer.losses`: what the step differentiates, one micro-batch at a time, and the
  whole-batch targets (advantages, pi_prox / pi_ref log-probs, GAE) it computes first;
- :mod:`asyncrl.trainer.optim`: the optax chain (clipping, AdamW with a weight-decay mask,
  warm-up + constant/cosine schedule) from the ``optim`` config section;
- :mod:`asyncrl.trainer.spec`: the static descriptions the step is compiled for;
- :mod:`asyncrl.trainer.flops`: a step's model FLOPs (MFU).

The ``(data, fsdp, tensor)`` mesh is :mod:`asyncrl.cluster.mesh`'s, the ``jax.distributed``
set-up :mod:`asyncrl.cluster.distributed`'s.
"""

from asyncrl.trainer.flops import step_flops
from asyncrl.trainer.losses import sft_loss
from asyncrl.trainer.optim import OptimParams, build_optimizer, learning_rate_schedule, weight_decay_mask
from asyncrl.trainer.step import StepSpec, compile_count, nll_sums, train_step
from asyncrl.trainer.trainer import Trainer

__all__ = [
    "OptimParams",
    "StepSpec",
    "Trainer",
    "build_optimizer",
    "compile_count",
    "learning_rate_schedule",
    "nll_sums",
    "sft_loss",
    "step_flops",
    "train_step",
    "weight_decay_mask",
]
