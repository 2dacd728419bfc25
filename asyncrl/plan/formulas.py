"""The memory formulas of ``asyncrl plan`` (:mod:`asyncrl.plan.command`): what a config needs on each
device, counted from the run config and the model's ``config.json`` alone.

No weights are read, nothing is allocated, no accelerator is needed. :func:`plan_config` lays the
run out as training would: the trainer's mesh and the engine's devices
(:func:`~asyncrl.cluster.placement.resolve_placement` on stand-in devices), the parameters' shards
(the model's own partition rules, :mod:`asyncrl.model.sharding`, on abstract shapes), and then
counts bytes per device:

trainer
    parameters (``model.param_dtype``), the step's new parameters (the step does not donate
    them: the engine may serve the old ones, docs/design.md), the float32 gradient accumulator
    and one micro-batch's gradients (in the compute dtype where the step differentiates its
    compute-dtype copy of the weights), AdamW's two moments, the frozen reference model when
    ``algo.kl_coef > 0``, LoRA's frozen base, the step's compute-dtype copy of the weights and,
    with ``model.scan_layers``, its stacked ``[layers, ...]`` copy, and the activations of one
    micro-batch (:func:`~asyncrl.plan.activations.activation_bytes`: per layer what the backward pass keeps, or with
    ``model.remat`` each layer's input plus the larger of one layer recomputed and the lm head's
    logits over the trained window, chunked by ``model.logprob_chunk_size`` or the automatic
    budget: the two are never alive together);
engine
    its weights (none when it serves the trainer's own arrays, the default placement of one
    process; a copy on its own devices otherwise; LoRA's merged weights), the KV page pool
    (``kv_pages`` per replica ``x page_size x layers x 2 x kv_heads x head_dim x`` compute-dtype
    bytes, with the sequences it holds at ``kv_capacity`` and at the stated mean length
    (:func:`mean_tokens`); each device holds its replica's pool, KV heads split over
    ``engine.tensor_parallel``), one decode step's logits and, on the CPU, the pages its flat
    attention gathers. Where ``model.compute_dtype`` differs from ``model.param_dtype`` both hold a
    compute-dtype copy of the weights (the trainer's for the backward, the engine's serving copy
    cast at each publish; measured on the Qwen2.5-0.5B shape).

The copies XLA keeps differ by backend (attention scores, the lm head's logits, a decode step's
logits: :mod:`asyncrl.plan.activations`, :func:`decode_logit_copies`), so
the plan is for a backend (``--backend``; ``asyncrl plan --target`` plans for the target's). The
GPU and TPU figures are calibrated against XLA's own memory analysis of the compiled programs
(docs/performance.md "The formulas against XLA").

A device that hosts both (colocated, the default) holds both sides' resident state and the larger
of their programs' temporaries (:attr:`MemoryPlan.total_bytes`: the programs take turns on a device). ``engine.slots: auto`` is sized
and ``engine.kv_pages: auto`` from the same accounting (:func:`size_engine`, used by
:mod:`asyncrl.run.auto_slots`).

It stays one file: every line of the device total, the trainer's and the engine's, is counted
here, so the figures that add up to it are read side by side.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from asyncrl.config import Config
from asyncrl.errors import ConfigError, ModelError
from asyncrl.plan.activations import DTYPE_BYTES, activation_bytes, batch_shape, param_count, stacked_layers, stacked_share

GIB = 2**30
CPU_DECODE_LOGIT_COPIES = 3
"""On the CPU: float32 ``[slots, vocab]`` tensors one decode step holds at once (logits, scaled,
probabilities); GPU and TPU compilers fuse the sampling's passes over one copy."""


def decode_logit_copies(backend: str) -> int:
    """Float32 ``[slots, vocab]`` tensors one decode step holds at once."""
    return CPU_DECODE_LOGIT_COPIES if backend == "cpu" else 1


def resolve_backend(backend: Optional[str]) -> str:
    """``backend`` (``cpu``, ``gpu``, ``tpu``), or this machine's."""
    if backend is not None:
        return backend
    import jax

    return jax.default_backend()


@dataclasses.dataclass(frozen=True)
class StandInDevice:
    """A device of the planned machine, for :func:`~asyncrl.cluster.placement.resolve_placement`."""

    id: int
    process_index: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the run's parts go on the planned devices."""

    devices: int
    processes: int
    mesh: tuple[int, int, int]
    """The trainer's ``(data, fsdp, tensor)``."""
    engine_devices: int
    tensor_parallel: int
    colocated: bool
    """Every engine device is a trainer device: such a device holds both."""
    shares_trainer_arrays: bool
    """The engine serves the trainer's own parameter arrays (no copy)."""

    @property
    def row_shards(self) -> int:
        return self.mesh[0] * self.mesh[1]

    @property
    def engine_replicas(self) -> int:
        return self.engine_devices // self.tensor_parallel


