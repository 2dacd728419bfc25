"""The array trees of a checkpoint on Orbax: every process writes its own shards, a restore
reads straight onto the shardings the run has now.

A checkpoint's trees (``params``, ``opt_state``, ``stage_start_params``) are one Orbax
``CompositeCheckpointHandler`` item per tree under ``<step dir>/arrays/<tree>/`` (OCDBT +
tensorstore zarr chunks, metadata in JSON; see docs/checkpoints.md for what Orbax writes).
Trees are keyed as :mod:`asyncrl.pytree` keys them (``layers/0/mlp/kernel``), stored as nested
dicts of those key parts, so a checkpoint is independent of the Python classes that made it
(optax namedtuples, ``nnx.State``): a restore fills a template of the live trees.

Which files a process wrote: Orbax puts process ``i``'s chunks under ``ocdbt.process_<i>/``
and its array metadata in ``array_metadatas/process_<i>``; everything else (``_METADATA``,
``_sharding``, the merged OCDBT manifest, commit markers) is written by process 0.
:func:`files_written_by` lists them so that each process hashes only its own files.

Imports jax and orbax when called, never at import time.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from asyncrl import pytree
from asyncrl.errors import CheckpointError

ARRAYS_DIR = "arrays"
_OWNED = re.compile(r"(^|/)(ocdbt\.process_(\d+)|array_metadatas/process_(\d+))(/|$)")


class SavedArray:
    """Shape and dtype of one saved array, read from Orbax's metadata (no array data read)."""

    def __init__(self, shape: tuple, dtype: Any) -> None:
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)

    def __repr__(self) -> str:
        return f"SavedArray(shape={self.shape}, dtype={self.dtype})"


def _nest(flat: Mapping[str, Any]) -> dict:
    """``{"a/0/b": x}`` -> ``{"a": {"0": {"b": x}}}``: Orbax names arrays by their dict path."""
    nested: dict = {}
    for key, value in flat.items():
        node = nested
        parts = key.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested


