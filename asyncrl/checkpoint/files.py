"""Array files without pickle: safetensors trees (bfloat16 and float8 through ``ml_dtypes``)
and the rollout state's ``.json`` + ``.npz`` (read with ``allow_pickle=False``).

The byte formats of :mod:`asyncrl.checkpoint`, which owns the layout, the manifest and
atomicity; this module only encodes and decodes. Imports no jax.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from asyncrl.errors import CheckpointError

ROLLOUT_PREFIX = "rollout"


def rollout_files(processes: int) -> list[tuple[str, str]]:
    """``(prefix, json name)`` of a checkpoint's rollout state files: ``rollout`` (``.json`` and
    ``.npz``) when one process wrote it, ``rollout_<i>`` for each process ``i`` of several (each
    process writes its own executor's state)."""
    prefixes = [ROLLOUT_PREFIX] if processes == 1 else [f"{ROLLOUT_PREFIX}_{i}" for i in range(processes)]
    return [(prefix, f"{prefix}.json") for prefix in prefixes]


def safetensors_dtypes() -> dict[str, Any]:
    import ml_dtypes

    return {
        "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
        "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
        "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
        "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
        "BOOL": np.bool_, "C64": np.complex64,
    }


def decode_safetensors(data: bytes, where: str) -> dict[str, np.ndarray]:
    """Arrays of a safetensors blob; ``safetensors.numpy.load`` lacks bfloat16, so map dtypes here."""
    import safetensors

    dtypes = safetensors_dtypes()
    try:
        views = safetensors.deserialize(data)
    except Exception as err:  # the Rust parser raises its own error type
        raise CheckpointError(f"{where}: not a readable safetensors file ({err})") from err
    out = {}
    for name, view in views:
        if view["dtype"] not in dtypes:
            raise CheckpointError(f"{where}: tensor {name!r} has unsupported dtype {view['dtype']}")
        out[name] = np.frombuffer(view["data"], dtype=dtypes[view["dtype"]]).reshape(view["shape"])
    return out


def save_safetensors(flat: dict[str, np.ndarray], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.numpy.save_file``, whose I/O failures (a Rust error type) come back as the
    ``OSError`` they are, errno included, so disk-full is reported like every other write."""
    import safetensors.numpy

    try:
        safetensors.numpy.save_file(flat, path, metadata=metadata)
    except Exception as err:
        found = re.search(r"os error (\d+)", str(err))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from err


def save_rollout_state(state: Mapping[str, Any], directory: str | Path, prefix: str = ROLLOUT_PREFIX) -> None:
    """Write ``{"meta": JSON, "arrays": {name: array}}`` (the executor's ``state_dict()``) as
    ``<prefix>.json`` and ``<prefix>.npz`` (no pickle), each through a temporary name."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    npz_tmp = directory / f".{prefix}.npz.tmp"
    with open(npz_tmp, "wb") as handle:
        arrays: dict[str, Any] = {name: np.asarray(array) for name, array in state["arrays"].items()}
        np.savez(handle, **arrays)
    json_tmp = directory / f".{prefix}.json.tmp"
    json_tmp.write_text(json.dumps(state["meta"], allow_nan=False), encoding="utf-8")
    npz_tmp.replace(directory / f"{prefix}.npz")
    json_tmp.replace(directory / f"{prefix}.json")


def load_rollout_state(directory: str | Path, prefix: str = ROLLOUT_PREFIX) -> dict[str, Any]:
    """Read what :func:`save_rollout_state` wrote (``np.load(allow_pickle=False)``): plain
    JSON and arrays; the executor checks them when it restores (``load_state_dict``)."""
    directory = Path(directory)
    meta = json.loads((directory / f"{prefix}.json").read_text(encoding="utf-8"))
    with np.load(directory / f"{prefix}.npz", allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    return {"meta": meta, "arrays": arrays}