@dataclasses.dataclass(frozen=True)
class Line:
    """One figure of the table: bytes per device of one thing."""

    part: str  # "trainer" | "engine"
    name: str
    bytes: int
    note: str = ""
    resident: bool = False
    """Held from one step to the next (weights, optimizer state, the KV cache); else a temporary of ``program``."""
    program: str = ""
    """The program whose temporary it is: ``train_step``; ``decode_chunk``, ``publish``, ``prefix_reuse`` (the engine's)."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The per-device figures of one config on one layout."""

    lines: tuple[Line, ...]
    layout: Layout
    stage: str
    """The stage planned (the one needing the most memory)."""
    params: int
    """The model's parameter count."""
    publish_bytes: int = 0
    """What one engine device receives in a publish (the serving copy's bytes it does not hold: the
    trainer's shards gathered in the compute dtype); 0 where the engine serves the trainer's arrays."""

    def publish_seconds(self, gb_per_s: Optional[float]) -> Optional[float]:
        """:attr:`publish_bytes` at ``gb_per_s`` (a device's interconnect, one direction), or None."""
        return self.publish_bytes / (gb_per_s * 1e9) if gb_per_s else None

    def part_bytes(self, part: str) -> int:
        """What ``part`` holds at its peak: its resident state and its largest program's temporaries."""
        return self.resident_bytes(part) + self.temporary_bytes(part)

    def resident_bytes(self, part: str) -> int:
        return sum(line.bytes for line in self.lines if line.part == part and line.resident)

    def program_bytes(self, program: str) -> int:
        """The temporaries of one program (``train_step``, ``decode_chunk``, ``publish``, ``prefix_reuse``)."""
        return sum(line.bytes for line in self.lines if not line.resident and line.program == program)

    def temporary_bytes(self, part: str) -> int:
        """The largest of ``part``'s programs' temporaries (they never run at once)."""
        programs = {line.program for line in self.lines if line.part == part and not line.resident}
        return max((self.program_bytes(program) for program in programs), default=0)

    @property
    def total_bytes(self) -> int:
        """The device total: the most any one device holds. Colocated: the trainer's and the engine's
        resident state and the larger of their temporaries (the train step and the engine's programs
        take turns on the devices: a step trains, then publishes, then the engine decodes); split:
        the larger of the two sides."""
        if self.layout.colocated:
            return (self.resident_bytes("trainer") + self.resident_bytes("engine")
                    + max(self.temporary_bytes("trainer"), self.temporary_bytes("engine")))
        return max(self.part_bytes("trainer"), self.part_bytes("engine"))


# --------------------------------------------------------------------------- the model's config.json


def read_decoder_config(model_path: str) -> Any:
    """The :class:`~asyncrl.model.DecoderConfig` of ``model.path`` from its ``config.json`` only:
    a model directory, a ``config.json`` file, ``tiny[:...]`` (computed), ``tiny-qwen3[:...]``
    (its built directory), or a hub id whose config is in the local Hugging Face cache.
    Runtime options are the defaults (:func:`stage_decoder_config` sets the config's)."""
    from asyncrl.model.config import from_hf_config
    from asyncrl.model.hf import read_hf_config_file
    from asyncrl.model.tiny import is_tiny, parse_tiny_spec, tiny_decoder_config
    from asyncrl.model.tiny_qwen3 import is_tiny_qwen3

    text = os.fspath(model_path)
    local = Path(text).expanduser()
    if is_tiny(text) and not local.exists():
        return tiny_decoder_config(parse_tiny_spec(text))
    if local.is_dir():
        file = local / "config.json"
    elif local.is_file():
        file = local
    elif is_tiny_qwen3(text):
        from asyncrl.model.tiny_qwen3 import ensure_tiny_qwen3

        file = ensure_tiny_qwen3(text) / "config.json"
    else:
        file = _cached_hub_config(text)
    if not file.is_file():
        raise ModelError(f"model.path {text!r}: no config.json in {file.parent}; give a model directory or its config.json")
    hf_config = read_hf_config_file(file)
    try:
        return from_hf_config(hf_config, source=str(file))
    except AttributeError as err:  # a required field (hidden_size, ...) missing where no default exists
        raise ModelError(f"{file}: missing a field the model needs ({err})") from None


def _cached_hub_config(text: str) -> Path:
    """``config.json`` of hub id ``text`` from the local Hugging Face cache (plan never downloads)."""
    looks_hub = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if looks_hub:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(text, "config.json")
        except Exception:  # noqa: BLE001 - a malformed id: same answer as not cached
            found = None
        if isinstance(found, str):
            return Path(found)
    raise ModelError(
        f"model.path {text!r}: no such directory or file, and not a hub id with config.json in the local Hugging Face "
        "cache (asyncrl plan downloads nothing); --set model.path=<a model directory or its config.json>"
    )


# --------------------------------------------------------------------------- layout and shards