def _unnest(nested: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for part, value in nested.items():
        key = f"{prefix}/{part}" if prefix else str(part)
        if isinstance(value, Mapping):
            flat.update(_unnest(value, key))
        else:
            flat[key] = value
    return flat


def storable_leaves(tree: Any, where: str) -> dict[str, Any]:
    """``{key: leaf}`` of a tree as Orbax stores it: ``jax.Array`` leaves as they are (sharded,
    never gathered), everything else as a numpy array; a key part Orbax cannot name is refused."""
    try:
        leaves = pytree.keyed_leaves(tree, where)
        out = {}
        for key, leaf in leaves.items():
            if any("." in part for part in key.split("/")):
                raise pytree.TreeError(where, [f"key {key!r}: Orbax names arrays by their path joined with '.', so "
                                               "a key part may not contain a '.'"])
            if not pytree.is_array_leaf(leaf):  # a jax.ShapeDtypeStruct: a template, not data
                raise pytree.TreeError(where, [f"{key!r} is a {type(leaf).__name__}, not an array"])
            if not hasattr(leaf, "sharding"):
                leaf = np.asarray(leaf)
                if leaf.dtype == object:
                    raise pytree.TreeError(where, [f"{key!r}: object arrays cannot be stored without pickle"])
            out[key] = leaf
    except pytree.TreeError as err:
        raise CheckpointError(str(err)) from None
    return out


def start_save(directory: Path, trees: Mapping[str, Mapping[str, Any]]) -> Any:
    """Start writing ``{tree name: {key: leaf}}`` to ``directory`` (``<tmp step dir>/arrays``);
    returns the Orbax checkpointer, whose ``wait_until_finished()`` ends the write. Every
    process calls this with the same trees (their global arrays); each writes its own shards.
    It returns once the arrays are copied off the devices, so the caller may change them."""
    import orbax.checkpoint as ocp

    _quiet_orbax_tracebacks()
    checkpointer = ocp.AsyncCheckpointer(_handler(trees))
    items = {name: ocp.args.PyTreeSave(_nest({key: _owned_copy(leaf) for key, leaf in flat.items()}))
             for name, flat in trees.items()}
    checkpointer.save(Path(directory).absolute(), args=ocp.args.Composite(**items))  # Orbax needs absolute paths
    return checkpointer


class _WithoutTraceback(logging.Filter):
    """Orbax's error records without their tracebacks: when a background write fails, each of its
    threads logs the error with a traceback (a full disk gave six, about 400 lines), and the write's
    caller reports the same failure as one line (:class:`~asyncrl.errors.CheckpointError`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is not None and f"{os.sep}orbax{os.sep}" in record.pathname:
            record.exc_info, record.exc_text = None, None
        return True


_ORBAX_FILTER = _WithoutTraceback()


def _quiet_orbax_tracebacks() -> None:
    """Install :class:`_WithoutTraceback` on the logger Orbax logs to (absl's), once."""
    logger = logging.getLogger("absl")
    if _ORBAX_FILTER not in logger.filters:
        logger.addFilter(_ORBAX_FILTER)


HANDLER_OPTIONS: dict[str, Any] = {"use_compression": False, "enable_pinned_host_transfer": False}
"""Keyword arguments of every tree's ``orbax.checkpoint.PyTreeCheckpointHandler``. No zstd
compression: float weights and moments hardly compress, and the compressed chunks are a second
copy of the state in host memory until written (measured by scripts/bench_scale.py: a save's
peak fell from 2.0x to 1.0x the state) and CPU time taken from the steps that train meanwhile.
Reading does not depend on it (each array's zarr metadata names its compressor). No pinned-host
transfer (Orbax's default on GPUs): it copies every shard into pinned host memory and then again
into a numpy array, both alive at once."""


def _handler(names: Any) -> Any:
    """A composite handler with one PyTree handler per tree, each made with :data:`HANDLER_OPTIONS`."""
    import orbax.checkpoint as ocp

    return ocp.CompositeCheckpointHandler(**{name: ocp.PyTreeCheckpointHandler(**HANDLER_OPTIONS) for name in names})


def _owned_copy(leaf: Any) -> Any:
    """A CPU ``jax.Array`` copied to buffers of its own (same sharding): Orbax's host copy of a
    CPU array is a view of its buffer, which the next train step may donate (the optimizer
    state) while the write is still in flight. On GPU/TPU Orbax copies to host memory itself."""
    import jax

    if isinstance(leaf, jax.Array) and all(getattr(d, "platform", None) == "cpu" for d in leaf.sharding.device_set):
        return jax.device_put(leaf, leaf.sharding, may_alias=False)
    return leaf


def saved_arrays(directory: Path, name: str) -> dict[str, SavedArray]:
    """``{key: SavedArray}`` of tree ``name`` from Orbax's metadata (reads no array data)."""
    import orbax.checkpoint as ocp
    from etils import epath

    try:
        metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(Path(directory).absolute() / name))
    except (OSError, ValueError, KeyError, FileNotFoundError) as err:
        raise CheckpointError(f"{directory / name}: Orbax metadata unreadable ({err})") from err
    tree = getattr(metadata, "tree", metadata)
    return {key: SavedArray(entry.shape, entry.dtype) for key, entry in _unnest(tree).items()}


READ_WINDOW_BYTES = 4 << 20
"""Bytes of shards a restore reads ahead of placing them on their devices (a larger shard is read
alone). Each shard is read into a host buffer of its own and copied into the device buffer the
restored array keeps, so a restore's host memory above the restored arrays is this window plus
the shard being placed (its host buffer, tensorstore's copy of the chunk it decodes), not a
second copy of the tree (measured by scripts/bench_scale.py: docs/scaling.md). 4 MiB: reading
one shard at a time peaked 10-30 MB lower per process than a 16 MiB window (4 processes, 54 MB
of params each); small arrays (norms, biases) are still read together."""


def restore(directory: Path, name: str, template: Mapping[str, Any]) -> dict[str, Any]:
    """Tree ``name`` as ``{key: array}``, each read onto the template leaf's sharding (a
    ``jax.Array`` or ``jax.ShapeDtypeStruct`` with a sharding: only the shards this process holds
    are read) or as a numpy array (any other leaf). The caller checked keys, shapes and dtypes
    against :func:`saved_arrays`.

    The arrays are read with tensorstore from the OCDBT/zarr files Orbax wrote (the layout its
    ``_METADATA`` names), one shard into one host buffer, at most :data:`READ_WINDOW_BYTES` ahead
    of their copy onto the device. Orbax's own reader (kept for a layout this one does not read)
    holds every shard of the tree twice on a CPU host (its read buffer and the device copy) and
    left the restore's peak at 2.4 x the restored tree (docs/scaling.md)."""
    tree_dir = Path(directory).absolute() / name
    layout = _layout(tree_dir)
    if layout is None:
        return _restore_with_orbax(directory, name, template)
    return _read_tree(tree_dir, layout, template)


def _layout(tree_dir: Path) -> Any:
    """``(zarr driver, {array name: value type})`` of a tree Orbax wrote on OCDBT, from its
    ``_METADATA`` JSON; None for any other layout (read by Orbax itself)."""
    import json

    try:
        meta = json.loads((tree_dir / "_METADATA").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("use_ocdbt") is not True or not isinstance(meta.get("tree_metadata"), dict):
        return None
    types = {}
    for entry in meta["tree_metadata"].values():
        try:
            parts = [str(k["key"]) for k in entry["key_metadata"]]
            types[".".join(parts)] = entry["value_metadata"]["value_type"]
        except (KeyError, TypeError):
            return None
    if any(kind not in ("jax.Array", "np.ndarray") for kind in types.values()):
        return None
    return ("zarr3" if meta.get("use_zarr3") else "zarr"), types


def _read_tree(tree_dir: Path, layout: Any, template: Mapping[str, Any]) -> dict[str, Any]:
    import collections

    import jax
    import tensorstore as ts

    driver, types = layout
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    base = tree_dir.as_uri() + "/"
    shards: dict[str, list] = collections.defaultdict(list)
    pending: collections.deque = collections.deque()
    in_flight = 0
    where = str(tree_dir)

    def place_oldest() -> None:
        nonlocal in_flight
        future, nbytes, key, devices, buffer = pending.popleft()
        try:
            future.result()
        except ValueError as err:
            raise CheckpointError(f"{where}: cannot read {key!r} ({err})") from err
        if devices is None:
            shards[key].append(buffer)
        for device in devices or ():  # a copy the device owns (a train step may donate it)
            shards[key].append(jax.device_put(buffer, jax.sharding.SingleDeviceSharding(device), may_alias=False))
        in_flight -= nbytes

    for key, leaf in template.items():
        stored = key.replace("/", ".")
        if stored not in types:
            raise CheckpointError(f"{where}: no array {key!r} in the checkpoint's Orbax metadata")
        dtype = np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else None
        shape = tuple(leaf.shape) if hasattr(leaf, "shape") else ()
        try:
            store = ts.open({"driver": driver, "kvstore": {"driver": "ocdbt", "base": base, "path": stored},
                             "recheck_cached_data": False, "recheck_cached_metadata": False,
                             "fill_missing_data_reads": False}, open=True, context=context).result()
        except ValueError as err:
            raise CheckpointError(f"{where}: cannot open {key!r} ({err})") from err
        if dtype is None:
            dtype = store.dtype.numpy_dtype
        if store.dtype.numpy_dtype != dtype:
            store = ts.cast(store, dtype)
        sharding = getattr(leaf, "sharding", None)
        reads: list[tuple[tuple, Optional[list]]]  # (the block's slices, the devices holding it; None: host)
        if isinstance(sharding, jax.sharding.Sharding):
            by_index: dict[tuple, list] = collections.defaultdict(list)  # a replicated block is read once
            for device, index in sharding.addressable_devices_indices_map(shape).items():
                by_index[tuple((s.start, s.stop) for s in _slices(tuple(index or ()), shape))].append(device)
            reads = [(tuple(slice(a, b) for a, b in bounds), devices) for bounds, devices in by_index.items()]
        else:
            reads = [(tuple(slice(0, n) for n in shape), None)]
        for index, devices in reads:
            domain = ts.IndexDomain(shape=shape)[ts.d[:][index]] if shape else ts.IndexDomain(shape=())
            buffer = np.empty(domain.shape, dtype)
            future = ts.array(buffer)[ts.d[:].translate_to[domain.origin]].write(store[domain]) if shape else \
                ts.array(buffer).write(store)
            pending.append((future, buffer.nbytes, key, devices, buffer))
            in_flight += buffer.nbytes
            del buffer
            while in_flight > READ_WINDOW_BYTES and pending:
                place_oldest()
    while pending:
        place_oldest()
    out: dict[str, Any] = {}
    for key, leaf in template.items():
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.Sharding):
            out[key] = jax.make_array_from_single_device_arrays(tuple(leaf.shape), sharding, shards.pop(key))
        else:
            out[key] = shards.pop(key)[0]
    return out


def _slices(index: tuple, shape: tuple) -> list[slice]:
    """``index`` (a shard's slices, possibly open-ended) as closed slices over ``shape``."""
    return [slice(*s.indices(n)[:2]) for s, n in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape)]


