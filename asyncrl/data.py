"""Datasets: what a task gives the run, and the seeded, resumable order samples are drawn in.

A dataset is a registered factory (kind ``dataset``) called as ``factory(seed=run.seed,
**kwargs)`` that returns :class:`TaskData`: a train split, an eval split, and
optionally the task's own reward and solver. A sample is a plain dict with a
``prompt`` (a string, or a list of chat messages) plus any fields the reward
functions take as keyword arguments (``answer``, ...) and, for SFT, a ``response``.

Built-ins here: ``jsonl`` (a local file with a field mapping) and ``hf`` (a Hugging Face hub
dataset by name, through the ``datasets`` library). The synthetic tasks and GSM8K live in the
``workflows`` package.

Datasets by name (:func:`hub_rows`) are loaded with ``datasets.load_dataset`` and cached where
``datasets`` caches (``$HF_DATASETS_CACHE``, else ``~/.cache/huggingface/datasets``): the first run
downloads, later ones (and ``HF_DATASETS_OFFLINE=1``) read the cache. A local copy is used instead
when ``$ASYNCRL_DATA_DIR`` holds one (``<dir>/<name>/<split>.jsonl``), or when the config names a
file. Offline with neither, the run stops with one line naming the dataset, the command that
fetches it and the variable that points at a copy.
"""

from __future__ import annotations

import json
import os
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from asyncrl.errors import AsyncRLError
from asyncrl.registry import register


class DataError(AsyncRLError):
    """A dataset file or spec is unusable; the message names the file, line and field."""


@dataclass
class TaskData:
    """The splits of a task. Samples: dicts with ``prompt`` and the reward functions' fields."""

    train: Sequence[dict]
    eval: Sequence[dict]
    reward: Any = None
    """The task's default reward spec, used when the config names none."""
    solver: Callable[[str], str] | None = None
    """Maps a prompt to its reference answer, when the task has one."""
    info: dict = field(default_factory=dict)
    eval_metrics: Mapping[str, Callable[..., float]] = field(default_factory=dict)
    """Extra eval metrics: ``{name: fn(prompt, completion, **sample_fields) -> float}``; eval
    reports the mean of each over the greedy completions as ``eval/<name>``."""


class SampleOrder(Sequence):
    """The order samples are drawn in: a pure function of ``(seed, sample_id)``.

    Sample id ``s`` is draw number ``s``: epoch ``s // n`` visits every one of the ``n``
    samples once, in a permutation seeded by ``(seed, epoch)``. A prompt drawn in two
    epochs is two samples (two ids, two random streams). Because the order holds no
    state, the executor's ledger (which sample ids were drawn) is all a resume needs.

    As a ``Sequence`` it is the ``n`` samples in file order; :meth:`sample` is the draw.
    """

    def __init__(self, samples: Sequence[dict], seed: int):
        if len(samples) == 0:
            raise DataError("the train split is empty: nothing to draw samples from")
        self._samples = samples
        self._seed = seed
        self._lock = threading.Lock()
        self._cached_epoch = -1
        self._cached_order: list[int] = []

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index):
        return self._samples[index]

    def position(self, sample_id: int) -> int:
        """Position in the split of the sample drawn as ``sample_id``."""
        if sample_id < 0:
            raise ValueError(f"sample ids are non-negative (given {sample_id})")
        epoch, position = divmod(sample_id, len(self._samples))
        with self._lock:
            if epoch != self._cached_epoch:
                order = list(range(len(self._samples)))
                random.Random(f"{self._seed}/epoch/{epoch}").shuffle(order)
                self._cached_epoch, self._cached_order = epoch, order
            return self._cached_order[position]

    def sample(self, sample_id: int) -> dict:
        """The sample drawn as ``sample_id`` (shared: do not mutate it)."""
        return self._samples[self.position(sample_id)]


def sample_at(dataset: Sequence[Mapping[str, Any]], sample_id: int) -> Mapping[str, Any]:
    """Draw ``sample_id`` from a :class:`SampleOrder`, or cycle a plain sequence in order."""
    if isinstance(dataset, SampleOrder):
        return dataset.sample(sample_id)
    return dataset[sample_id % len(dataset)]


def read_jsonl(path: str | Path, required: Sequence[str] = ()) -> list[dict]:
    """Read a JSONL file; every error names the file, the line and the field."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    from asyncrl.config import read_utf8

    records = []
    for number, line in enumerate(read_utf8(path, DataError).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not valid JSON: {err.msg}") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        for name in required:
            if name not in record:
                raise DataError(f"{path}:{number}: missing field '{name}' (fields: {', '.join(record) or 'none'})")
        records.append(record)
    if not records:
        raise DataError(f"{path}: no records")
    return records


def split_eval(samples: list[dict], eval_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Hold out ``eval_size`` samples chosen by ``seed``; the rest are the train split."""
    if eval_size < 0 or eval_size >= len(samples):
        raise DataError(f"eval_size must be in [0, {len(samples) - 1}] for {len(samples)} samples (given {eval_size})")
    order = list(range(len(samples)))
    random.Random(f"{seed}/eval-split").shuffle(order)
    held_out = set(order[:eval_size])
    train = [s for i, s in enumerate(samples) if i not in held_out]
    return train, [samples[i] for i in sorted(held_out)]


