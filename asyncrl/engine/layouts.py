"""How the engine's arrays lie in each platform's memory, chosen in one place.

* The KV page pool (:func:`kv_page_layout`) and its page size (:func:`page_size_for`): ``2kpsd``
  (``[2, kv_heads, pages, page_size, head_dim]``) on GPUs and the CPU, ``ps2kd`` (``[pages,
  page_size, 2 * kv_heads, head_dim]``, each head's key and value interleaved) on TPUs; pages of
  16 positions on GPUs and the CPU, 64 on TPUs. The model's paged cache takes either
  (:mod:`asyncrl.model.kv_cache`); the engine picks.
* A beam search's own contiguous cache (:func:`kv_cache_layout`): ``bksd`` on GPUs and the CPU,
  ``bskd`` on TPUs.
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

PAGE_SIZES = {"cpu": 16, "gpu": 16, "rocm": 16, "tpu": 64}
"""``engine.page_size: auto`` per platform: 16 positions (vLLM's and SGLang's block on GPUs; on the
CPU the flat attention's gather works in pages, and small pages waste least of a sequence's last
one); 64 on TPUs, where ``ragged_paged_attention`` walks a sequence's pages from scalar registers
(its tuning table keeps a sequence to a few dozen pages: 16 of 64 for 1,024 positions)."""


def kv_page_layout(platform: str) -> str:
    """The KV page pool's layout for the devices of ``platform`` (``cpu``, ``gpu``, ``tpu``): one
    rule. ``ps2kd`` on TPUs: the layout of JAX's ``ragged_paged_attention`` (a page's positions,
    then each head's key and value side by side, so one DMA brings a page for every head).
    ``2kpsd`` elsewhere: a head's page is one contiguous ``[page_size, head_dim]`` block, what the GPU
    decode kernel (:mod:`asyncrl.model.decode_attention`) and XLA's CPU dot read."""
    return "ps2kd" if platform == "tpu" else "2kpsd"


def page_size_for(choice: "int | str", platform: str, capacity: int) -> int:
    """``engine.page_size`` on ``platform``: a number as given (it must divide ``capacity``, which
    the config checks); ``auto``: :data:`PAGE_SIZES`' size for the platform, halved until it divides
    ``engine.kv_capacity`` (so every config runs on every platform)."""
    if isinstance(choice, int):
        if capacity % choice:
            raise ValueError(f"engine.page_size = {choice} does not divide engine.kv_capacity = {capacity}")
        return choice
    size = PAGE_SIZES.get(platform, 16)
    while capacity % size:
        size //= 2
    return size


def kv_cache_layout(platform: str) -> str:
    """The layout of a beam search's own contiguous KV cache on ``platform``. ``bskd`` on TPUs:
    XLA's TPU decode loop lays a layer's cache out with the positions before the heads (each step
    writes one ``[kv_heads, head_dim]`` tile per row), and given a heads-first cache it copies the
    whole cache in and out of the loop. ``bksd`` elsewhere: XLA's CPU dot reads each head's keys as
    one contiguous ``[capacity, head_dim]`` matrix."""
    return "bskd" if platform == "tpu" else "bksd"


def serving_formats(cfg: Any, shardings: Any, pool_shardings: Any, *, slots: int, pages: int, page_size: int,
                    capacity: int, platform: str, decode: dict[str, Any], max_stop_ids: int,
                    layout: Any = None) -> Optional[Any]:
    """The memory layouts XLA's decode program wants for the serving copy (a pytree of
    ``jax.experimental.layout.Format`` shaped like ``shardings``), or None where they are
    row-major (every platform but TPUs). ``cfg``: the model's DecoderConfig; ``shardings``: the serving
    copy's; ``pool_shardings``: the page pool's (a pool-shaped tree of shardings, or one sharding for
    all of it); ``pages``: the pool's pages (every replica's); ``decode``: the decode program's
    static options (sampler, steps per iteration, kernel target); ``layout``: the pool's layout on
    an engine mesh (the programs' static argument), or None."""
    if platform != "tpu":
        return None
    import numpy as np
    from flax import nnx
    from jax.experimental.layout import Format, Layout

    from asyncrl.engine.jax_programs import _decode_chunk, idle_controls, init_pool
    from asyncrl.model.compute_copy import cast_for_compute
    from asyncrl.model.transformer import Decoder, split_params

    kinds, proxy_layers = _layer_kinds(cfg)
    proxy_cfg = cfg.replace(num_layers=proxy_layers, **(
        {"layer_types": cfg.layer_types[:proxy_layers]} if cfg.layer_types is not None else {}))
    proxy_graphdef, proxy_shapes = split_params(nnx.eval_shape(lambda: Decoder(proxy_cfg, nnx.Rngs(0))))
    proxy_shardings = _for_proxy(shardings, proxy_shapes)
    pool_shapes = jax.eval_shape(lambda: init_pool(proxy_cfg, pages, page_size, kv_page_layout(platform)))
    proxy_pool = _proxy_pool(pool_shardings, pool_shapes, proxy_layers)
    proxy_layout = None if layout is None else _proxy_pool(layout, pool_shapes, proxy_layers)
    controls = idle_controls(slots, max_stop_ids, capacity // page_size, pages)
    first = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))[0]
    replicated = (jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
                  if isinstance(first, jax.sharding.NamedSharding) else first)
    control_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=replicated),
                                  controls)
    key_shape = jax.ShapeDtypeStruct((2,), np.uint32, sharding=replicated)
    placed = lambda shapes, where: jax.tree.map(  # noqa: E731
        lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w), shapes, where)
    serving_shapes = jax.eval_shape(lambda p: cast_for_compute(p, cfg.compute_dtype), proxy_shapes)

    def decode_chunk(params: Any, pool: Any, controls: Any, key: Any) -> Any:
        return _decode_chunk(proxy_graphdef, params, pool, controls, None, key, 1, False, proxy_layout, **decode)

    auto = jax.tree.map(lambda s: Format(Layout.AUTO, s), proxy_shardings)
    compiled = jax.jit(decode_chunk, in_shardings=(auto, proxy_pool, jax.tree.map(lambda _: replicated, controls), replicated),
                       donate_argnums=1).lower(placed(serving_shapes, proxy_shardings), placed(pool_shapes, proxy_pool),
                                               control_shapes, key_shape).compile()
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


def _proxy_pool(pool_shardings: Any, pool_shapes: Any, layers: int) -> Any:
    """The pool's shardings for the proxy's ``layers`` layers (every layer's pool lies alike)."""
    if isinstance(pool_shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda _: pool_shardings, pool_shapes)
    return tuple(pool_shardings[:layers])
