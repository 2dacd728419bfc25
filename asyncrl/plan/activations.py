"""What one device holds for a train step's backward pass, per micro-batch: the activation
formulas of ``asyncrl plan`` (:mod:`asyncrl.plan.formulas` adds them to the parameters,
gradients, optimizer state and the engine's share).

The copies XLA keeps differ by backend (attention scores, the lm head's logits:
:func:`attention_score_bytes`, :func:`head_logit_bytes`); the GPU and TPU figures are read from
XLA's buffer assignments of the compiled programs (docs/performance.md "The formulas against XLA").
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

from asyncrl.config import Config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
NORM_FLOAT32_COPIES = 2
"""Float32 copies of the hidden state each layer keeps for its two RMSNorms' backward."""
CPU_ATTENTION_FLOAT32_COPIES = 3
"""On the CPU: float32 ``[heads, L]`` tensors per token each layer keeps for attention's backward
(scores, probabilities, and the softmax's exponentials); measured: ``scripts/bench.py plan``. GPU
and TPU compilers fuse the softmax and keep the float32 scores and the probabilities in the compute
dtype (:func:`attention_score_bytes`; read from XLA's buffer assignment for an H100)."""
HEAD_FLOAT32_COPIES = 2
"""On the CPU and TPUs: float32 ``[rows, chunk, vocab]`` tensors of the lm head's backward (the
logits and their cotangent); GPU compilers keep the float32 logits and a compute-dtype cotangent."""


def attention_score_bytes(compute_bytes: int, backend: str) -> int:
    """Bytes one attention score (one query, one key, one head) of a layer keeps for its backward,
    where attention runs by XLA (a dense mask: the ``xla`` and ``reference`` kernels)."""
    return CPU_ATTENTION_FLOAT32_COPIES * 4 if backend == "cpu" else 4 + compute_bytes


def planned_kernel(model_cfg: Any, backend: str, packed: bool = False) -> str:
    """The several-token attention kernel the train step gets on ``backend`` (``cpu``, ``gpu``,
    ``tpu``), as :func:`asyncrl.model.attention.attention_kernel` picks it for the trainer's mesh:
    ``cudnn`` (``cudnn-packed`` for packed rows), ``splash``, or ``xla``."""
    from asyncrl.model.attention import KernelTarget, attention_kernel

    kernel = attention_kernel(model_cfg.attention, model_cfg.compute_dtype, model_cfg.head_dim,
                              target=KernelTarget(backend if backend in ("gpu", "tpu") else "cpu", mesh=object()))
    return "cudnn-packed" if kernel == "cudnn" and packed else kernel


def attention_kept_bytes(kernel: str, heads: int, length: int, compute_bytes: int, backend: str, segments: int = 0) -> int:
    """Bytes per token and layer attention keeps for its backward beyond its inputs and output: the
    dense ``[heads, length]`` scores by XLA (:func:`attention_score_bytes`); a fused kernel keeps
    only its float32 softmax statistics per query and head, ``[rows, heads, T]`` (cuDNN's packed
    layout: per cuDNN segment, ``[rows x (segments + 1), heads, T]``). Read from XLA's buffer
    assignments of the train step compiled for an H100 and a v6e-8."""
    if kernel in ("xla", "reference"):
        return heads * length * attention_score_bytes(compute_bytes, backend)
    if kernel == "cudnn-packed":
        return heads * (segments + 1) * 4
    return heads * 4


def head_logit_bytes(compute_bytes: int, backend: str) -> int:
    """Bytes per position and vocabulary entry of the lm head's backward (one chunk at a time): on
    TPUs two float32 ``[rows, chunk, vocab]`` tensors (libtpu's buffer assignment of the
    long-reasoning recipe's step on a v6e-8 at 8,384-position chunks holds two at once), on GPUs the
    float32 logits and a compute-dtype cotangent."""
    if backend == "gpu":
        return 4 + compute_bytes
    return HEAD_FLOAT32_COPIES * 4


