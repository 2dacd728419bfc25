"""``asyncrl plan CONFIG --target NAME``: the run's real programs compiled for the GPU or TPU it
will rent, on this machine, and what XLA says of them.

The command runs in a process of its own (:func:`run_plan_target` starts it): the compile-only
devices need ``JAX_PLATFORMS=cpu``, and XLA reads its flags (the GPU dump, the engine's
command-buffer flags of :mod:`asyncrl.engine.platform`, forced host devices for ``cpu``) once,
when the backend starts. Nothing is allocated and nothing is downloaded. In that process
(:func:`target_reports`), for each stage of CONFIG and on the config's mesh laid over the
target's devices (:mod:`asyncrl.plan.targets`; the engine on the trainer's arrays or, with split
placement, on its own mesh):

* ``train_step`` at the predicted first batch shape (:func:`~asyncrl.trainer.precompile.expected_first_shape`;
  with ``rollout.pack`` the packed worst case, every sequence in a row of its own); with
  ``algo.estimator: gae`` the same one program also runs the critic and is reported as ``critic_step``;
* the engine's ``prefill`` at each prompt bucket, its ``decode_chunk`` (on the CPU over its largest view),
  ``beam_search`` when eval decodes with beams, and ``publish`` (the largest of the programs that
  lay the trainer's arrays out as the engine's serving copy at each publish, with the seconds the
  plan gives it at the target's interconnect), on the engine's own mesh over its devices;
* ``device_total``: the trainer's and the engine's resident state (their programs' arguments) and
  the larger transient, as one device holds them (``--program NAME``, repeatable: only those).

On a multi-host target (``v6e-32``: 8 hosts of 4 chips) every host runs an engine of its own on its
chips, so the engine's programs are compiled for one host's chips (a topology of that host alone,
:func:`~asyncrl.plan.targets.host_devices`) and the publish is the collective that lays the
trainer's weights out on every host's engine; where the compiler refuses a host's topology, one
line says why, with the plan's per-host figure.

Per program it prints XLA's per-device arguments, outputs, aliased and temporary bytes and the
peak they add up to, the plan's estimate of the same program (:mod:`asyncrl.plan.formulas`),
the verdict against the target's memory and the compile seconds here; for a GPU decode chunk the
launch structure read from XLA's thunk sequence dump (:mod:`asyncrl.plan.thunk_sequence`).
``--json``: one object per line and program (:meth:`ProgramReport.as_json`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from asyncrl.config import Config, load_config
from asyncrl.errors import ConfigError
from asyncrl.plan.activations import DTYPE_BYTES
from asyncrl.plan.compiled import (
    CompiledMemory,
    compile_lowered,
    engine_args,
    lower_beam_search,
    lower_decode_chunk,
    lower_host_publish,
    lower_prefill,
    lower_publish,
    lower_train_step,
    train_shape,
)
from asyncrl.plan.formulas import (
    GIB,
    MemoryPlan,
    abstract_params,
    plan_layout,
    plan_stage,
    stage_decoder_config,
)
from asyncrl.plan.programs import stage_programs
from asyncrl.plan.targets import (
    Target,
    check_plugin,
    device_memory_bytes,
    get_target,
    host_devices,
    target_devices,
    target_env,
    target_topology,
)
from asyncrl.plan.thunk_sequence import DecodeStructure, decode_structure

CHILD_ENV = "ASYNCRL_PLAN_TARGET_CHILD"
"""Set in the compiling process :func:`run_plan_target` starts (its value: the dump directory, or
``-`` for none)."""
THUNK_DUMP_SUFFIX = "thunk_sequence_after_thunk_passes.txt"


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """One compiled program of one stage."""

    program: str
    """``train_step``, ``critic_step``, ``prefill``, ``decode_chunk``, ``beam_search``, ``publish``, or
    ``device_total`` (a stage's resident state and its largest transient: :func:`_device_total`)."""
    stage: str
    detail: str
    """What distinguishes it among its kind: the batch shape, the bucket."""
    target: str
    devices: int
    memory: CompiledMemory
    plan_bytes: Optional[int]
    """The plan's estimate of the same program's per-device peak (None: the plan has no figure for it)."""
    compile_s: float
    device_memory: int
    decode: Optional[DecodeStructure] = None
    attention: tuple[str, ...] = ()
    """The several-token attention kernels the program took (:func:`~asyncrl.model.attention.kernels_seen`):
    ``cudnn row lengths``, ``cudnn packed layout``, ``splash``, ``splash segment ids``, ``xla dense mask``, ..."""

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.device_memory

    def as_json(self) -> dict[str, Any]:
        """The ``--json`` object: the issue's fields, decode structure on a GPU decode chunk."""
        out: dict[str, Any] = {
            "program": self.program, "stage": self.stage, "detail": self.detail, "target": self.target,
            "devices": self.devices, "xla_argument_bytes": self.memory.arguments, "xla_output_bytes": self.memory.outputs,
            "xla_alias_bytes": self.memory.aliased, "xla_temp_bytes": self.memory.temporaries,
            "xla_peak_bytes": self.memory.peak, "plan_bytes": self.plan_bytes, "device_memory_bytes": self.device_memory,
            "fits": self.fits, "compile_s": round(self.compile_s, 2),
        }
        if self.attention:
            out["attention"] = list(self.attention)
        if self.memory.reported_peak:
            out["xla_reported_peak_bytes"] = self.memory.reported_peak
        if self.decode is not None:
            d = self.decode
            out.update(kernels_per_step=d.kernels_per_step, kernels_per_layer=d.kernels_per_layer,
                       kernels_outside_layers=d.kernels_outside_layers, steps_per_iteration=d.steps_per_iteration,
                       host_round_trips_per_token=d.host_round_trips_per_token,
                       body_in_command_buffer=d.body_in_command_buffer, while_in_command_buffer=d.while_in_command_buffer,
                       condition_kernels=d.condition_kernels, kernels_outside_loop=d.kernels_outside_loop)
        return out


# --------------------------------------------------------------------------- the plan's figure per program


def _line(plan: MemoryPlan, part: str, name: str) -> int:
    return sum(line.bytes for line in plan.lines if line.part == part and line.name == name)


def plan_bytes_for(program: str, plan: MemoryPlan, cfg: Config, model_cfg: Any, beam_capacity: int = 0) -> Optional[int]:
    """The plan's estimate of one program's per-device peak: the trainer's total for the train
    step (the plan does not count a critic: ``critic_step`` gets the same figure), the engine's
    resident state and its decode temporaries for prefill and decode, the engine's weights and a
    ``beam_width x beam_capacity`` cache for a beam search. Where the engine serves the trainer's
    own arrays the weights it reads are the trainer's parameters (the plan's table counts them
    once, as the trainer's)."""
    if program in ("train_step", "critic_step"):
        return plan.part_bytes("trainer")
    # The weights an engine program reads: its serving copy, its own weights, or (serving the
    # trainer's arrays in their own dtype) the trainer's parameters, which the plan counts there.
    weights = _line(plan, "engine", "serving copy") + _line(plan, "engine", "weights")
    shared = 0 if weights else _line(plan, "trainer", "parameters")
    if program in ("prefill", "decode_chunk"):
        return plan.resident_bytes("engine") + plan.program_bytes("decode_chunk") + shared
    if program == "beam_search":
        c = DTYPE_BYTES[model_cfg.compute_dtype]
        kv_heads = model_cfg.num_kv_heads // max(plan.layout.tensor_parallel, 1)
        width = cfg.eval.decoding.beam_width
        return weights + shared + width * beam_capacity * (model_cfg.num_layers * 2 * kv_heads * model_cfg.head_dim * c + 1)
    return None


# --------------------------------------------------------------------------- what is compiled


def target_reports(cfg: Config, target: Target, devices: int, hosts: int, dump_dir: Optional[Path] = None,
                   programs: Sequence[str] = ()) -> Iterator[ProgramReport]:
    """Compile every program of every stage of ``cfg`` for ``target`` (``devices`` over ``hosts``;
    ``programs``: only these), yielding each report as it is done, then per stage the device total
    (``device_total``: XLA's figures of the stage's resident state and its programs' transients, as
    :func:`~asyncrl.plan.command.xla_device_total` adds them, where the train step and a decode
    chunk were compiled). Run where :func:`~asyncrl.plan.targets.target_env` set the environment
    (the compiling process); ``dump_dir``: XLA's dump directory (GPU targets), read after each
    decode chunk's compile."""
    from asyncrl.cluster.placement import resolve_placement

    found = target_devices(target, devices, hosts)
    memory = device_memory_bytes(target)
    wanted = lambda program: not programs or program in programs  # noqa: E731
    for stage in stage_programs(cfg):
        flat, sft = stage.flat, stage.sft
        layout = _layout(flat, target, devices, hosts)
        model_cfg = stage_decoder_config(flat, backend=target.platform)
        plan = plan_stage(flat, model_cfg, layout, abstract_params(model_cfg), sft, stage.stage.name, target.platform)
        placement = resolve_placement(flat, found, hosts)
        report = _reporter(stage.stage.name, target, devices, memory)
        compiled: dict[str, Any] = {}
        if wanted(stage.train):
            shape = train_shape(flat, sft, layout.row_shards, hosts)
            rows, length, window = shape
            lowered = _lower(stage.train, target, lower_train_step, flat, model_cfg, placement.trainer_devices, shape, sft)
            done = report(stage.train, f"{rows} x {length} rows, window {window}" + (", packed worst case" if flat.packs
                                                                                     else ""),
                          lowered, plan_bytes_for(stage.train, plan, flat, model_cfg))
            compiled["trainer"] = done.memory
            yield done
        if not stage.engine:
            continue
        if hosts == 1:
            engine = engine_args(flat, model_cfg, placement, target.platform)
        else:  # each host's engine, compiled for that host's chips alone
            try:
                engine = engine_args(flat, model_cfg, _one_host(placement, found, host_devices(target, devices, hosts)),
                                     target.platform)
            except Exception as err:  # noqa: BLE001 - the compiler's refusal, in one line with the plan's figure
                yield _refused(stage.stage.name, target, devices, memory, plan, flat, model_cfg, err)
                continue
        buckets = sorted(b for b in set(flat.engine.prefill_buckets) if b <= flat.engine.kv_capacity)
        if wanted("prefill"):
            for bucket in buckets:
                lowered = _lower("prefill", target, lower_prefill, flat, engine, bucket)
                yield report("prefill", f"bucket {bucket}", lowered, plan_bytes_for("prefill", plan, flat, model_cfg))
        if wanted("decode_chunk"):
            for size in engine.flat_sizes[-1:] or (0,):  # the CPU's largest view (the most memory)
                before = _dumped(dump_dir)
                lowered = _lower("decode_chunk", target, lower_decode_chunk, flat, engine)
                listed = f", attention over a view of {engine.pages_per_seq} pages per slot" if size else ""
                done = report("decode_chunk", f"{engine.slots} slots, {engine.pages_per_replica} pages of {engine.page_size} per "
                              f"replica{listed}, {flat.engine.decode_chunk} steps, {engine.sampler}", lowered,
                              plan_bytes_for("decode_chunk", plan, flat, model_cfg))
                compiled["engine"] = max(compiled.get("engine", done.memory), done.memory, key=lambda m: m.peak)
                yield dataclasses.replace(done, decode=_decode_structure(dump_dir, before, model_cfg.num_layers))
        if flat.eval.decoding.strategy == "beam" and wanted("beam_search"):
            bucket = buckets[-1]
            capacity = bucket + flat.rollout.max_new_tokens
            lowered = _lower("beam_search", target, lower_beam_search, flat, engine, bucket)
            yield report("beam_search", f"width {flat.eval.decoding.beam_width}, prompt bucket {bucket}", lowered,
                         plan_bytes_for("beam_search", plan, flat, model_cfg, capacity))
        publish = None
        if wanted("publish"):
            publish = (lower_publish(flat, model_cfg, placement, engine) if hosts == 1
                       else _lower("publish", target, lower_host_publish, flat, model_cfg, placement))
        if publish is not None:
            lowered, what = publish
            done = report("publish", what, lowered, None)
            seconds = plan.publish_seconds(target.interconnect_gb_s)
            yield dataclasses.replace(done, detail=done.detail + (f"; {plan.publish_bytes / GIB:.2f} GiB received per engine "
                                                                  f"device, ~{seconds:.2f} s at {target.interconnect_gb_s:g} "
                                                                  "GB/s" if seconds is not None else ""))
        if "trainer" in compiled and "engine" in compiled:
            yield _device_total(stage.stage.name, target, devices, memory, plan, compiled)


def _one_host(placement: Any, found: Sequence[Any], host: Sequence[Any]) -> Any:
    """``placement`` (process 0's, on the whole target) with its engine on ``host``: one host's
    compile-only devices, the engine's devices at the same places among them as among process 0's."""
    local = [d for d in found if d.process_index == 0]
    engine = tuple(host[local.index(d)] for d in placement.engine_devices)
    return dataclasses.replace(placement, trainer_devices=tuple(host), engine_devices=engine, shares_trainer_arrays=False)


def _refused(stage: str, target: Target, devices: int, memory: int, plan: MemoryPlan, cfg: Config, model_cfg: Any,
             err: BaseException) -> ProgramReport:
    """The one row of a stage whose per-host engine the compiler refuses: why, and the plan's per-host
    figure of the engine (its resident state and its decode temporaries, per chip)."""
    first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)[:200]
    figure = plan_bytes_for("decode_chunk", plan, cfg, model_cfg) or 0
    what = (f"the engine programs of one host ({devices // plan.layout.processes} chips) are not compiled: "
            f"{_plugin_name(target)} refuses that compile-only topology ({type(err).__name__}: {first}); the plan's "
            f"per-host figure: {figure / GIB:.2f} GiB per chip for the engine")
    return ProgramReport("engine", stage, what, target.name, devices, CompiledMemory(0, 0, 0, 0), figure, 0.0, memory)


