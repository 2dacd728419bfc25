"""The one way asyncrl walks, flattens, fills and copies pytrees to the host.

Every array tree that leaves the device (checkpoints, exports, metrics, the trainer's
state) goes through this module, so there is one key spelling and one host conversion:

* :func:`keyed_leaves` / :func:`flatten`: ``{"layers/0/mlp/kernel": leaf}``, the path's keys
  joined by ``/``. Dicts (str or int keys), lists, tuples and namedtuples are walked here;
  any other pytree node (optax states, ``nnx.State``) through ``jax.tree_util``, with the
  same spelling (dict key, sequence index, attribute name). ``None`` is an empty subtree.
* :func:`fill`: a template tree (the live params, the optimizer state) with its leaves
  taken from such a flat mapping, checked key by key: what is missing, extra, or of another
  shape or dtype is reported all at once, by key. Nothing is rebuilt from key strings: the
  structure is always the template's.
* :func:`to_host` / :func:`tree_to_host`: a full numpy copy on this host, gathering arrays
  sharded over several processes.
* :func:`dotted_name`: the ``.``-joined name of a ``jax.tree_util`` path that regex rules
  (partition rules, ``optim.no_decay``) match.

Imports numpy only; jax is imported when a tree holds a node or leaf only jax knows.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import numpy as np

SEPARATOR = "/"


class TreeError(ValueError):
    """A tree that cannot be flattened, or a flat mapping that does not fit its template;
    ``problems`` lists every finding (one line each, naming the key)."""

    def __init__(self, where: str, problems: list[str]):
        self.where = where
        self.problems = problems
        super().__init__(f"{where}: {'; '.join(problems)}")


# --------------------------------------------------------------------------- walking


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def is_array_leaf(x: Any) -> bool:
    """numpy/jax arrays, numpy scalars and Python numbers (not ``jax.ShapeDtypeStruct``)."""
    return isinstance(x, (np.ndarray, np.generic, bool, int, float)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "__array__")
    )


def _is_abstract(x: Any) -> bool:
    return type(x).__name__ == "ShapeDtypeStruct" and hasattr(x, "shape") and hasattr(x, "dtype")


def _jax_key(entry: Any) -> Any:
    for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return str(entry)


_UNSTORABLE: list = []
"""What :func:`_children` returns for a value that is neither a container nor an array leaf."""


def _children(tree: Any) -> Optional[list[tuple[Any, Any]]]:
    """``[(path from the node, child)]`` of a container node in a stable order; None for an array leaf,
    :data:`_UNSTORABLE` for anything else (a str, an object)."""
    if isinstance(tree, dict):
        return [((key,), tree[key]) for key in sorted(tree, key=lambda k: (str(type(k)), k))]
    if _is_namedtuple(tree):
        return [((name,), getattr(tree, name)) for name in type(tree)._fields]
    if isinstance(tree, (list, tuple)):
        return [((i,), item) for i, item in enumerate(tree)]
    if is_array_leaf(tree) or _is_abstract(tree):
        return None
    import jax  # a registered pytree node of some library (optax, flax)

    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree and _is_abstract(x))
    if len(leaves) == 1 and leaves[0][1] is tree:
        return _UNSTORABLE
    # Multi-entry paths (a node that flattens several levels at once) become one key each.
    return [(tuple(_jax_key(e) for e in path), leaf) for path, leaf in leaves]


def dotted_name(jax_path: Any) -> str:
    """``layers.0.self_attn.q_proj.kernel`` from a ``jax.tree_util`` key path: the name that
    regex rules (partition rules, ``optim.no_decay``) match against."""
    return ".".join(str(_jax_key(entry)) for entry in jax_path)


def key_of(path: tuple, where: str = "tree") -> str:
    """The flat key of a path of dict keys / indices / attribute names (``"layers/0/w"``)."""
    parts: list[str] = []
    for part in path:
        text = str(part)
        if not isinstance(part, (str, int, np.integer)) or SEPARATOR in text or text == "":
            raise TreeError(where, [
                f"key {part!r} at {SEPARATOR.join(parts) or 'the root'!r} cannot be stored "
                f"(keys are non-empty str or int without {SEPARATOR!r})"
            ])
        parts.append(text)
    return SEPARATOR.join(parts)


def leaves_with_path(tree: Any, where: str = "tree") -> list[tuple[tuple, Any]]:
    """``[(path, leaf)]`` in a stable order (dict keys sorted)."""
    out: list[tuple[tuple, Any]] = []

    def walk(node: Any, prefix: tuple) -> None:
        if node is None:
            return
        children = _children(node)
        if children is _UNSTORABLE:
            at = key_of(prefix, where) if prefix else "the root"
            raise TreeError(where, [f"cannot store a {type(node).__name__} at {at!r}: leaves must be arrays or numbers"])
        if children is None:
            out.append((prefix, node))
            return
        for path, child in children:
            walk(child, prefix + path)

    walk(tree, ())
    return out


def keyed_leaves(tree: Any, where: str = "tree") -> dict[str, Any]:
    """``{key: leaf}`` of ``tree`` without copying anything; two leaves with one key are refused."""
    out: dict[str, Any] = {}
    for path, leaf in leaves_with_path(tree, where):
        key = key_of(path, where)
        if key in out:
            raise TreeError(where, [f"two leaves have the key {key!r} (dict keys 1 and '1'?)"])
        out[key] = leaf
    return out


def flatten(tree: Any, where: str = "tree") -> dict[str, np.ndarray]:
    """``{key: C-contiguous numpy array}``: :func:`keyed_leaves` copied to this host."""
    flat = {}
    for key, leaf in keyed_leaves(tree, where).items():
        if not is_array_leaf(leaf):  # a jax.ShapeDtypeStruct: a template, not data
            raise TreeError(where, [f"{key!r} is a {type(leaf).__name__}, not an array"])
        array = to_host(leaf)
        if array.dtype == object:
            raise TreeError(where, [f"{key!r}: object arrays cannot be stored without pickle"])
        # Raw-memory writers (safetensors) would store a strided view as garbage. (Not
        # np.ascontiguousarray: it turns 0-d arrays into shape (1,).)
        flat[key] = array if array.flags.c_contiguous else array.copy(order="C")
    return flat


# --------------------------------------------------------------------------- host copies


def to_host(x: Any) -> np.ndarray:
    """A full numpy array of ``x`` on this host: numpy and Python values as they are, a
    ``jax.Array`` copied (gathered from every process when it spans several; every process
    must call this then)."""
    if isinstance(x, (np.ndarray, np.generic, bool, int, float)):
        return np.asarray(x)
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    if getattr(x, "is_fully_replicated", False):
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def tree_to_host(tree: Any) -> Any:
    """``tree`` (same structure) with every array leaf replaced by :func:`to_host`; one transfer
    for the whole tree when this process holds all of it (a leaf at a time would wait on the
    device once per leaf)."""
    import jax

    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
        return jax.tree.map(np.asarray, jax.device_get(tree))
    return jax.tree.map(to_host, tree)


def place_like(template_leaf: Any, value: Any) -> Any:
    """``value`` as the template's leaf is: a Python scalar of its type, numpy, or a
    ``jax.Array`` on the template's sharding (built per shard when it spans processes)."""
    if isinstance(template_leaf, bool):
        return bool(np.asarray(value).item())
    if isinstance(template_leaf, int):
        return int(np.asarray(value).item())
    if isinstance(template_leaf, float):
        return float(np.asarray(value).item())
    if isinstance(template_leaf, np.generic):
        return np.asarray(value)[()]
    if isinstance(template_leaf, np.ndarray):
        return np.asarray(value)
    import jax

    sharding = getattr(template_leaf, "sharding", None)
    if sharding is None:
        return jax.numpy.asarray(value)
    if isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding, value.ndim):
        # already placed (a checkpoint restored shard by shard onto this sharding, or one spelled
        # differently: P() and P(None, None) are one layout); never gathered to the host again
        return value
    if jax.process_count() == 1 or sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = to_host(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


# --------------------------------------------------------------------------- filling templates


def _shape_dtype(leaf: Any) -> tuple[Optional[tuple], Optional[np.dtype]]:
    if isinstance(leaf, (bool, int, float)):
        return (), None  # Python scalars: any numeric dtype converts
    return tuple(leaf.shape), np.dtype(leaf.dtype)


def mismatches(template: Any, flat: Mapping[str, Any], where: str = "tree") -> list[str]:
    """Every way ``flat`` does not fit ``template``: missing and extra keys, other shapes and
    dtypes (one line each, sorted by key). Copies nothing."""
    want = {key: _shape_dtype(leaf) for key, leaf in keyed_leaves(template, where).items()}
    problems = []
    for key in sorted(set(want) | set(flat)):
        if key not in flat:
            problems.append(f"field {key!r}: missing (the template has it)")
        elif key not in want:
            problems.append(f"field {key!r}: not in the template")
        else:
            shape, dtype = want[key]
            value = flat[key]
            if tuple(np.shape(value)) != shape:
                problems.append(f"field {key!r}: shape {tuple(np.shape(value))}, the template has {shape}")
            elif dtype is not None and np.dtype(value.dtype) != dtype:
                problems.append(f"field {key!r}: dtype {np.dtype(value.dtype)}, the template has {dtype}")
    return problems


def fill(template: Any, flat: Mapping[str, Any], where: str = "tree") -> Any:
    """``template``'s tree with each leaf taken from ``flat[key]`` and placed like the
    template's leaf (:func:`place_like`); a ``jax.ShapeDtypeStruct`` leaf becomes a
    ``jax.Array``. Raises :class:`TreeError` listing every mismatch before placing anything."""
    problems = mismatches(template, flat, where)
    if problems:
        raise TreeError(where, problems)
    return map_with_path(template, lambda path, leaf: place_like(leaf, flat[key_of(path, where)]), where)


def map_with_path(tree: Any, fn: Callable[[tuple, Any], Any], where: str = "tree") -> Any:
    """``tree`` with each leaf replaced by ``fn(path, leaf)`` (paths as :func:`leaves_with_path`)."""

    def walk(node: Any, prefix: tuple) -> Any:
        if node is None:
            return None
        if isinstance(node, dict):
            items = [(key, walk(value, prefix + (key,))) for key, value in node.items()]
            return dict(items) if type(node) is dict else type(node)(items)
        if _is_namedtuple(node):
            return type(node)(*(walk(getattr(node, n), prefix + (n,)) for n in type(node)._fields))
        if isinstance(node, (list, tuple)):
            return type(node)(walk(item, prefix + (i,)) for i, item in enumerate(node))
        if is_array_leaf(node) or _is_abstract(node):
            return fn(prefix, node)
        import jax

        leaves, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node and _is_abstract(x))
        if len(leaves) == 1 and leaves[0][1] is node:
            raise TreeError(where, [f"cannot fill a {type(node).__name__} at {key_of(prefix, where) or 'the root'!r}"])
        new = [walk(leaf, prefix + tuple(_jax_key(e) for e in path)) for path, leaf in leaves]
        return jax.tree_util.tree_unflatten(treedef, new)

    return walk(tree, ())