def param_count(tree: Any) -> int:
    """Parameters in ``tree`` (arrays or ``jax.ShapeDtypeStruct`` leaves)."""
    import jax

    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def batch_shape(cfg: Config, sft: bool) -> tuple[int, int, int]:
    """``(rows, L, W)`` of a trainer step: rows (padded to the mesh later), the batch length (the
    longest allowed sequence rounded up to ``rollout.length_bucket``), and the trained window
    (the completion, rounded the same way). Packed (``rollout.pack``) the rows are the worst case's
    (every sequence of length ``L`` fills a packed row of its own) and the window is ``L``: a
    packed row is scored whole (:mod:`asyncrl.trainer.packed`)."""
    bucket = cfg.rollout.length_bucket
    round_up = lambda n: -(-n // bucket) * bucket  # noqa: E731
    length = round_up(cfg.max_seq_len)
    if sft:
        return cfg.sft.batch_size, length, length
    rows = cfg.rollout.batch_size * cfg.rollout.group_size
    return rows, length, length if cfg.packs else min(length, round_up(cfg.rollout.max_new_tokens))


def layer_share(model_cfg: Any) -> float:
    """The decoder layers' share of the parameters (all but the embedding, the lm head and the final norm)."""
    total = model_cfg.num_params()
    outside = model_cfg.vocab_size * model_cfg.hidden_size * (1 if model_cfg.tie_word_embeddings else 2) + model_cfg.hidden_size
    return (total - outside) / total


def stacked_layers(model_cfg: Any) -> list[int]:
    """The layers ``model.scan_layers`` stacks: those in runs of two or more consecutive layers of
    one kind (attention type; mixture-of-experts or dense). A run of one layer (Gemma 3's global
    layers between its sliding ones) is called as it is, unstacked (asyncrl/model/transformer.py
    ``scanned_layers``; XLA's buffer assignment for an L4 holds ``[5, ...]`` and ``[2, ...]`` stacks
    for an 8-layer Gemma 3, none for its global layer)."""
    import itertools

    moe = bool(getattr(model_cfg, "num_experts", 0))
    kind = lambda i: (model_cfg.layer_type(i), moe and model_cfg.is_moe_layer(i))  # noqa: E731
    runs = [list(run) for _, run in itertools.groupby(range(model_cfg.num_layers), key=kind)]
    return [i for run in runs if len(run) > 1 for i in run]


def stacked_share(model_cfg: Any, params: dict) -> float:
    """The share of the parameters in the layers :func:`stacked_layers` stacks."""
    return sum(param_count(params["layers"][i]) for i in stacked_layers(model_cfg)) / param_count(params)


class Activations(NamedTuple):
    """Bytes one device holds for the backward pass of one micro-batch (:func:`activation_bytes`)."""

    kept: int
    """Kept through the whole backward: with ``model.remat`` every layer's input (and with
    ``save_dots`` its projections' outputs), without it every layer's tensors."""
    layer: int
    """One layer recomputed in full (``model.remat``; 0 without: it is in ``kept``)."""
    head: int
    """The lm head's backward: the window's hidden states and one chunk's logits and cotangent."""
    kernel: str = "xla"
    """The attention kernel counted (:func:`planned_kernel`)."""

    @property
    def peak(self) -> int:
        """``kept`` plus the larger of ``layer`` and ``head``: the head's backward ends before the
        first layer's recompute starts, so XLA lays both in the same memory."""
        return self.kept + max(self.layer, self.head)


def activation_bytes(model_cfg: Any, rows: int, length: int, window: int, tensor: int, chunk: Optional[int],
                     backend: str = "cpu", fsdp: int = 1, lora: Any = None, segments: int = 0) -> Activations:
    """What one device holds for the backward pass of one micro-batch of ``rows`` rows (its own
    share) and ``length`` positions, of which ``window`` go through the lm head, as compiled for
    ``backend`` (``cpu``, ``gpu``, ``tpu``).

    A layer keeps, per token, what autodiff keeps of a pre-norm decoder layer in the compute
    dtype (the input, two normed copies and the residual, q/k/v before and after rope, the
    attention output, the MLP's gate, up, its activation and their product), two float32 copies
    for the RMSNorms (with Gemma 3's ``sandwich_norms`` twice the normed and float32 copies), and
    the attention's scores over ``length`` (:func:`attention_score_bytes`); heads and the MLP width
    split over ``tensor``. With ``model.remat`` each layer keeps only its input (``remat_policy:
    save_dots``: also its projections' outputs, q/k/v, gate/up and one of o and down) and one layer
    at a time is recomputed in full. The head: the hidden states of the window and the logits and their
    cotangent over ``chunk`` positions at a time (``window`` when unchunked; :func:`head_logit_bytes`),
    vocabulary split over ``tensor``. With ``fsdp`` > 1 the head runs vocabulary-parallel
    (:func:`asyncrl.model.sharding.vocab_parallel_head`): each device computes the logits of all
    ``rows x fsdp`` rows of its group over its ``vocab / (fsdp x tensor)`` slice, and holds that
    slice of the head's weight and of its gradient in the compute dtype (read from XLA's program
    for a v6e-8); a vocabulary that does not divide keeps the parameter layout, where every device
    computes float32 partial logits of all ``rows x fsdp`` rows, reduce-scattered to its own (read
    from XLA's buffer assignment for 8 H100s). ``lora``: the ``model.lora`` section, whose
    adapters' matmuls ``save_dots`` keeps too (:func:`saved_lora_dots_bytes`)."""
    c = DTYPE_BYTES[model_cfg.compute_dtype]
    h, d = model_cfg.hidden_size, model_cfg.head_dim
    heads = max(model_cfg.num_heads // tensor, 1)
    kv_heads = max(model_cfg.num_kv_heads // tensor, 1)
    norm_pairs = 2 if model_cfg.sandwich_norms else 1  # Gemma 3 also norms the attention and MLP outputs
    per_token = ((2 + 2 * norm_pairs) * h + 3 * heads * d + 4 * kv_heads * d) * c + mlp_activation_bytes(model_cfg, tensor)
    per_token += norm_pairs * NORM_FLOAT32_COPIES * h * 4
    kernel = planned_kernel(model_cfg, backend, packed=segments > 0)
    per_token += attention_kept_bytes(kernel, heads, length, c, backend, segments)
    one_layer = rows * length * per_token
    positions = window if chunk is None else min(chunk, window)
    vocab = model_cfg.vocab_size // tensor if model_cfg.vocab_size % tensor == 0 else model_cfg.vocab_size
    head = rows * window * h * c + rows * positions * vocab * head_logit_bytes(c, backend)
    from asyncrl.model.sharding import head_vocab_shards  # the trainer's own rule (imports jax: here, not at the top)

    shards = head_vocab_shards({"fsdp": fsdp, "tensor": tensor}, model_cfg.vocab_size)
    if fsdp > 1 and shards > 1:  # vocabulary-parallel: the logits above, and the head's slice and its gradient
        head += 2 * model_cfg.vocab_size // shards * h * c
    elif fsdp > 1:
        head += fsdp * rows * positions * vocab * 4
    if not model_cfg.remat:
        return Activations(model_cfg.num_layers * one_layer, 0, head, kernel)
    kept = h * c
    if model_cfg.remat_policy == "save_dots":
        # q, k, v and the MLP's dots; of o's and down's outputs one: with the layer's input they give the
        # next layer's input, which the scan keeps (read from the train steps compiled for an H100 and a
        # v6e-8 at 1k-32k tokens: one hidden-sized tensor per layer and token fewer than all seven).
        kept += (heads * d + 2 * kv_heads * d) * c + saved_mlp_dots_bytes(model_cfg, tensor)
        kept += saved_lora_dots_bytes(model_cfg, tensor, lora)
    return Activations(model_cfg.num_layers * rows * length * kept, one_layer, head, kernel)


def saved_lora_dots_bytes(model_cfg: Any, tensor: int, lora: Any) -> int:
    """Bytes per token and layer ``remat_policy: save_dots`` keeps of LoRA's adapters (``lora``: the
    ``model.lora`` section; 0 without): each targeted projection adds two matmuls beside the frozen
    one, ``x A`` (``rank`` wide) and ``(x A) B`` (the projection's output width), and the policy
    saves both, so a layer with adapters on all seven projections keeps twice the base model's
    projection outputs (read from XLA's buffer assignment of the Gemma 3 1B recipe compiled for an
    L4: 997.5 MiB per layer of a 16 x 896-token micro-batch where the base model's count is 514.5)."""
    if lora is None:
        return 0
    c = DTYPE_BYTES[model_cfg.compute_dtype]
    heads, kv_heads = max(model_cfg.num_heads // tensor, 1), max(model_cfg.num_kv_heads // tensor, 1)
    d, h, inter = model_cfg.head_dim, model_cfg.hidden_size, model_cfg.intermediate_size // tensor
    width = {"q_proj": heads * d, "k_proj": kv_heads * d, "v_proj": kv_heads * d, "o_proj": h, "gate_proj": inter,
             "up_proj": inter, "down_proj": h}
    return sum((lora.rank + width[module]) * c for module in lora.target_modules)


def saved_mlp_dots_bytes(model_cfg: Any, tensor: int) -> int:
    """Bytes per token ``remat_policy: save_dots`` keeps of the feed-forward blocks, averaged over
    the layers: a dense MLP's gate, up and down outputs; a mixture-of-experts block's float32
    router logits (its experts' grouped matmuls are not dots the policy saves)."""
    c = DTYPE_BYTES[model_cfg.compute_dtype]
    dense = (2 * (model_cfg.intermediate_size // tensor) + model_cfg.hidden_size) * c
    experts = getattr(model_cfg, "num_experts", 0)
    if not experts:
        return dense
    moe_layers = sum(model_cfg.is_moe_layer(i) for i in range(model_cfg.num_layers))
    return (moe_layers * experts * 4 + (model_cfg.num_layers - moe_layers) * dense) // model_cfg.num_layers


def mlp_activation_bytes(model_cfg: Any, tensor: int) -> int:
    """Bytes per token the feed-forward blocks keep for the backward pass, averaged over the layers:
    a dense MLP its gate, up, activation and product (``4 x intermediate``); a mixture-of-experts
    block (asyncrl/model/moe.py) the same per routed expert at ``moe_intermediate_size``, plus the
    token's ``k`` gathered input copies and weighted outputs and the float32 router logits and
    probabilities. Widths split over ``tensor``."""
    c = DTYPE_BYTES[model_cfg.compute_dtype]
    dense = 4 * (model_cfg.intermediate_size // tensor) * c
    experts = getattr(model_cfg, "num_experts", 0)
    if not experts:
        return dense
    k, h = model_cfg.num_experts_per_tok, model_cfg.hidden_size
    sparse = k * (4 * (model_cfg.moe_intermediate_size // tensor) + 2 * h) * c + 2 * experts * 4
    layers = model_cfg.num_layers
    n_sparse = sum(1 for i in range(layers) if model_cfg.is_moe_layer(i))
    return (n_sparse * sparse + (layers - n_sparse) * dense) // layers