def _plugin_name(target: Target) -> str:
    return "libtpu" if target.platform == "tpu" else "the CUDA plugin" if target.platform == "gpu" else "XLA"


def _device_total(stage: str, target: Target, devices: int, memory: int, plan: MemoryPlan, compiled: dict[str, Any]) -> ProgramReport:
    """The stage's device total as a report row: XLA's figures of its resident state (the train step's
    and the decode chunk's arguments) and its largest transient, beside the plan's total."""
    from asyncrl.plan.command import xla_device_total

    total = xla_device_total(plan, compiled)
    assert total is not None
    resident = compiled["trainer"].arguments + compiled["engine"].arguments
    figures = CompiledMemory(arguments=resident, outputs=0, aliased=0, temporaries=total - resident)
    what = ("trainer's and engine's resident state + the larger transient" if plan.layout.colocated
            else "the larger of the trainer's and the engine's devices")
    return ProgramReport("device_total", stage, what, target.name, devices, figures, plan.total_bytes, 0.0, memory)


def _layout(cfg: Config, target: Target, devices: int, hosts: int) -> Any:
    """The stage's layout on the target's devices (one-line errors naming the target), after
    refusing what the compiled programs do not yet cover."""
    if cfg.critic is not None and cfg.critic.lora is not None:
        raise ConfigError("critic.lora: --target compiles a fully trained critic only so far (its frozen base and adapters "
                          "are not laid out here); asyncrl plan without --target gives the analytic figures")
    try:
        return plan_layout(cfg, devices, hosts)
    except ConfigError as err:
        raise ConfigError(f"--target {target.name} ({devices} devices): {'; '.join(err.problems)}") from None


