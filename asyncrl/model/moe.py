"""The sparse mixture-of-experts feed-forward block of Qwen3-MoE (``model_type: qwen3_moe``).

A layer ``i`` with ``cfg.is_moe_layer(i)`` has :class:`SparseMoeBlock` as its ``mlp``:

* the router (``mlp.gate``, a bias-free linear ``[hidden, experts]``) gives logits, which are
  computed **in float32** whatever the compute dtype; the softmax, top-k and
  ``norm_topk_prob`` renormalisation (transformers' ``Qwen3MoeTopKRouter``) run in float32 too
  (:func:`route`). The engine and the trainer call this same forward, so for the same tokens and
  weights they choose the same experts by construction (tests/model/test_moe.py checks it,
  including a forced near-tie that a bfloat16 router would break);
* each token goes to its ``num_experts_per_tok`` experts, whose SwiGLU outputs are summed with
  the routing weights. The experts are one stacked parameter per projection
  (``experts.gate_proj``/``up_proj`` ``[experts, hidden, moe_intermediate]``, ``down_proj``
  ``[experts, moe_intermediate, hidden]``) and run as grouped matmuls
  (:func:`experts_grouped`: tokens sorted by expert, ``jax.lax.ragged_dot``). Nothing is
  dropped: there is no capacity factor, every routed token is computed.
  :func:`experts_dense` is the all-experts einsum reference the tests compare it with.

The router logits of every MoE layer are sown as ``nnx.Intermediate`` (``router_logits``,
float32 ``[tokens, experts]``) when the forward runs under ``nnx.capture``
(:func:`hidden_states_with_router`, what the trainer's load-balancing loss and routing
statistics use); other callers (the engine, plain log-probs) sow nothing, and the log-prob
contract is unchanged.

Checkpoints: transformers writes each expert's projections as its own tensor
(``model.layers.{l}.mlp.experts.{e}.gate_proj.weight [moe_intermediate, hidden]``);
:func:`stack_expert_tensors` / :func:`unstack_expert_tensors` translate between those and the
stacked parameters on load and export.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncrl.model.blocks import dtype_of, linear
from asyncrl.model.config import DecoderConfig

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_router_weight(path: tuple) -> bool:
    """Whether a parameter path (``jax.tree_util`` keys, e.g. ``layers/0/mlp/gate/kernel``) is a
    router's: the one weight the decoder reads in float32 whatever the compute dtype, so a copy
    of the weights in the compute dtype (the engine's serving copy) must keep it as it is."""
    names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    return len(names) >= 3 and names[-3:] == ["mlp", "gate", "kernel"]


# --------------------------------------------------------------------------- pure functions


def route(router_logits: jax.Array, top_k: int, normalise: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k routing of ``router_logits`` ``[tokens, experts]``: ``(weights float32 [tokens, k],
    experts int32 [tokens, k])``. Softmax over all experts in float32, the k largest
    probabilities (ties to the lower expert index, as ``torch.topk``), renormalised to sum to 1
    when ``normalise`` (``norm_topk_prob``)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [tokens, experts]
    weights, experts = jax.lax.top_k(probs, top_k)  # [tokens, k]
    if normalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def experts_grouped(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                    down: jax.Array) -> jax.Array:
    """The routed SwiGLU experts of tokens ``x [tokens, hidden]`` as grouped matmuls.

    ``experts``/``weights`` ``[tokens, k]`` from :func:`route`; ``gate, up [E, hidden, I]``,
    ``down [E, I, hidden]``. The ``tokens * k`` (token, expert) pairs are sorted by expert so each
    expert's rows are contiguous, and ``jax.lax.ragged_dot`` multiplies each group by its expert's
    matrix: only the routed pairs are computed (``k/E`` of the dense work). Returns ``[tokens, hidden]``
    in ``x``'s dtype."""
    tokens, k = experts.shape
    num_experts = gate.shape[0]
    flat_experts = experts.reshape(-1)  # [tokens * k]
    order = jnp.argsort(flat_experts, stable=True)  # pairs grouped by expert
    token_of_pair = order // k  # [tokens * k]
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)  # [E]
    xs = x[token_of_pair]  # [tokens * k, hidden]
    hidden = jax.nn.silu(jax.lax.ragged_dot(xs, gate.astype(x.dtype), group_sizes)) * jax.lax.ragged_dot(
        xs, up.astype(x.dtype), group_sizes)  # [tokens * k, I]
    out = jax.lax.ragged_dot(hidden, down.astype(x.dtype), group_sizes)  # [tokens * k, hidden]
    out = out * weights.reshape(-1)[order][:, None].astype(x.dtype)
    return jnp.zeros_like(x).at[token_of_pair].add(out)


def experts_dense(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array) -> jax.Array:
    """Reference for :func:`experts_grouped`: every expert on every token (einsum), combined with
    the routing weights scattered to ``[tokens, E]`` (zero for unrouted experts)."""
    num_experts = gate.shape[0]
    dtype = x.dtype
    hidden = jax.nn.silu(jnp.einsum("nh,ehi->eni", x, gate.astype(dtype))) * jnp.einsum("nh,ehi->eni", x, up.astype(dtype))
    out = jnp.einsum("eni,eih->enh", hidden, down.astype(dtype))  # [E, tokens, hidden]
    combine = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32) * weights[..., None], axis=1)  # [tokens, E]
    return jnp.einsum("ne,enh->nh", combine.astype(dtype), out)


