"""What a train step costs in model FLOPs (the ``perf/mfu`` metric and ``scripts/bench.py``'s
fraction of peak): :func:`matmul_params` of a parameter tree, :func:`step_flops` of the policy's
step and :func:`critic_step_flops` of the critic's."""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np

from asyncrl.algo import AlgoParams
from asyncrl.trainer.optim import dotted_path


def matmul_params(params: Any, model_cfg: Any) -> int:
    """Parameters that take part in matmuls (every matrix but the embedding table, plus the lm head);
    of a mixture-of-experts layer's stacked experts ``[E, in, out]`` the ``k / E`` a token runs through."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if leaf.ndim == 2 and "embed_tokens" not in dotted_path(path):
            total += int(np.prod(leaf.shape))
        elif leaf.ndim == 3 and ".experts." in dotted_path(path):
            total += int(np.prod(leaf.shape)) * model_cfg.num_experts_per_tok // model_cfg.num_experts
    if model_cfg.tie_word_embeddings:
        total += model_cfg.vocab_size * model_cfg.hidden_size
    return total


def step_flops(n_matmul_params: int, model_cfg: Any, algo: Optional[AlgoParams], epochs: int, rows: int, length: int,
               train_passes: int = 3, window: Optional[int] = None) -> float:
    """Model FLOPs of one step (rematerialisation not counted), on every position of the padded batch.

    A forward pass costs ``2 * n_matmul_params + 4 * layers * L * heads * head_dim`` per token
    (:func:`matmul_params`; the attention is computed over all L positions), except that the lm
    head (``2 * vocab * hidden``) runs over the ``window`` scored positions only (default ``L``);
    a training pass (forward + backward) three forwards; pi_prox and pi_ref one forward each when
    computed (``algo=None``: an SFT step, training passes only). With LoRA a training pass is
    ``train_passes=2`` forwards: the frozen weights need no weight gradients (the adapters'
    own matmuls are not counted).
    """
    head = 2 * model_cfg.vocab_size * model_cfg.hidden_size
    window = length if window is None else min(window, length)
    per_token = 2 * n_matmul_params - head + 4 * model_cfg.num_layers * length * model_cfg.num_heads * model_cfg.head_dim
    passes = train_passes * epochs
    if algo is not None:
        passes += int(algo.needs_prox_recompute) + int(algo.needs_reference)
    return (float(per_token) * length + float(head) * window) * rows * passes


def critic_step_flops(critic_matmul_params: int, model_cfg: Any, epochs: int, rows: int, length: int,
                      train_passes: int = 3) -> float:
    """Model FLOPs of the critic in one step (``algo.estimator: gae``): the forward of its values at
    the step's start and ``train_passes`` forwards per epoch, every one without an lm head
    (``critic_matmul_params``: :func:`matmul_params` of its decoder, which counts no head), the
    value head's ``2 * hidden`` per position included."""
    per_token = 2 * critic_matmul_params + 2 * model_cfg.hidden_size + 4 * model_cfg.num_layers * length * model_cfg.num_heads * model_cfg.head_dim
    return float(per_token) * length * rows * (1 + train_passes * epochs)