def _lower(program: str, target: Target, lower: Any, *args: Any) -> Any:
    """``lower(*args)``, with a program JAX or XLA rejects reported in one line; the attention
    kernels it took (:func:`~asyncrl.model.attention.kernels_seen`) are kept on the result as
    ``asyncrl_attention`` (a ``Lowered`` takes attributes)."""
    from asyncrl.model.attention import kernels_seen

    try:
        with kernels_seen() as seen:
            lowered = lower(*args)
        lowered.asyncrl_attention = tuple(sorted(seen))
        return lowered
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - the compiler's error, reported in one line
        raise ConfigError(_rejected(program, target, err)) from None


def _rejected(program: str, target: Target, err: BaseException) -> str:
    first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
    return (f"{program}: rejected for --target {target.name} ({type(err).__name__}: {first[:300]}); change the config's "
            "mesh, model or engine settings for this target, or pick another --target")


def _reporter(stage: str, target: Target, devices: int, memory: int) -> Any:
    def report(program: str, detail: str, lowered: Any, plan_bytes: Optional[int]) -> ProgramReport:
        try:
            compiled, seconds = compile_lowered(lowered)
        except Exception as err:  # noqa: BLE001 - the compiler's error, reported in one line
            raise ConfigError(_rejected(program, target, err)) from None
        attention = tuple(getattr(lowered, "asyncrl_attention", ()))
        return ProgramReport(program, stage, detail, target.name, devices, compiled, plan_bytes, seconds, memory,
                             attention=attention)

    return report