def load_balancing_loss(router_logits: list[jax.Array], top_k: int, mask: jax.Array) -> jax.Array:
    """The Switch-Transformer load-balancing loss as transformers' ``load_balancing_loss_func``:
    ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of top-k assignments that go to expert ``e``
    (per real token, so it sums to k) and ``P_e`` its mean router probability, both pooled over
    the MoE layers and the real tokens. ``router_logits``: one float32 ``[tokens, E]`` per MoE
    layer; ``mask`` bool ``[tokens]`` the real tokens. float32 scalar; 1.0·k when perfectly balanced."""
    num_experts = router_logits[0].shape[-1]
    weight = mask.astype(jnp.float32)  # [tokens]
    counts = jnp.zeros((num_experts,), jnp.float32)
    prob_sum = jnp.zeros((num_experts,), jnp.float32)
    for logits in router_logits:
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [tokens, E]
        _, chosen = jax.lax.top_k(probs, top_k)  # [tokens, k]
        counts = counts + jnp.sum(jax.nn.one_hot(chosen, num_experts) * weight[:, None, None], axis=(0, 1))
        prob_sum = prob_sum + jnp.sum(probs * weight[:, None], axis=0)
    rows = jnp.maximum(jnp.sum(weight) * len(router_logits), 1.0)
    return num_experts * jnp.sum((counts / rows) * (prob_sum / rows))


def expert_load_max(router_logits: list[jax.Array], top_k: int, mask: jax.Array) -> jax.Array:
    """The most loaded expert's share of its layer's assignments relative to a uniform share
    (``k/E`` of the real tokens each), maximised over MoE layers: 1.0 is perfect balance, ``E/k``
    every token on the same experts. float32 scalar."""
    num_experts = router_logits[0].shape[-1]
    weight = mask.astype(jnp.float32)
    uniform = jnp.maximum(jnp.sum(weight) * top_k / num_experts, 1e-9)
    loads = []
    for logits in router_logits:
        _, chosen = jax.lax.top_k(logits.astype(jnp.float32), top_k)  # softmax is monotone: same top-k
        counts = jnp.sum(jax.nn.one_hot(chosen, num_experts) * weight[:, None, None], axis=(0, 1))  # [E]
        loads.append(jnp.max(counts) / uniform)
    return jnp.max(jnp.stack(loads))


# --------------------------------------------------------------------------- modules