def _restore_with_orbax(directory: Path, name: str, template: Mapping[str, Any]) -> dict[str, Any]:
    """Orbax's own reader (:func:`restore` for a layout other than Orbax's OCDBT trees)."""
    import jax
    import orbax.checkpoint as ocp

    items: dict[str, Any] = {}
    restore_args: dict[str, Any] = {}
    for key, leaf in template.items():
        sharding = getattr(leaf, "sharding", None)
        dtype = np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else None
        if isinstance(sharding, jax.sharding.Sharding):
            items[key] = jax.ShapeDtypeStruct(tuple(leaf.shape), dtype, sharding=sharding)
            restore_args[key] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=tuple(leaf.shape), dtype=dtype)
        else:
            items[key] = np.zeros((), dtype or np.float32)
            restore_args[key] = ocp.RestoreArgs(restore_type=np.ndarray)
    checkpointer = ocp.Checkpointer(_handler([name]))
    try:
        restored = checkpointer.restore(Path(directory).absolute(), args=ocp.args.Composite(**{
            name: ocp.args.PyTreeRestore(item=_nest(items), restore_args=_nest(restore_args))}))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{directory / name}: Orbax cannot read the tree ({err})") from err
    finally:
        checkpointer.close()
    return _unnest(restored[name])


def files_written_by(directory: Path, process: int) -> list[str]:
    """Paths (relative to ``directory``, ``/``-separated, sorted) of the files under
    ``directory`` that process ``process`` wrote: its own chunk and metadata files, and for
    process 0 every file no process owns by name."""
    out = []
    for root, _, names in os.walk(directory):
        for filename in names:
            rel = Path(root, filename).relative_to(directory).as_posix()
            owned = _OWNED.search(rel)
            owner = 0 if owned is None else int(owned.group(3) or owned.group(4))
            if owner == process:
                out.append(rel)
    return sorted(out)