def _dumped(dump_dir: Optional[Path]) -> set[Path]:
    return set(dump_dir.glob(f"*{THUNK_DUMP_SUFFIX}")) if dump_dir is not None else set()


def _decode_structure(dump_dir: Optional[Path], before: set[Path], num_layers: int) -> Optional[DecodeStructure]:
    """The decode structure of the thunk sequence the last compile dumped (GPU targets)."""
    new = sorted(p for p in _dumped(dump_dir) - before if "decode_chunk" in p.name)
    return decode_structure(new[-1].read_text(), num_layers) if new else None


# --------------------------------------------------------------------------- output


def format_report(r: ProgramReport, scale: int = GIB) -> str:
    """One program's row (``scale``: GiB or MiB per device) and, for a GPU decode chunk, its launch structure."""
    g = lambda n: f"{n / scale:7.2f}"  # noqa: E731
    m = r.memory
    plan = f"{g(r.plan_bytes)} {r.plan_bytes / m.peak:5.2f}" if r.plan_bytes and m.peak else f"{'-':>7} {'-':>5}"
    row = (f"{r.stage:<6} {r.program:<12} {g(m.arguments)} {g(m.outputs)} {g(m.aliased)} {g(m.temporaries)} {g(m.peak)} "
           f"{plan}  {'fits' if r.fits else 'NO':<4} {r.compile_s:6.1f}  {r.detail}"
           + (f"; attention: {', '.join(r.attention)}" if r.attention else ""))
    if r.decode is not None:
        row += "\n" + " " * 20 + r.decode.summary()
    return row