class Experts(nnx.Module):
    """The stacked expert weights of one MoE layer (``[experts, in, out]``, as ``nnx.Linear``'s kernels)."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):

        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = nnx.initializers.normal(stddev=cfg.initializer_range)
        dtype = dtype_of(cfg.param_dtype)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, h, i), dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, h, i), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, i, h), dtype))


class SparseMoeBlock(nnx.Module):
    """Router + routed experts (module docstring); replaces the MLP of a sparse layer."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):

        self.cfg = cfg
        self.gate = linear(cfg, cfg.hidden_size, cfg.num_experts, False, rngs)  # the router (HF name)
        self.experts = Experts(cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])  # [tokens, hidden]
        # float32 router: the routing decision must not depend on the compute dtype
        router_logits = jnp.dot(flat.astype(jnp.float32), self.gate.kernel[...].astype(jnp.float32))  # [tokens, E]
        if hasattr(self, "__captures__"):  # only under nnx.capture (hidden_states_with_router): no state otherwise
            self.sow(nnx.Intermediate, "router_logits", router_logits)
        weights, experts = route(router_logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        e = self.experts
        out = experts_grouped(flat, experts, weights, e.gate_proj[...], e.up_proj[...], e.down_proj[...])
        return out.reshape(*lead, -1)


def hidden_states_with_router(model: nnx.Module, input_ids: jax.Array, positions: Any = None,
                              attention_mask: Any = None, segment_ids: Any = None) -> tuple[jax.Array, list[jax.Array]]:
    """``model.hidden_states`` (no cache) under ``nnx.capture``: the final hidden states and the
    router logits of every MoE layer, float32 ``[tokens, E]`` each, in layer order (empty for a
    dense model)."""
    # Unrolled: what a layer sows inside scanned_layers' lax.scan body would not reach the capture.
    capture = nnx.capture(
        lambda m: m.hidden_states(input_ids, positions, attention_mask, segment_ids=segment_ids, unrolled=True)[0],
        nnx.Intermediate)
    hidden, state = capture(model)
    found = []
    for path, value in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        if "router_logits" in keys:  # layers/<i>/mlp/router_logits/<0>
            found.append((int(keys[keys.index("layers") + 1]), value))
    return hidden, [value for _, value in sorted(found, key=lambda item: item[0])]


# --------------------------------------------------------------------------- checkpoints

_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")


def stacked_name(layer: int, projection: str) -> str:
    """The HF-style name :func:`asyncrl.model.hf.param_layout` gives a stacked expert parameter."""
    return f"model.layers.{layer}.mlp.experts.{projection}"


def stack_expert_tensors(cfg: DecoderConfig, tensors: dict[str, Any]) -> dict[str, Any]:
    """HF tensors with every complete set of per-expert ``[out, in]`` weights of a layer and
    projection replaced by one stacked ``[experts, in, out]`` array under :func:`stacked_name`
    (numpy, on the host). Incomplete sets stay as they are (the loader then names them)."""
    groups: dict[tuple[int, str], dict[int, str]] = {}
    for name in tensors:
        match = _HF_EXPERT.match(name)
        if match:
            groups.setdefault((int(match[1]), match[3]), {})[int(match[2])] = name
    out = dict(tensors)
    for (layer, projection), names in groups.items():
        if sorted(names) != list(range(cfg.num_experts)):
            continue
        out[stacked_name(layer, projection)] = np.stack(
            [np.asarray(tensors[names[e]]).T for e in range(cfg.num_experts)])
        for name in names.values():
            del out[name]
    return out


def unstack_expert_tensors(cfg: DecoderConfig, tensors: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`stack_expert_tensors` for export: per-expert ``[out, in]`` weights, the
    names transformers writes and reads."""
    out = {}
    for name, value in tensors.items():
        match = _STACKED_EXPERTS.match(name)
        if match is None:
            out[name] = value
            continue
        for e in range(cfg.num_experts):
            out[f"model.layers.{match[1]}.mlp.experts.{e}.{match[2]}.weight"] = value[e].T
    return out