def map_fields(records: list[dict], mapping: dict[str, str], source: str) -> list[dict]:
    """Rename fields (``{our_name: their_name}``), keeping every other field as is."""
    out = []
    for number, record in enumerate(records, start=1):
        sample = dict(record)
        for ours, theirs in mapping.items():
            if theirs not in record:
                raise DataError(f"{source}: record {number} has no field '{theirs}' (mapped to '{ours}')")
            sample[ours] = record[theirs]
        out.append(sample)
    return out


@register("dataset", "jsonl")
def jsonl_dataset(
    path: str,
    *,
    seed: int = 0,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    response_field: str | None = None,
    eval_path: str | None = None,
    eval_size: int = 0,
    max_samples: int | None = None,
) -> TaskData:
    """A local JSONL file. Fields are renamed to ``prompt``/``answer``/``response``; the
    eval split is ``eval_path`` or ``eval_size`` samples held out by ``seed``."""
    mapping = {"prompt": prompt_field}
    if answer_field:
        mapping["answer"] = answer_field
    if response_field:
        mapping["response"] = response_field
    records = read_jsonl(path)[: max_samples or None]
    samples = map_fields(records, mapping, str(path))
    if eval_path is not None:
        eval_samples = map_fields(read_jsonl(eval_path), mapping, str(eval_path))
        return TaskData(train=samples, eval=eval_samples)
    train, eval_samples = split_eval(samples, eval_size, seed)
    return TaskData(train=train, eval=eval_samples)


DATA_DIR_ENV = "ASYNCRL_DATA_DIR"
"""A folder of local copies of datasets by name: ``<dir>/<name>/<split>.jsonl``."""


def fetch_command(name: str, config_name: str | None) -> str:
    """The one-line command that downloads ``name`` into ``datasets``' cache."""
    config = f", {config_name!r}" if config_name else ""
    return f"python -c \"import datasets; datasets.load_dataset({name!r}{config})\""


def hub_rows(name: str, config_name: str | None, split: str, *, local_name: str | None = None,
             task: str | None = None) -> list[dict]:
    """The records of split ``split`` of the hub dataset ``name``: from
    ``$ASYNCRL_DATA_DIR/<local_name>/<split>.jsonl`` when that file exists (``local_name``: default
    ``name``), else through ``datasets`` (downloaded once, then read from its cache). A failure is
    one :class:`DataError` line naming the dataset, the fetch command and the variable."""
    local_name = local_name or name
    task = task or name
    data_dir = os.environ.get(DATA_DIR_ENV)
    if data_dir:
        copy = Path(data_dir).expanduser() / local_name / f"{split}.jsonl"
        if copy.is_file():
            return read_jsonl(copy)
    looked = f" (no {Path(data_dir).expanduser() / local_name / f'{split}.jsonl'})" if data_dir else ""
    hint = (f"fetch it once where there is network with: {fetch_command(name, config_name)}; or set {DATA_DIR_ENV} to a "
            f"folder holding {local_name}/{split}.jsonl{looked}")
    try:
        import datasets
    except ImportError:
        raise DataError(f"dataset {task}: reading {name} from the Hugging Face hub needs the 'datasets' package "
                        f"(pip install datasets); or set {DATA_DIR_ENV} to a folder holding {local_name}/{split}.jsonl") from None
    try:
        rows = datasets.load_dataset(name, config_name, split=split)
    except Exception as err:  # offline and not cached, no network, unknown name or split, gated: one line each
        reason = " ".join(str(err).split())[:300] or type(err).__name__
        offline = [v for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE") if os.environ.get(v, "").lower() in ("1", "true", "yes")]
        if offline:
            reason = f"offline ({'='.join((offline[0], os.environ[offline[0]]))}) and not in the datasets cache: {reason}"
        raise DataError(f"dataset {task}: cannot load {name} (split {split}) from the Hugging Face hub: {reason}; {hint}") from None
    return [dict(row) for row in rows]


@register("dataset", "hf")
def hf_dataset(
    name: str,
    *,
    seed: int = 0,
    config_name: str | None = None,
    split: str = "train",
    eval_split: str | None = None,
    eval_size: int = 0,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    response_field: str | None = None,
) -> TaskData:
    """A Hugging Face hub dataset by name (:func:`hub_rows`: a local copy under ``$ASYNCRL_DATA_DIR``,
    else ``datasets``' cache, else a download)."""
    mapping = {"prompt": prompt_field}
    if answer_field:
        mapping["answer"] = answer_field
    if response_field:
        mapping["response"] = response_field
    train_records = hub_rows(name, config_name, split, task="hf")
    eval_records = hub_rows(name, config_name, eval_split, task="hf") if eval_split else None
    samples = map_fields(train_records, mapping, f"{name}:{split}")
    if eval_records is not None:
        return TaskData(train=samples, eval=map_fields(eval_records, mapping, f"{name}:{eval_split}"))
    train, eval_samples = split_eval(samples, eval_size, seed)
    return TaskData(train=train, eval=eval_samples)
