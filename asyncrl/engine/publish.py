"""Weights published for inference servers: one sharded Hugging Face safetensors directory per
version, in the servers' dtype, written by every process of the run in parallel.

Layout of ``weights_dir/v{N}`` (what SGLang's ``/update_weights_from_disk``, ``asyncrl serve`` and
``asyncrl.model.load_model`` read)::

    config.json                          # "dtype": the published dtype (engine.remote.dtype)
    generation_config.json               # stop ids
    tokenizer files                      # when the run has a tokenizer
    model.safetensors.index.json         # {"metadata": {"total_size": bytes, "tensor_sha256": {tensor: hex}},
                                         #  "weight_map": {tensor: file}}
    model-00001-of-00002.safetensors     # the whole tensors process 0 owns
    model-00002-of-00002.safetensors     # ... process 1's

**Ownership.** Every tensor is owned by one process (:func:`assign_owners`: the largest first, each
to the process with the fewest bytes so far), so each process writes about 1/N of the bytes and
every file holds whole tensors: a standard HF sharded checkpoint, which no server has to reassemble.

**How a tensor reaches its owner.** Tensors spanning processes (the trainer's sharded params) go
in groups of at most ``group_bytes`` through one jitted program that casts them to the published
dtype, transposes the kernels to HF's layout, and lays each out on a ``(process, local)`` view of
the same devices: whole within every process, split over that process's own devices. XLA moves
the bytes device to device; the owner copies its local pieces of its own tensors to host memory
and streams each into its file at once, the others drop theirs. So no device ever holds the
whole model, a host holds one group at a time, it writes about 1/N of the model in the published
dtype, and the writes are parallel.

**Content hashes.** The owner of each tensor hashes its published bytes (sha256, as written) and
the index records them under ``metadata.tensor_sha256`` (each process leaves its hashes in a
``.hashes-{process}.json`` beside its file; process 0 merges them into the index). ``asyncrl serve``
reads only the tensors whose hash differs from what it serves (frozen LoRA base, embeddings of a
layer-frozen run, anything unchanged): :class:`~asyncrl.serve.state.ServeState`. Hashing is part of
the publish (sha256 of bench-40m's 83 MB in bfloat16: 0.06 s on one core of a 2-core EPYC) and needs no state
carried between publishes.

**Atomic.** Each process writes its file into ``weights_dir/.v{N}.partial`` (under a temporary
name, then renamed); the processes then agree that every write succeeded (a failed write on any
process raises on every process, naming it); process 0 writes the index and the metadata, removes
anything else from the partial directory, and renames it to ``v{N}``. Older versions are pruned to
the newest ``keep``. A reader sees a whole version or none. With several processes
``weights_dir`` must be one directory for all of them and for the servers (a shared file system
across hosts; on one host a RAM-backed directory such as ``/dev/shm`` saves the disk round trip:
docs/remote.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from asyncrl.errors import AsyncRLError

log = logging.getLogger("asyncrl.engine.publish")

PUBLISH_DTYPES = ("bfloat16", "float16", "float32")
"""Dtypes weights may be published in (``engine.remote.dtype``)."""
TENSOR_HASHES = "tensor_sha256"
"""Key under the index's ``metadata``: ``{tensor: sha256 hex of its published bytes}``."""
ADAPTERS_DIR = "adapters"
"""Under ``weights_dir``: the PEFT adapters of an adapter-only publish (:meth:`WeightsWriter.write_adapter`)."""
GROUP_BYTES = 256 << 20
"""Published bytes moved by one gather program (bounds the transient device memory of a publish)."""


class PublishError(AsyncRLError):
    """A publish that failed: the message names the version, the process and the cause."""


def shard_file_name(part: int, parts: int) -> str:
    """The file process ``part`` of ``parts`` writes (HF's ``model-00001-of-00002.safetensors`` names)."""
    return f"model-{part + 1:05d}-of-{parts:05d}.safetensors"


def assign_owners(sizes: Sequence[tuple[str, int]], parts: int) -> dict[str, int]:
    """``{tensor: process}``: largest tensor first, each to the process with the fewest bytes so
    far (ties: the lower process; equal sizes in name order). Pure and deterministic, so every
    process computes the same assignment without talking to the others."""
    load = [0] * parts
    owners: dict[str, int] = {}
    for name, size in sorted(sizes, key=lambda item: (-item[1], item[0])):
        part = min(range(parts), key=lambda p: (load[p], p))
        owners[name] = part
        load[part] += size
    return owners


def _numpy_dtype(dtype: str) -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