def report_header(cfg: Config, target: Target, devices: int, hosts: int, unit: str = "GiB") -> str:
    memory = device_memory_bytes(target)
    return (f"asyncrl plan --target {target.name}: {cfg.model.path} on {devices} x {target.description} over {hosts} host(s), "
            f"{memory / GIB:.2f} GiB per device; per device ({unit}): XLA's figures of each program compiled here, "
            "the plan's estimate of it and their ratio\n"
            f"{'stage':<6} {'program':<12} {'args':>7} {'out':>7} {'alias':>7} {'temp':>7} {'peak':>7} {'plan':>7} "
            f"{'p/XLA':>5}  {'':<4} {'comp s':>6}  what")


def compile_and_print(config: str, overrides: Sequence[str], target_name: str, devices: Optional[int],
                      processes: Optional[int], as_json: bool, dump_dir: Optional[Path], programs: Sequence[str] = ()) -> int:
    """The compiling process's work: every program compiled (``programs``: only these), a row (or
    JSON line) each as it is done; 0 when every program and the device total fit the target's
    memory, 1 otherwise."""
    from asyncrl.plan.command import plan_auto_choices, plan_auto_micro_batches

    cfg = load_config(config, overrides)
    target = get_target(target_name)
    count, hosts = target_topology(target, devices, processes)
    # As a run: the engine's choices, the remat policy (at the least micro-batch), then the micro-batch budget.
    cfg = plan_auto_choices(cfg, device_memory_bytes(target), count, hosts, target.platform, micro_batches=False)
    from asyncrl.plan.auto import resolve_for_target
    from asyncrl.plan.formulas import plan_config

    try:
        cfg, auto_line = resolve_for_target(config, overrides, cfg, target, count, hosts)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - a compile of the choice's measurement, reported in one line
        raise ConfigError(_rejected("model.remat_policy / model.logprob_chunk_size: auto (its measuring compile)",
                                    target, err) + "; or set both explicitly") from None
    if auto_line is not None:
        print(f"asyncrl plan: {auto_line}", file=sys.stderr if as_json else sys.stdout, flush=True)
    cfg = plan_auto_micro_batches(cfg, device_memory_bytes(target), count, hosts, target.platform)
    large = plan_config(cfg, count, hosts, backend=target.platform).total_bytes >= GIB
    unit, scale = ("GiB", GIB) if large else ("MiB", 2**20)
    if not as_json:
        print(report_header(cfg, target, count, hosts, unit), flush=True)
    fits = True
    for report in target_reports(cfg, target, count, hosts, dump_dir, programs):
        fits = fits and report.fits
        print(json.dumps(report.as_json()) if as_json else format_report(report, scale), flush=True)
    return 0 if fits else 1