def plan_layout(cfg: Config, devices: int, processes: int = 1) -> Layout:
    """The trainer mesh and engine devices ``cfg`` gets on ``devices`` devices over ``processes``
    processes (the same rules and errors as a real start)."""
    from asyncrl.cluster.mesh import mesh_shape
    from asyncrl.cluster.placement import resolve_placement

    if devices < 1 or processes < 1 or devices % processes:
        raise ConfigError(f"--devices {devices} --processes {processes}: give devices >= 1 and a process count that "
                          "divides them (each process has devices / processes of them)")
    per_process = devices // processes
    stand_ins = [StandInDevice(i, i // per_process) for i in range(devices)]
    placement = resolve_placement(cfg, stand_ins, processes)
    from asyncrl.errors import TrainerError

    try:
        mesh = mesh_shape(cfg.mesh, len(placement.trainer_devices))
    except TrainerError as err:
        raise ConfigError(str(err)) from None
    return Layout(
        devices=devices, processes=processes, mesh=mesh, engine_devices=len(placement.engine_devices),
        tensor_parallel=placement.tensor_parallel, colocated=placement.colocated,
        shares_trainer_arrays=placement.shares_trainer_arrays,
    )


def abstract_params(model_cfg: Any) -> dict:
    """The model's parameter tree as ``jax.ShapeDtypeStruct`` leaves (nothing allocated); cached
    per architecture and parameter dtype: the runtime options that shape no parameter (remat,
    chunking, attention, compute dtype, scanned layers) share one tree, so suggestions and choices
    that plan the same model many times trace it once. Treat it as read-only."""
    return _abstract_params(model_cfg.replace(compute_dtype=model_cfg.param_dtype, remat=False, remat_policy="full",
                                              logprob_chunk_size=None, attention="auto", scan_layers=False))


@functools.lru_cache(maxsize=16)
def _abstract_params(model_cfg: Any) -> dict:
    from flax import nnx

    from asyncrl.model.transformer import Decoder, split_params

    return split_params(nnx.eval_shape(lambda: Decoder(model_cfg, nnx.Rngs(0))))[1]


def _mesh_view(data: int, fsdp: int, tensor: int) -> Any:
    """What the partition rules read of a mesh (its axis sizes), for a mesh of devices not here."""
    return SimpleNamespace(shape={"data": data, "fsdp": fsdp, "tensor": tensor})


def _shard_factor(spec: Any, mesh: Any) -> int:
    return math.prod(mesh.shape[axis] for axis in spec if axis is not None)


def params_per_device(model_cfg: Any, params: dict, mesh: Any, lora: Any = None) -> tuple[int, int]:
    """``(base, adapters)``: parameters one device holds on ``mesh`` by the partition rules, and
    LoRA adapter parameters (``lora``: the ``model.lora`` section; A ``[in, r]`` split like the
    base kernel's input, B ``[r, out]`` like its output)."""
    import jax

    from asyncrl.model.sharding import partition_spec
    from asyncrl.pytree import dotted_name

    base = adapters = 0
    targets = set(lora.target_modules) if lora is not None else set()
    if lora is not None:
        from asyncrl.model.lora import check_moe_targets

        check_moe_targets(model_cfg, targets)  # refused as training would refuse it
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = dotted_name(path)
        shape = tuple(leaf.shape)
        spec = partition_spec(model_cfg, name, shape, mesh)
        base += math.prod(shape) // _shard_factor(spec, mesh)
        module = name.rsplit(".", 2)[-2] if name.endswith(".kernel") else None
        if module in targets:
            (fan_in, fan_out), (axis_in, axis_out) = shape, tuple(spec)
            split = lambda axis: mesh.shape[axis] if axis is not None else 1  # noqa: E731
            adapters += fan_in * lora.rank // split(axis_in) + lora.rank * fan_out // split(axis_out)
    return base, adapters


# --------------------------------------------------------------------------- the plan


def plan_stage(cfg: Config, model_cfg: Any, layout: Layout, params: dict, sft: bool = False, stage: str = "rl",
               backend: Optional[str] = None) -> MemoryPlan:
    """The per-device figures of one stage's flat config (``cfg.stage_configs()``) on ``layout``,
    as compiled for ``backend`` (``cpu``, ``gpu``, ``tpu``; default: this machine's)."""
    from asyncrl.algo import AlgoParams
    from asyncrl.model.logprobs import auto_chunk_size

    p_bytes = DTYPE_BYTES[model_cfg.param_dtype]
    c_bytes = DTYPE_BYTES[model_cfg.compute_dtype]
    mesh = _mesh_view(*layout.mesh)
    lora = cfg.model.lora
    base, adapters = params_per_device(model_cfg, params, mesh, lora)
    trained = adapters if lora is not None else base
    lines = []
    def add(part: str, name: str, nbytes: int, note: str = "", *, resident: bool = False) -> None:
        lines.append(Line(part, name, nbytes, note, resident=resident, program="train_step"))

    what = "LoRA adapters" if lora is not None else "parameters"
    add("trainer", what, trained * p_bytes, f"{model_cfg.param_dtype}, mesh (data, fsdp, tensor) = {layout.mesh}", resident=True)
    add("trainer", "new " + what, trained * p_bytes, "the step's output (parameters are not donated)")
    # The micro-batches differentiate the step's compute-dtype copy of the weights when it has one
    # (asyncrl/model/compute_copy.py): their gradients are in the compute dtype, the sum in float32.
    cast_once = lora is None and c_bytes != p_bytes
    g_bytes = c_bytes if cast_once else p_bytes
    g_note = f"one micro-batch's ({model_cfg.compute_dtype if cast_once else model_cfg.param_dtype})"
    backend = resolve_backend(backend)
    updates = 1 if sft else cfg.algo.mini_batches * cfg.algo.ppo_epochs
    rows, length, window = batch_shape(cfg, sft)
    shards = layout.row_shards
    minis = 1 if sft else cfg.algo.mini_batches
    rows, local_rows, micro_note = micro_batch_rows(cfg, rows, length, shards, minis)
    if rows // (minis * shards) <= local_rows and backend != "cpu":
        # One micro-batch per update: no accumulation loop, so no float32 sum of its own (the update
        # reads the micro-batch's gradient; read from the train step compiled for an H100 and a v6e-8).
        add("trainer", "gradients", trained * g_bytes, g_note + "; one micro-batch per update: no float32 sum")
    elif updates == 1 and p_bytes >= 4 and backend != "cpu":
        # One optimizer update per step: XLA lays the micro-batches' float32 sum in the new
        # parameters' output buffers, which hold nothing else until the update writes them (read
        # from the buffer assignment of gsm8k_sft.yaml's step for an H100: the accumulator loop's
        # values live in the outputs, none in the temporaries). With several updates the new
        # parameters are the update loop's carry and the sum needs buffers of its own.
        add("trainer", "gradients", trained * g_bytes, g_note + "; the float32 sum in the new parameters' buffers")
    else:
        add("trainer", "gradients", trained * (4 + g_bytes), "float32 accumulator + " + g_note)
    adam = cfg.optim.optimizer == "adamw"
    add("trainer", "optimizer state", 2 * trained * p_bytes if adam else 0, "AdamW mu, nu" if adam else "sgd: none",
        resident=True)
    if lora is not None:
        add("trainer", "frozen base", base * p_bytes, f"LoRA rank {lora.rank}", resident=True)
    relaid = _tpu_relaid_table(model_cfg, mesh, backend, lora is None and updates > 1)
    if relaid:
        copies = 3 if adam else 1
        add("trainer", "relaid embedding", copies * relaid * p_bytes,
            f"the table{' and its AdamW moments' if adam else ''} in the update loop's layout: each device's "
            f"hidden columns padded to TPU's {TPU_LANES} lanes")
    if c_bytes != p_bytes:  # each forward casts the weights; the backward keeps the cast copies
        cast = base
        if backend == "tpu" and model_cfg.scan_layers:
            # libtpu casts the scanned layers' weights into their stacks ("stacked layers") and keeps no
            # per-layer cast beside them (the buffer assignment of Qwen3-1.7B's step for a v6e-8 holds
            # [28, ...] stacks only): the cast here is of the weights outside the scans.
            cast = base - int(base * stacked_share(model_cfg, params))
        add("trainer", "cast weights", cast * c_bytes, f"{model_cfg.param_dtype} weights as {model_cfg.compute_dtype}")
    algo = None if sft else AlgoParams.from_config(cfg)
    if algo is not None and algo.needs_reference:
        add("trainer", "reference model", trained * p_bytes, "algo.kl_coef > 0", resident=True)

    global_micro_rows = local_rows * shards
    chunk = model_cfg.logprob_chunk_size or auto_chunk_size(global_micro_rows, window, model_cfg.vocab_size,
                                                            model_cfg.logprob_chunk_budget_mb)
    packed = cfg.packs and not sft
    act = activation_bytes(model_cfg, local_rows, length, window, layout.mesh[2], chunk, backend, layout.mesh[1], lora,
                           segments=cfg.rollout.pack_max_segments if packed else 0)
    remat = ("remat" if model_cfg.remat_policy == "full" else f"remat ({model_cfg.remat_policy})") if model_cfg.remat \
        else "no remat"
    add("trainer", "activations", act.kept,
        f"{local_rows} rows x {length} tokens per micro-batch ({micro_note}), {remat}, {model_cfg.compute_dtype}, "
        f"attention {act.kernel}")
    head_note = f"window {window}, " + (f"chunks of {chunk}" if chunk else "unchunked")
    if model_cfg.remat:  # the head's backward and a layer's recompute are never alive together
        add("trainer", "recomputed layer or lm head", max(act.layer, act.head),
            f"the larger of one layer recomputed ({act.layer / GIB:.2f} GiB) and the lm head ({act.head / GIB:.2f} GiB, "
            f"{head_note})")
    else:
        add("trainer", "lm head", act.head, head_note)
    # ids, 2 masks, log-probs, (versions); packed also segment_ids, row_rewards, row_group_index, row_truncated.
    token_bytes = 14 + (13 if packed else 0)
    add("trainer", "batch", rows // shards * length * token_bytes,
        "token arrays of the step" + (", packed (rollout.pack: worst case, no row saved)" if packed else ""))
    if model_cfg.scan_layers:  # scanned_layers stacks the layers' variables
        # What is stacked is the step's copy in the compute dtype (asyncrl/model/compute_copy.py). The
        # backward's stacked gradient is the micro-batch's gradient of those layers (counted above).
        stacked = stacked_layers(model_cfg)
        add("trainer", "stacked layers", int(base * stacked_share(model_cfg, params)) * c_bytes,
            f"model.scan_layers: a [layers, ...] copy of the weights of the {len(stacked)} layers in scans "
            f"({model_cfg.compute_dtype})")

    publish = 0
    if cfg.engine.remote is None:  # an SFT stage holds the engine too (its greedy eval; made at the run's start)
        lines.extend(_engine_lines(cfg, model_cfg, layout, params, base, adapters, p_bytes, c_bytes, backend))
        publish = _publish_bytes(model_cfg, params, layout, base, c_bytes)
    n_params = param_count(params)
    return MemoryPlan(tuple(lines), layout, stage, n_params, publish)


def micro_batch_rows(cfg: Config, rows: int, length: int, shards: int, minis: int) -> tuple[int, int, str]:
    """``(batch rows, rows per device per micro-batch, what sets them)`` of a step of ``rows`` rows
    of ``length``: ``optim.micro_batches`` splits each mini-batch's rows (padded to the trainer's
    row multiple, as ``prepare_batch`` pads them); by a token budget each micro-batch holds
    ``micro_batch_tokens // length`` packed rows per device (``micro_batches: auto`` not yet chosen:
    one row, its least; :func:`choose_micro_batch_tokens` chooses it)."""
    optim = cfg.optim
    if optim.by_tokens:
        rows = -(-rows // (shards * minis)) * shards * minis
        budget = optim.micro_batch_tokens
        per_device = max((budget or length) // length, 1)
        what = (f"a budget of {budget} tokens per device" if budget else "micro_batches: auto, at its least: one row")
        return rows, per_device, what
    micro = optim.micro_batch_count
    multiple = shards * minis * micro  # prepare_batch pads rows to the trainer's row multiple
    rows = -(-rows // multiple) * multiple
    return rows, rows // (minis * micro) // shards, f"{micro} micro-batches"


def _publish_bytes(model_cfg: Any, params: dict, layout: Layout, trainer_base: int, c_bytes: int) -> int:
    """What one engine device receives in a publish (:attr:`MemoryPlan.publish_bytes`): on the
    trainer's devices, every leaf gathered whole in the compute dtype but the device's own shard
    (:func:`~asyncrl.engine.device_copy.serving_copy` gathers before it splits for tensor
    parallelism); on devices of its own, its serving shard."""
    if layout.shares_trainer_arrays:
        return 0
    whole = param_count(params) * c_bytes
    if layout.colocated:
        return whole - trainer_base * c_bytes
    engine_base, _ = params_per_device(model_cfg, params, _mesh_view(layout.engine_replicas, 1, layout.tensor_parallel))
    return engine_base * c_bytes


TPU_LANES = 128
"""A TPU array's minor dimension is stored in tiles of 128 lanes (XLA's ``T(8,128)`` layouts)."""


def _tpu_relaid_table(model_cfg: Any, mesh: Any, backend: str, trained_in_a_loop: bool) -> int:
    """Elements per device of the padded copy XLA's TPU compiler makes of the tied embedding table,
    or 0. Read from the buffer assignment of Gemma 3 1B's full fine-tuning step on a ``v5e-8``
    (hidden 1,152 over fsdp 8: 144 columns per chip): the step's arguments arrive in the compact
    layout (vocabulary minor, ``{0,1}``), while the update loop carries the table, Adam's mu and
    nu as rows (``{1,0}``, the layout the vocabulary-parallel head reads), its 144 columns padded
    to 256 lanes: three 256 MiB copies beside the 144 MiB arguments. Where the columns fill whole
    lanes (Qwen3-1.7B's 2,048 over 8: 256) the two layouts hold the same bytes.

    Not all of what XLA copies into that loop: it also relays the layers' kernels whose per-device
    minor dimension is 144 (``o_proj [1024, 144]``, ``down_proj [6912, 144]``) with their moments
    (604 MiB padded), and copies some aligned ones, while the plan's other lines are above XLA's
    for that step by about as much (docs/performance.md "The formulas against XLA"). Extrapolated, not
    compiled: ``sgd`` (the table alone) and other vocabularies and widths."""
    from asyncrl.model.sharding import head_vocab_shards, partition_spec

    if (backend != "tpu" or not trained_in_a_loop or not model_cfg.tie_word_embeddings
            or head_vocab_shards(mesh.shape, model_cfg.vocab_size) == 1):
        return 0
    shape = (model_cfg.vocab_size, model_cfg.hidden_size)
    rows_axis, columns_axis = partition_spec(model_cfg, "embed_tokens.embedding", shape, mesh)
    rows, columns = (size // (mesh.shape[axis] if axis else 1) for size, axis in zip(shape, (rows_axis, columns_axis)))
    if columns_axis is None or columns % TPU_LANES == 0:
        return 0
    return rows * -(-columns // TPU_LANES) * TPU_LANES


def _engine_lines(cfg: Config, model_cfg: Any, layout: Layout, params: dict, base: int, adapters: int,
                  p_bytes: int, c_bytes: int, backend: str) -> list[Line]:
    """The engine's lines on ``layout``: on one device the trainer's arrays it serves (its cast copy
    where the compute dtype differs), else its serving copy on its own mesh (``replicas x
    tensor_parallel`` over its devices, the trainer's or its own); its KV page pool, one per replica
    (pages split over the replicas, KV heads over ``tensor``); the temporaries of its programs (one at
    a time)."""
    from asyncrl.cluster.placement import slots_for_replicas
    from asyncrl.engine.device_copy import COPY_GROUP_BYTES
    from asyncrl.engine.jax_programs import PREFILL_ROWS  # per replica: the rows each device prefills

    engine = cfg.engine
    tp, replicas = layout.tensor_parallel, layout.engine_replicas
    lora = cfg.model.lora is not None
    lines: list[Line] = []
    if layout.shares_trainer_arrays:  # one device: the engine serves the trainer's arrays
        replicas = 1
        if lora:
            lines.append(Line("engine", "weights", base * p_bytes, "LoRA merged for publishing", resident=True))
        if c_bytes != p_bytes:
            lines.append(Line("engine", "serving copy", base * c_bytes,
                              f"the weights in {model_cfg.compute_dtype}, cast at each publish", resident=True))
        serving = 0
    else:
        engine_base, _ = params_per_device(model_cfg, params, _mesh_view(replicas, 1, tp))
        serving = engine_base * c_bytes
        lines.append(Line("engine", "serving copy", serving, f"the weights in {model_cfg.compute_dtype} on the engine's mesh: "
                          f"{replicas} replica(s) x tensor_parallel {tp}", resident=True))
    slots = slots_for_replicas(planned_slots(cfg), replicas) // replicas
    page_size = engine_page_size(cfg, backend)
    pages_per_seq = engine.kv_capacity // page_size
    pages = planned_pages(cfg, page_size, slots)
    kv_heads = model_cfg.num_kv_heads // tp
    per_page = page_size * model_cfg.num_layers * 2 * kv_heads * model_cfg.head_dim * c_bytes
    layer_page = per_page // model_cfg.num_layers  # one layer's keys and values of a page
    mean = mean_tokens(cfg)
    vocab = model_cfg.vocab_size // tp if model_cfg.vocab_size % tp == 0 else model_cfg.vocab_size
    lines += [
        Line("engine", "KV cache", pages * per_page,
             f"a pool of {pages} pages of {page_size} tokens per replica x {model_cfg.num_layers} layers x 2 x {kv_heads} KV "
             f"heads x {model_cfg.head_dim} x {c_bytes} B: {pages // pages_per_seq} sequences at kv_capacity "
             f"{engine.kv_capacity}, {pages * page_size // mean} at the mean length {mean} (prompt + half the new tokens)"
             + ("; kept prefixes live in pages nobody runs on" if engine.prefix_cache.enabled else ""), resident=True),
        # The chunk's stop-id mask (bool [slots, vocab], asyncrl/engine/jax_programs.py) is carried through its loop.
        Line("engine", "decode step", decode_logit_copies(backend) * slots * vocab * 4 + slots * model_cfg.vocab_size,
             "float32 logits of one step, the slots' stop-id mask", program="decode_chunk"),
    ]
    if backend == "cpu":  # a chunk's view of the pages its slots read, every layer's (asyncrl/model/paged_attention.py)
        lines.append(Line("engine", "decode views", slots * pages_per_seq * per_page,
                          f"the chunk's copy of the pages its slots read, at most {slots} slots x {pages_per_seq} pages, "
                          "every layer", program="decode_chunk"))
    if serving and tp > 1:  # a publish gathers each group of leaves whole on every device, then keeps its shards
        largest = max(int(math.prod(x.shape)) for x in _leaves(params)) * c_bytes
        lines.append(Line("engine", "publish staging", min(max(COPY_GROUP_BYTES, largest), serving * tp),
                          "one group of published leaves gathered whole before its tensor-parallel split (the "
                          f"largest leaf, or {COPY_GROUP_BYTES >> 20} MiB of them)", program="publish"))
    if lora and not layout.shares_trainer_arrays:
        lines.append(Line("engine", "merged LoRA weights", base * p_bytes, "the adapters merged into the base for a publish",
                          program="publish"))
    rows = min(PREFILL_ROWS, slots)  # a chunk after cached pages reads each row's pages, one layer at a time
    lines.append(Line("engine", "prefill after cached pages", rows * pages_per_seq * layer_page,
                      f"{rows} rows' pages gathered (one layer) for a long prompt's later chunks or the rest after a "
                      "reused prefix", program="prefix_reuse"))
    return lines


def _leaves(tree: Any) -> list:
    import jax

    return jax.tree.leaves(tree)


def engine_page_size(cfg: Config, backend: Optional[str] = None) -> int:
    """``engine.page_size`` resolved for ``backend`` (:func:`~asyncrl.engine.layouts.page_size_for`)."""
    from asyncrl.engine.layouts import page_size_for

    return page_size_for(cfg.engine.page_size, resolve_backend(backend), cfg.engine.kv_capacity)


def mean_tokens(cfg: Config) -> int:
    """The stated mean length of a sequence the plan sizes the pool at: the prompt budget and half
    the new tokens (``data.max_prompt_tokens + rollout.max_new_tokens / 2``), at most
    ``engine.kv_capacity``."""
    return max(1, min(cfg.engine.kv_capacity, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens // 2))


def planned_pages(cfg: Config, page_size: int, rows_per_replica: int) -> int:
    """Pages of each replica's KV pool: ``engine.kv_pages``, or for ``auto`` (sized at start from
    the memory left) the most a replica's rows use: ``rows x kv_capacity / page_size``."""
    if isinstance(cfg.engine.kv_pages, int):
        return cfg.engine.kv_pages
    return rows_per_replica * (cfg.engine.kv_capacity // page_size)


def planned_slots(cfg: Config) -> int:
    """``engine.slots``, or for ``auto`` (sized at start: :mod:`asyncrl.run.auto_slots`) the fewest
    the run needs; :func:`run_plan` sizes ``auto`` first when given the device's memory."""
    return cfg.engine.slots if isinstance(cfg.engine.slots, int) else minimum_slots(cfg)


def stage_decoder_config(flat: Config, model_cfg: Any = None, backend: Optional[str] = None) -> Any:
    """The DecoderConfig of a stage's flat config: ``model_cfg`` (else ``model.path``'s config.json)
    with the ``model`` section's runtime options; ``compute_dtype: auto`` as on ``backend``
    (``cpu``, ``gpu``, ``tpu``; default: this machine's)."""
    from asyncrl.model.loading import runtime_options

    runtime = runtime_options(flat.model, backend)
    decoder = model_cfg if model_cfg is not None else read_decoder_config(flat.model.path)
    return decoder.replace(**runtime)


def plan_config(cfg: Config, devices: int = 1, processes: int = 1, model_cfg: Any = None,
                backend: Optional[str] = None) -> MemoryPlan:
    """The plan of the stage that needs the most memory per device (``model_cfg``: the
    model's :class:`~asyncrl.model.DecoderConfig`; read from ``model.path`` when None)."""
    layout = plan_layout(cfg, devices, processes)
    plans = []
    for stage, flat in cfg.stage_configs():
        decoder = stage_decoder_config(flat, model_cfg, backend)
        plans.append(plan_stage(flat, decoder, layout, abstract_params(decoder), stage.type == "sft", stage.name, backend))
    return max(plans, key=lambda plan: plan.total_bytes)


# --------------------------------------------------------------------------- engine.slots: auto


AUTO_SLOTS_HEADROOM = 0.9
"""``engine.slots: auto``: the share of the device's memory the plan may fill (:mod:`asyncrl.run.auto_slots`)."""
AUTO_SLOTS_ROUND_TO = 8


def minimum_slots(cfg: Config) -> int:
    """The fewest slots the run can work with: a group (``rollout.group_size``), and eval's beam width."""
    beam = cfg.eval.decoding.beam_width if cfg.eval.decoding.strategy == "beam" else 1
    return max(cfg.rollout.group_size, beam)


def with_tensor_parallel(cfg: Config, degree: int) -> Config:
    """``cfg`` with ``engine.tensor_parallel = degree``."""
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"tensor_parallel": degree})})


def tensor_parallel_degrees(cfg: Config, model_cfg: Any, devices: int, processes: int = 1) -> list[int]:
    """The tensor-parallel degrees the engine of ``cfg`` can take on ``devices`` devices, smallest
    first: those dividing its device count and the model's KV heads (whole heads per device)."""
    engine_devices = plan_layout(with_tensor_parallel(cfg, 1), devices, processes).engine_devices
    return [d for d in range(1, engine_devices + 1) if engine_devices % d == 0 and model_cfg.num_kv_heads % d == 0]


def at_least(cfg: Config, backend: Optional[str] = None) -> Config:
    """``cfg`` with ``engine.slots: auto`` at :func:`minimum_slots` and ``engine.kv_pages: auto`` at
    one sequence's longest context: the least engine the run can work with."""
    engine = cfg.engine
    update: dict[str, Any] = {}
    if engine.slots == "auto":
        update["slots"] = minimum_slots(cfg)
    if engine.kv_pages == "auto":
        update["kv_pages"] = engine.kv_capacity // engine_page_size(cfg, backend)
    return cfg.model_copy(update={"engine": engine.model_copy(update=update)}) if update else cfg


def concurrency(cfg: Config, devices: int, processes: int, backend: Optional[str] = None) -> int:
    """The sequences the engine of ``cfg`` (slots and pages numbers) decodes together at the
    stated mean length (:func:`mean_tokens`): its slots, or fewer where its pools hold fewer."""
    replicas = max(plan_layout(cfg, devices, processes).engine_replicas, 1)
    page_size = engine_page_size(cfg, backend)
    pages = planned_pages(cfg, page_size, planned_slots(cfg) // replicas)
    return min(planned_slots(cfg), replicas * (pages * page_size // mean_tokens(cfg)))


def choose_tensor_parallel(cfg: Config, budget: Optional[int], devices: int = 1, processes: int = 1, model_cfg: Any = None,
                           backend: Optional[str] = None) -> tuple[int, dict[int, int], dict[int, int]]:
    """``engine.tensor_parallel: auto``'s degree: of :func:`tensor_parallel_degrees` whose least engine
    (:func:`at_least`) fits ``budget`` bytes per device, the one that decodes the most sequences
    together once ``engine.slots`` and ``engine.kv_pages`` (``auto``) are sized in what it leaves
    (:func:`concurrency`), the smallest degree among equals (fewer collectives per step); without a
    budget the smallest; when none fits the largest (the least memory: the caller refuses it).
    Returns the degree, each degree's least total and each fitting degree's concurrency."""
    if model_cfg is None:
        model_cfg = stage_decoder_config(cfg, backend=backend)
    degrees = tensor_parallel_degrees(cfg, model_cfg, devices, processes)
    totals = {d: plan_config(at_least(with_tensor_parallel(cfg, d), backend), devices, processes, model_cfg,
                             backend).total_bytes for d in degrees}
    if budget is None:
        return degrees[0], totals, {}
    sequences: dict[int, int] = {}
    for d in degrees:
        if totals[d] <= budget:
            sized = size_engine(with_tensor_parallel(cfg, d), budget, devices, processes, model_cfg, backend)
            sequences[d] = concurrency(sized, devices, processes, backend)
    if not sequences:
        return degrees[-1], totals, sequences
    return max(sequences, key=lambda d: (sequences[d], -d)), totals, sequences


def with_slots(cfg: Config, slots: int) -> Config:
    """``cfg`` with ``engine.slots = slots`` (stages inherit the top-level engine section)."""
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"slots": slots})})


def with_pages(cfg: Config, pages: int) -> Config:
    """``cfg`` with ``engine.kv_pages = pages`` (per replica)."""
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"kv_pages": pages})})


def with_mean_pages(cfg: Config, slots: int, replicas: int = 1, backend: Optional[str] = None) -> Config:
    """``cfg`` with ``slots``, and with ``engine.kv_pages: auto`` at the pages those slots hold at the
    mean length (at least one longest context)."""
    cfg = with_slots(cfg, slots)
    if cfg.engine.kv_pages != "auto":
        return cfg
    page_size = engine_page_size(cfg, backend)
    per_seq = cfg.engine.kv_capacity // page_size
    return with_pages(cfg, max(per_seq, -(-slots // replicas) * -(-mean_tokens(cfg) // page_size)))


def slots_for_budget(cfg: Config, budget: int, devices: int = 1, processes: int = 1, model_cfg: Any = None,
                     backend: Optional[str] = None) -> int:
    """The most slots (:mod:`asyncrl.run.auto_slots` says within which bounds) whose plan of ``cfg``
    fits ``budget`` bytes per device, with ``engine.kv_pages: auto`` planned at the pages they hold
    at the stated mean length (:func:`mean_tokens`); a ConfigError naming ``engine.slots`` when
    even :func:`minimum_slots` does not."""
    replicas = max(plan_layout(cfg, devices, processes).engine_replicas, 1)
    total = lambda slots: plan_config(with_mean_pages(cfg, slots, replicas, backend), devices, processes, model_cfg,  # noqa: E731
                                      backend).total_bytes
    least = minimum_slots(cfg)
    least = -(-least // replicas) * replicas
    most = max(cfg.rollout.max_concurrent * cfg.rollout.group_size, least)
    step = AUTO_SLOTS_ROUND_TO * replicas
    counts = sorted({least, most, *range(step, most + 1, step)} & set(range(least, most + 1)))
    if total(least) > budget:
        raise ConfigError([f"engine.slots: auto: the {minimum_slots(cfg)} slots the run needs (rollout.group_size, eval's "
                           f"beam width) take {total(least) / GIB:.2f} GiB per device with the trainer, over the "
                           f"{budget / GIB:.2f} GiB budget; lower engine.kv_capacity or the trainer's memory (asyncrl plan "
                           "--device-memory lists changes), or give a number"])
    lo, hi = 0, len(counts) - 1  # counts[lo] fits; find the last that does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if total(counts[mid]) <= budget else (lo, mid - 1)
    return int(counts[lo])


def pages_for_budget(cfg: Config, budget: int, devices: int = 1, processes: int = 1, model_cfg: Any = None,
                     backend: Optional[str] = None) -> int:
    """``engine.kv_pages: auto`` for ``cfg`` (a number of slots): the most pages per replica whose plan
    fits ``budget`` bytes per device, at most the slots' longest contexts (``rows x kv_capacity /
    page_size``, more would hold only kept prefixes); a ConfigError naming ``engine.kv_pages`` when
    not even one longest context fits."""
    replicas = max(plan_layout(cfg, devices, processes).engine_replicas, 1)
    page_size = engine_page_size(cfg, backend)
    per_seq = cfg.engine.kv_capacity // page_size
    most = max(per_seq, -(-planned_slots(cfg) // replicas) * per_seq)
    total = lambda pages: plan_config(with_pages(cfg, pages), devices, processes, model_cfg, backend).total_bytes  # noqa: E731
    at_least_one = total(per_seq)
    per_page = total(per_seq + 1) - at_least_one
    if at_least_one > budget:
        raise ConfigError([f"engine.kv_pages: auto: one sequence's longest context ({per_seq} pages of {page_size} tokens, "
                           f"engine.kv_capacity {cfg.engine.kv_capacity}) takes the plan to {at_least_one / GIB:.2f} GiB "
                           f"per device, over the {budget / GIB:.2f} GiB budget; lower engine.kv_capacity, engine.slots or "
                           "the trainer's memory (asyncrl plan --device-memory lists changes)"])
    fitting = per_seq + (budget - at_least_one) // per_page if per_page > 0 else most
    return int(min(fitting, most))


def size_engine(cfg: Config, budget: int, devices: int = 1, processes: int = 1, model_cfg: Any = None,
                backend: Optional[str] = None) -> Config:
    """``cfg`` with ``engine.slots: auto`` (:func:`slots_for_budget`), then ``engine.kv_pages: auto``
    (:func:`pages_for_budget`, in what the slots leave) sized for ``budget`` bytes per device."""
    if cfg.engine.slots == "auto":
        cfg = with_slots(cfg, slots_for_budget(cfg, budget, devices, processes, model_cfg, backend))
    if cfg.engine.kv_pages == "auto":
        cfg = with_pages(cfg, pages_for_budget(cfg, budget, devices, processes, model_cfg, backend))
    return cfg


# --------------------------------------------------------------------------- optim.micro_batches: auto


def with_micro_batch_tokens(cfg: Config, tokens: int) -> Config:
    """``cfg`` with micro-batches of ``tokens`` tokens per device (``optim.micro_batch_tokens``)."""
    return cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"micro_batch_tokens": tokens})})


MICRO_BATCH_TOKENS_CAP = 32768
"""``optim.micro_batches: auto`` takes at most this many tokens per micro-batch and device (or one
row, where a row is longer): a micro-batch's matmuls are ``[tokens, hidden] x [hidden, n]``, which
fill an accelerator long before this (verl's default budget is 16,384 tokens per GPU), while every
token more is memory the engine's KV cache could hold."""


def micro_batch_budgets(cfg: Config, row_shards: int, sft: bool = False) -> list[int]:
    """The token budgets ``optim.micro_batches: auto`` may take, largest (fewest micro-batches) first:
    whole rows of the longest length (:attr:`~asyncrl.config.Config.longest_row`), from every row of
    a mini-batch on one device's share in one micro-batch (at most :data:`MICRO_BATCH_TOKENS_CAP`
    tokens) down to one row."""
    rows = cfg.sft.batch_size if sft else cfg.rollout.batch_size * cfg.rollout.group_size
    per_mini = -(-rows // (1 if sft else cfg.algo.mini_batches))
    most = max(min(-(-per_mini // row_shards), MICRO_BATCH_TOKENS_CAP // cfg.longest_row), 1)
    return [k * cfg.longest_row for k in range(most, 0, -1)]


def choose_micro_batch_tokens(cfg: Config, budget: int, devices: int = 1, processes: int = 1, model_cfg: Any = None,
                              backend: Optional[str] = None, sft: bool = False) -> tuple[int, int, bool]:
    """``optim.micro_batches: auto``'s token budget per micro-batch and device: the largest of
    :func:`micro_batch_budgets` whose plan of ``cfg`` (one stage's flat config) fits ``budget``
    bytes per device, with the engine as the run sizes it first (``engine.slots: auto`` with the
    trainer at its least, one row per micro-batch: the engine's slots come before the trainer's
    micro-batch size, which the rest of the memory then sets). Returns ``(tokens, plan bytes, fits)``;
    when even one row does not fit, one row, not fitting."""
    layout = plan_layout(cfg, devices, processes)
    decoder = stage_decoder_config(cfg, model_cfg, backend)
    params = abstract_params(decoder)
    if cfg.engine.slots == "auto" and cfg.engine.remote is None:
        try:
            cfg = with_slots(cfg, slots_for_budget(cfg, budget, devices, processes, model_cfg, backend))
        except ConfigError:  # the engine's own start refuses it with its line; plan the trainer beside its least
            cfg = with_slots(cfg, minimum_slots(cfg))

    def total(tokens: int) -> int:
        return plan_stage(with_micro_batch_tokens(cfg, tokens), decoder, layout, params, sft, "plan", backend).total_bytes

    budgets = micro_batch_budgets(cfg, layout.row_shards, sft)[::-1]  # smallest first: the plan grows with them
    low, high = 0, len(budgets) - 1
    if total(budgets[0]) > budget:
        return budgets[0], total(budgets[0]), False
    while low < high:  # the largest index that fits
        middle = (low + high + 1) // 2
        if total(budgets[middle]) <= budget:
            low = middle
        else:
            high = middle - 1
    return budgets[low], total(budgets[low]), True