class WeightsWriter:
    """Writes published weights (a pure params dict, the trainer's structure) as ``weights_dir/v{N}``.

    Every process of a run calls :meth:`write` with the same version (a collective when there are
    several); process 0 alone hands the path to the servers.

    Args:
        model_cfg: the model's :class:`~asyncrl.model.DecoderConfig` (tensor names, ``config.json``).
        weights_dir: where ``v{N}`` directories go.
        dtype: the published dtype (``engine.remote.dtype``); the servers read it as such.
        keep: versions kept on disk (older ones removed after each publish).
        tokenizer, stop_token_ids: written beside the weights (``generation_config.json``).
        group_bytes: published bytes per gather program (:data:`GROUP_BYTES`).
    """

    def __init__(self, model_cfg: Any, weights_dir: str | os.PathLike, *, dtype: str = "bfloat16", keep: int = 2,
                 tokenizer: Any = None, stop_token_ids: Optional[Sequence[int]] = None, group_bytes: int = GROUP_BYTES):
        if dtype not in PUBLISH_DTYPES:
            raise ValueError(f"engine.remote.dtype: {dtype!r} is not one of {', '.join(PUBLISH_DTYPES)}")
        from asyncrl.model.hf import param_layout

        self.model_cfg = model_cfg
        self.weights_dir = Path(weights_dir)
        self.dtype = dtype
        self.keep = keep
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(stop_token_ids) if stop_token_ids is not None else None
        self.group_bytes = group_bytes
        self.layout = param_layout(model_cfg)  # our param path -> (HF name, transposed, our shape)
        self.last_write_s = 0.0
        """Seconds of this process's part of the last :meth:`write`."""
        self.last_bytes = 0
        """Bytes this process wrote in the last :meth:`write`."""
        self._programs: dict[Any, Any] = {}

    def write(self, params: Any, version: int) -> Path:
        """``weights_dir/v{version}`` holding ``params`` in the published dtype; returns its path
        (every process gets it). A version directory already there is replaced."""
        import jax

        started = time.perf_counter()
        count, me = jax.process_count(), jax.process_index()
        itemsize = np.dtype(_numpy_dtype(self.dtype)).itemsize
        entries = []  # (HF name, leaf, transposed)
        for keys, (hf_name, transposed, shape) in self.layout.items():
            leaf: Any = params
            for k in keys:
                leaf = leaf[k]
            if tuple(leaf.shape) != tuple(shape):
                raise PublishError(f"publish v{version}: {hf_name} has shape {list(leaf.shape)}, the model needs {list(shape)}")
            entries.append((hf_name, leaf, transposed))
        owners = assign_owners([(name, int(np.prod(leaf.shape)) * itemsize) for name, leaf, _ in entries], count)
        partial = self.weights_dir / f".v{version}.partial"
        failure = self._write_part(entries, owners, me, partial / shard_file_name(me, count))
        failed = _all_flags(failure is not None, count)
        if failure is not None:
            raise PublishError(f"publish v{version}: process {me} could not write {partial / shard_file_name(me, count)}: "
                               f"{failure}") from failure
        if any(failed):
            bad = ", ".join(str(p) for p, f in enumerate(failed) if f)
            raise PublishError(f"publish v{version}: process {bad} could not write its part of {partial} (its log has the cause)")
        path = self.weights_dir / f"v{version}"
        if me == 0:
            self._finish(partial, path, owners, count, itemsize, entries)
        self.last_write_s = time.perf_counter() - started
        return path

    def write_adapter(self, adapters: Any, spec: Any, version: int) -> Path:
        """``weights_dir/adapters/v{version}``: a PEFT LoRA adapter (``adapter_config.json`` +
        ``adapter_model.safetensors`` in the published dtype, PEFT's names and ``[r, in]`` /
        ``[out, r]`` layout) that SGLang's ``/load_lora_adapter`` and ``asyncrl serve`` apply to the
        base published before. Megabytes instead of the model; written by the calling process
        alone (adapters are small), complete or absent; older ones pruned to the newest ``keep``."""
        from asyncrl.model.hf import install_dir
        from asyncrl.model.lora import PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE, peft_config, peft_tensors

        started = time.perf_counter()
        root = self.weights_dir / ADAPTERS_DIR
        partial, path = root / f".v{version}.partial", root / f"v{version}"
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
        tensors = peft_tensors(adapters)
        dtype = _numpy_dtype(self.dtype)
        sink = _ShardFile(partial / PEFT_WEIGHTS_FILE, [(name, tuple(t.shape)) for name, t in tensors.items()], self.dtype)
        try:
            for name, tensor in tensors.items():
                sink.write(name, tensor.astype(dtype))
            self.last_bytes = sink.close()
        finally:
            sink.discard()
        config = peft_config(spec, "the base published before it (update_weights_from_disk)")
        (partial / PEFT_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        install_dir(partial, path, overwrite=True, exist_ok=False)
        _prune_versions(root, self.keep, path)
        self.last_write_s = time.perf_counter() - started
        return path

    # ------------------------------------------------------------------ this process's part

    def _write_part(self, entries: list, owners: dict[str, int], me: int, file: Path) -> Optional[BaseException]:
        """Write the tensors ``me`` owns (published dtype, HF layout) to ``file``, each streamed as
        soon as it reaches this host, so a host holds one tensor (or one gather group) at a time.
        Every process runs every gather program (they are collectives) even after its own write
        failed; the failure is returned, to be agreed on by all processes."""
        import jax

        local = [e for e in entries if not (isinstance(e[1], jax.Array) and not e[1].is_fully_addressable)]
        groups = self._groups([e for e in entries if e not in local])
        order = [e for e in local if owners[e[0]] == me] + [e for g in groups for e in g if owners[e[0]] == me]
        dtype = _numpy_dtype(self.dtype)
        failure: Optional[BaseException] = None
        sink: Optional[_ShardFile] = None
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            sink = _ShardFile(file, [(name, tuple(leaf.shape)[::-1] if t else tuple(leaf.shape)) for name, leaf, t in order],
                              self.dtype)
        except Exception as err:  # noqa: BLE001 - agreed on by the caller
            failure = err

        def put(name: str, value: np.ndarray) -> None:
            nonlocal failure
            if failure is None and sink is not None:
                try:
                    sink.write(name, value)
                except Exception as err:  # noqa: BLE001 - agreed on by the caller
                    failure = err

        for name, leaf, transposed in local:
            if owners[name] == me:
                value = np.asarray(jax.device_get(leaf)).astype(dtype)
                put(name, value.T if transposed else value)
        for group in groups:
            gathered = self._program(group)([leaf for _, leaf, _ in group])
            for (name, _, _), array in zip(group, gathered):
                if owners[name] == me:
                    put(name, _assemble(array))
            del gathered
        if sink is not None:
            try:
                if failure is None:
                    self.last_bytes = sink.close()
                    (file.parent / hashes_file_name(me)).write_text(json.dumps(sink.digests, sort_keys=True))
            except Exception as err:  # noqa: BLE001 - agreed on by the caller
                failure = err
            finally:
                sink.discard()
        return failure

    def _groups(self, spanning: list) -> list[list]:
        """Tensors spanning processes in groups of at most ``group_bytes`` published bytes, by mesh."""
        itemsize = np.dtype(_numpy_dtype(self.dtype)).itemsize
        groups: list[list] = []
        by_mesh: dict[Any, list] = {}
        for entry in spanning:
            by_mesh.setdefault(entry[1].sharding.mesh, []).append(entry)
        for entries in by_mesh.values():
            group: list = []
            size = 0
            for entry in entries:
                nbytes = int(np.prod(entry[1].shape)) * itemsize
                if group and size + nbytes > self.group_bytes:
                    groups.append(group)
                    group, size = [], 0
                group.append(entry)
                size += nbytes
            if group:
                groups.append(group)
        return groups

    def _program(self, group: list) -> Any:
        """A jitted cast (+ HF transpose) of the group's tensors onto a ``(process, local)`` view of
        their devices: whole within each process, split over its devices (compiled once per group)."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        mesh = group[0][1].sharding.mesh
        key = (id(mesh), self.dtype, tuple((tuple(leaf.shape), transposed) for _, leaf, transposed in group))
        if key not in self._programs:
            devices = sorted(mesh.devices.flat, key=lambda d: (d.process_index, d.id))
            count = jax.process_count()
            rows = np.array(devices, dtype=object).reshape(count, -1)
            if any(len({d.process_index for d in row}) != 1 for row in rows):
                raise PublishError("publish: the trainer's mesh does not give every process the same number of devices")
            view = Mesh(rows, ("process", "local"))
            local = rows.shape[1]
            dtype = jnp.dtype(self.dtype)
            shardings = []
            for _, leaf, transposed in group:
                shape = tuple(leaf.shape)[::-1] if transposed else tuple(leaf.shape)
                split = next((d for d, n in enumerate(shape) if n % local == 0), None)
                spec: list[Optional[str]] = [None] * len(shape)
                if split is not None and local > 1:
                    spec[split] = "local"
                shardings.append(NamedSharding(view, PartitionSpec(*spec)))
            flags = tuple(transposed for _, _, transposed in group)

            def cast(leaves: list) -> list:
                return [(x.T if t else x).astype(dtype) for x, t in zip(leaves, flags)]

            self._programs[key] = jax.jit(cast, out_shardings=shardings)
        return self._programs[key]

    # ------------------------------------------------------------------ process 0: index, metadata, rename

    def _finish(self, partial: Path, path: Path, owners: dict[str, int], count: int, itemsize: int,
                entries: list) -> None:
        from asyncrl.model.hf import SAFETENSORS_INDEX, install_dir, write_hf_metadata

        files = {shard_file_name(p, count) for p in range(count)}
        sidecars = [partial / hashes_file_name(p) for p in range(count)]
        digests: dict[str, str] = {}
        for sidecar in sidecars:
            digests.update(json.loads(sidecar.read_text()))
        for stray in partial.iterdir():  # a crashed earlier attempt, another process count, the hash sidecars
            if stray.name not in files:
                shutil.rmtree(stray) if stray.is_dir() else stray.unlink()
        missing = sorted({name for name, _, _ in entries} - set(digests))
        if missing:
            raise PublishError(f"publish: {partial}: no content hash for {', '.join(missing[:5])} (a process's "
                               f"{hashes_file_name(0)}-style file is incomplete)")
        total = sum(int(np.prod(leaf.shape)) * itemsize for _, leaf, _ in entries)
        index = {"metadata": {"total_size": total, TENSOR_HASHES: {name: digests[name] for name, _, _ in entries}},
                 "weight_map": {name: shard_file_name(owners[name], count) for name, _, _ in entries}}
        (partial / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        write_hf_metadata(self.model_cfg.replace(param_dtype=self.dtype), self.tokenizer, partial, self.stop_token_ids)
        install_dir(partial, path, overwrite=True, exist_ok=False)
        _prune_versions(self.weights_dir, self.keep, path)


def _prune_versions(root: Path, keep: int, newest: Path) -> None:
    """Remove the ``v{N}`` directories under ``root`` but the ``keep`` highest (never ``newest``)."""
    kept = sorted((p for p in root.glob("v*") if p.name[1:].isdigit()), key=lambda p: int(p.name[1:]))
    for old in kept[:-keep]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)


_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


class _ShardFile:
    """A safetensors file written tensor by tensor, in the order its header names them: the header
    (every name, dtype, shape and offset; padded to 8 bytes) first, then each tensor's bytes as it
    comes, under a temporary name renamed onto ``path`` by :meth:`close`. What ``safetensors.numpy.save_file``
    writes, without holding every tensor (and two serialised copies of them) in memory at once."""

    def __init__(self, path: Path, specs: list[tuple[str, tuple[int, ...]]], dtype: str):
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        itemsize = np.dtype(_numpy_dtype(dtype)).itemsize
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self.expected: list[tuple[str, tuple[int, ...]]] = list(specs)
        offset = 0
        for name, shape in specs:
            size = int(np.prod(shape)) * itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        self.size = offset
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.file = open(self.tmp, "wb")
        self.file.write(len(raw).to_bytes(8, "little") + raw)
        self.written = 0
        self.digests: dict[str, str] = {}
        """sha256 (hex) of each tensor's bytes as written: the index's ``tensor_sha256``."""

    def write(self, name: str, value: np.ndarray) -> None:
        expected_name, shape = self.expected[self.written]
        if name != expected_name or tuple(value.shape) != shape:
            raise PublishError(f"{self.path}: got {name} {list(value.shape)} where the header has {expected_name} {list(shape)}")
        data = np.ascontiguousarray(value).reshape(-1).view(np.uint8).data
        self.digests[name] = tensor_digest(data)
        self.file.write(data)
        self.written += 1

    def close(self) -> int:
        """Finish the file (every tensor written) and rename it into place; returns its data bytes."""
        if self.written != len(self.expected):
            raise PublishError(f"{self.path}: {self.written} of {len(self.expected)} tensors written")
        self.file.close()
        os.replace(self.tmp, self.path)
        return self.size

    def discard(self) -> None:
        """Close and remove the temporary file, if it is still there."""
        self.file.close()
        if self.tmp.exists():
            self.tmp.unlink()


def tensor_digest(data: Any) -> str:
    """sha256 (hex) of a tensor's bytes: the identity ``asyncrl serve`` compares to skip re-reading it."""
    return hashlib.sha256(data).hexdigest()


def hashes_file_name(part: int) -> str:
    """Where process ``part`` leaves the hashes of the tensors it wrote (merged into the index by process 0)."""
    return f".hashes-{part:05d}.json"


def _assemble(array: Any) -> np.ndarray:
    """A host copy of ``array`` from this process's shards (it holds the whole of it)."""
    out = np.empty(array.shape, array.dtype)
    done = set()
    for shard in array.addressable_shards:
        where = tuple(s.indices(n) for s, n in zip(shard.index, array.shape))
        if where not in done:  # a piece replicated over this process's devices is copied once
            done.add(where)
            out[shard.index] = np.asarray(shard.data)
    return out


def _all_flags(flag: bool, count: int) -> list[bool]:
    """Every process's ``flag`` (an all-gather; ``[flag]`` with one process)."""
    if count == 1:
        return [flag]
    from jax.experimental import multihost_utils

    return [bool(f) for f in np.asarray(multihost_utils.process_allgather(np.int32(flag))).reshape(-1)]