# --------------------------------------------------------------------------- the command


def run_plan_target(config: str, overrides: Sequence[str], target_name: str, devices: Optional[int] = None,
                    processes: Optional[int] = None, as_json: bool = False, keep_dump: Optional[str] = None,
                    programs: Sequence[str] = ()) -> int:
    """``asyncrl plan CONFIG --target NAME``: checks what it can here (the target, its plugin, the
    device count), then compiles in a process of its own with the target's environment
    (:func:`~asyncrl.plan.targets.target_env`; on GPUs also XLA's dump and the engine's
    command-buffer flags) and passes its output and exit status on. ``keep_dump``: a directory
    for XLA's dump (default: a temporary one, removed)."""
    if os.environ.get(CHILD_ENV):
        given = os.environ[CHILD_ENV]
        return compile_and_print(config, overrides, target_name, devices, processes, as_json,
                                 None if given == "-" else Path(given), programs)
    target = get_target(target_name)
    count, hosts = target_topology(target, devices, processes)
    check_plugin(target)
    cfg = load_config(config, overrides)  # config and layout errors are reported here, before a compiler starts
    for _, flat in cfg.stage_configs():
        _layout(flat, target, count, hosts)
    with tempfile.TemporaryDirectory(prefix="asyncrl-plan-dump-") as tmp:
        dump = Path(keep_dump) if keep_dump else Path(tmp)
        env = target_env(target, count)
        if target.platform == "gpu":
            from asyncrl.engine.platform import merge_xla_flags, xla_flags_for

            flags = [f"--xla_dump_to={dump}", "--xla_dump_hlo_module_re=.*decode_chunk.*", *xla_flags_for("gpu")]
            env["XLA_FLAGS"] = merge_xla_flags(env.get("XLA_FLAGS", ""), flags)
        env[CHILD_ENV] = str(dump) if target.platform == "gpu" else "-"
        argv = [sys.executable, "-m", "asyncrl.cli", "plan", config, *(a for o in overrides for a in ("--set", o)),
                "--target", target.name, "--devices", str(count), "--processes", str(hosts), *(["--json"] if as_json else []),
                *(a for p in programs for a in ("--program", p))]
        return _run_forwarding(argv, env)


def _run_forwarding(argv: list[str], env: dict[str, str]) -> int:
    """Run ``argv``, its stdout and stderr passed on line by line to this process's (so callers
    in this process, tests included, see the output) and its exit status returned. The process
    compiles for minutes on large models: no timeout, it ends when it is done or interrupted."""
    import threading

    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdout is not None and proc.stderr is not None

    def forward_stderr(stream: Any) -> None:
        for line in stream:
            sys.stderr.write(line)

    errors = threading.Thread(target=forward_stderr, args=(proc.stderr,), name="asyncrl-plan-stderr", daemon=True)
    errors.start()
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
    except KeyboardInterrupt:
        proc.terminate()
        raise
    code = proc.wait()
    errors.join(timeout=10)
    return code
