"""How the engine's arrays lie in each platform's memory, chosen in one place.

* The KV cache (:func:`kv_cache_layout`): ``bksd`` (``[slots, kv_heads, capacity, head_dim]``) on
  GPUs and the CPU, ``bskd`` (``[slots, capacity, kv_heads, head_dim]``) on TPUs. The model's cache
  functions take either (:mod:`asyncrl.model.transformer`); the engine picks.
* The serving copy's memory layouts (:func:`serving_formats`): on TPUs, XLA's decode program
  reads some weights in another order than row-major (the attention's q/k/v kernels with the input
  dimension minor), and given row-major ones it copies each of them once per chunk, before its
  loop: about 0.4 GiB of temporaries for Qwen3-1.7B on a v6e chip. The engine asks XLA which
  layout its decode program wants (``Layout.AUTO``, compiled on a proxy of the model with one
  layer of each kind, a few seconds) and makes its serving copy in those layouts, which every
  engine program then compiles for (``jax.jit`` follows a committed argument's layout). GPUs and
  the CPU want row-major weights (checked on an H100 target): nothing to do there.
"""

from __future__ import annotations

from typing import Any, Optional

import jax


def kv_cache_layout(platform: str) -> str:
    """The KV cache's layout for the devices of ``platform`` (``cpu``, ``gpu``, ``tpu``). ``bskd`` on
    TPUs: XLA's TPU decode loop lays a layer's cache out with the positions before the heads (each
    step writes one ``[kv_heads, head_dim]`` tile per row), and given a heads-first cache it copies
    the whole cache in and out of the loop at every chunk (a v6e-8's decode of Qwen3-1.7B held
    14 GiB of such copies). ``bksd`` elsewhere: XLA's CPU dot and the GPU decode kernel
    (:mod:`asyncrl.model.decode_attention`) read each head's keys as one contiguous
    ``[capacity, head_dim]`` matrix."""
    return "bskd" if platform == "tpu" else "bksd"


def serving_formats(cfg: Any, shardings: Any, state_shardings: Any, *, slots: int, capacity: int, platform: str,
                    decode: dict[str, Any], max_stop_ids: int, layout: Any = None) -> Optional[Any]:
    """The memory layouts XLA's decode program wants for the serving copy (a pytree of
    ``jax.experimental.layout.Format`` shaped like ``shardings``), or None where they are
    row-major (every platform but TPUs). ``cfg``: the model's DecoderConfig; ``shardings``: the serving
    copy's; ``state_shardings``: the slot state's (a :class:`~asyncrl.engine.jax_programs.SlotState`
    of shardings, or one sharding for all of it); ``decode``: the decode program's static options
    (sampler, steps per iteration, kernel target); ``layout``: the state's layout on an engine mesh
    (the programs' static argument), or None."""
    if platform != "tpu":
        return None
    import numpy as np
    from flax import nnx
    from jax.experimental.layout import Format, Layout

    from asyncrl.engine.jax_programs import _decode_chunk, idle_controls, init_slot_state
    from asyncrl.model.compute_copy import cast_for_compute
    from asyncrl.model.transformer import Decoder, split_params

    kinds, proxy_layers = _layer_kinds(cfg)
    proxy_cfg = cfg.replace(num_layers=proxy_layers, **(
        {"layer_types": cfg.layer_types[:proxy_layers]} if cfg.layer_types is not None else {}))
    proxy_graphdef, proxy_shapes = split_params(nnx.eval_shape(lambda: Decoder(proxy_cfg, nnx.Rngs(0))))
    proxy_shardings = _for_proxy(shardings, proxy_shapes)
    cache_layout = kv_cache_layout(platform)
    state_shapes = jax.eval_shape(lambda: init_slot_state(proxy_cfg, slots, capacity, cache_layout))
    proxy_state = _proxy_state_shardings(state_shardings, state_shapes, proxy_layers)
    proxy_layout = None if layout is None else _proxy_state_shardings(layout, state_shapes, proxy_layers)
    controls = idle_controls(slots, max_stop_ids)
    first = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))[0]
    replicated = (jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
                  if isinstance(first, jax.sharding.NamedSharding) else first)
    control_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=replicated),
                                  controls)
    placed = lambda shapes, where: jax.tree.map(  # noqa: E731
        lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w), shapes, where)
    serving_shapes = jax.eval_shape(lambda p: cast_for_compute(p, cfg.compute_dtype), proxy_shapes)

    def decode_chunk(params: Any, state: Any, controls: Any) -> Any:
        return _decode_chunk(proxy_graphdef, params, state, controls, 1, False, proxy_layout, **decode)

    auto = jax.tree.map(lambda s: Format(Layout.AUTO, s), proxy_shardings)
    compiled = jax.jit(decode_chunk, in_shardings=(auto, proxy_state, jax.tree.map(lambda _: replicated, controls)),
                       donate_argnums=1).lower(placed(serving_shapes, proxy_shardings), placed(state_shapes, proxy_state),
                                               control_shapes).compile()
    wanted = compiled.input_formats[0][0]
    return _from_proxy(wanted, shardings, kinds)


def _layer_kinds(cfg: Any) -> tuple[list[int], int]:
    """Per layer, the proxy layer standing for it (the first layer of its kind: its attention type;
    every layer of one decoder has the same weights otherwise), and the proxy's layer count."""
    firsts: dict[str, int] = {}
    kinds = []
    for i in range(cfg.num_layers):
        kinds.append(firsts.setdefault(cfg.layer_type(i), i))
    return kinds, max(kinds) + 1


def _for_proxy(tree: Any, proxy_shapes: Any) -> Any:
    """``tree`` (the full model's, by param path) cut down to the proxy's structure: the proxy's
    layer ``j`` takes the full model's layer ``j`` (the first of its kind)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _at(tree, path), proxy_shapes)


def _from_proxy(proxy_tree: Any, full: Any, kinds: list[int]) -> Any:
    """The full model's tree of what the proxy gives per leaf: each layer takes its kind's."""

    def pick(path: tuple, _: Any) -> Any:
        if path and _key(path[0]) == "layers":
            path = (path[0], type(path[1])(kinds[int(_key(path[1]))]), *path[2:])
        return _at(proxy_tree, path)

    return jax.tree_util.tree_map_with_path(pick, full, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))


def _key(entry: Any) -> Any:
    return getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry)))


def _at(tree: Any, path: tuple) -> Any:
    for entry in path:
        tree = tree[_key(entry)]
    return tree


def _proxy_state_shardings(state_shardings: Any, state_shapes: Any, layers: int) -> Any:
    """The slot state's shardings for the proxy's ``layers`` layers (every layer's cache lies alike)."""
    if isinstance(state_shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda _: state_shardings, state_shapes)
    cache = state_shardings.cache
    return state_shardings._replace(cache=cache._replace(layers=cache.layers[:layers]))
