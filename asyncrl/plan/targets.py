"""The machines ``asyncrl plan --target NAME`` compiles for, and compile-only devices of them.

JAX compiles for an accelerator without one: the CUDA plugin makes compile-only GPUs from a GPU
target description (a ``GpuTargetConfig`` in protobuf text form: compute capability, SMs,
memory, bandwidth), libtpu makes compile-only TPU chips from a topology name (``v6e:2x4``), and
``jax.jit(f).lower(abstract arguments sharded over them).compile()`` then runs XLA's real GPU or
TPU pipeline on this CPU (nothing is allocated). The targets are a table shipped as data,
``asyncrl/plan/target_specs/``: ``targets.yaml`` (name, platform, libtpu topology, chips, hosts,
memory per chip; sources in its comments) and one description file per GPU (``h100.txtpb``...,
each with the source of its figures). ``cpu`` is this machine's CPU with forced host devices
(``--xla_force_host_platform_device_count``), so the whole machinery runs in every test.

Entry points:

* :func:`target_names` / :func:`get_target`: the table; an unknown name is a one-line error
  listing the names.
* :func:`check_plugin`: a one-line error saying what to install (into a venv of its own: with
  the CUDA plugin installed jax expects a GPU) when this Python cannot compile for the target.
* :func:`target_topology`: ``(target, device count, hosts)`` resolved from ``--devices`` and
  ``--processes`` (GPUs: up to ``gpus_per_host`` on one host, more over several; TPUs: the
  slice's chips and hosts; cpu: one host).
* :func:`target_devices`: the compile-only devices (GPU topology ``1x1xN`` for N GPUs of one
  host, ``Hx1xN/H`` over H hosts; TPU from the topology name; cpu: this process's CPU devices),
  with one-line errors for a topology the installed plugin does not know; :func:`host_devices`
  those of one host of a multi-host target (where each host's engine programs compile).
* :func:`gpu_target_config`: the description text of a GPU target: where a GPU of that model is
  attached, the one JAX reports for it (``get_topology_for_devices(...).target_config``),
  else the shipped file.
* :func:`device_memory_bytes`: the memory of one device of the target.
* :func:`target_env`: the environment a process compiling for the target needs, set before
  jax starts a backend (``JAX_PLATFORMS=cpu``, forced host devices for ``cpu``, libtpu's
  host lookup silenced and its one-process lock lifted: compile-only chips are driven by no one).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

from asyncrl.errors import ConfigError

SPECS = Path(__file__).with_name("target_specs")
"""The shipped table: ``targets.yaml`` and the GPU description files."""

GIB = 2**30
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12", "jax_cuda13_plugin", "jax_cuda12_plugin")
AOT_VENVS = {"gpu": "~/.cache/asyncrl-aot-cuda", "tpu": "~/.cache/asyncrl-aot-tpu"}
"""Where the docs suggest the compile-only venvs (docs/performance.md "Compiled for the target")."""
_INSTALL = {"gpu": ("jax's CUDA plugin", "cuda", "about 4 GB"), "tpu": ("libtpu", "tpu", "0.7 GB")}


@dataclasses.dataclass(frozen=True)
class Target:
    """One row of ``targets.yaml``."""

    name: str
    platform: str
    """``gpu``, ``tpu`` or ``cpu``."""
    description: str
    spec: Optional[str] = None
    """GPU: the description file (in :data:`SPECS`)."""
    gpus_per_host: int = 8
    topology: Optional[str] = None
    """TPU: libtpu's topology name."""
    chip_config: str = "default"
    """TPU: ``megacore`` (one device per chip of two TensorCores) or ``default``."""
    chips_per_host_bounds: tuple[int, ...] = ()
    chips: int = 1
    """TPU: chips (JAX devices) of the slice."""
    hosts: int = 1
    """TPU: hosts (processes) of the slice."""
    memory_gib: Optional[float] = None
    """TPU: HBM per chip."""
    interconnect_gb_s: Optional[float] = None
    """What one device receives per second from the others (GB/s: its NVLink, ICI links or PCIe, one
    direction): the plan's publish seconds."""


@functools.lru_cache(maxsize=1)
def _table() -> dict[str, Target]:
    import yaml

    rows = yaml.safe_load((SPECS / "targets.yaml").read_text())
    out = {}
    for name, row in rows.items():
        row = dict(row)
        if "chips_per_host_bounds" in row:
            row["chips_per_host_bounds"] = tuple(row["chips_per_host_bounds"])
        out[name] = Target(name=name, **row)
    return out


def target_names() -> list[str]:
    """The names ``--target`` accepts, in the table's order (GPUs, TPUs, cpu)."""
    return list(_table())


def get_target(name: str) -> Target:
    """The target called ``name``; an unknown name is a ConfigError listing the known ones."""
    table = _table()
    if name not in table:
        raise ConfigError(f"--target {name!r}: no such target; known: {', '.join(table)}")
    return table[name]


def plugin_installed(platform: str) -> bool:
    """Whether this Python has jax's compiler for ``platform`` (``gpu``: a CUDA plugin; ``tpu``:
    libtpu; ``cpu``: always)."""
    if platform == "cpu":
        return True
    names = _CUDA_PLUGINS if platform == "gpu" else ("libtpu",)
    for name in names:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # a parent package (jax_plugins) is absent
            continue
    return False


def check_plugin(target: Target) -> None:
    """A ConfigError of one line saying what to install when this Python cannot compile for
    ``target`` (its plugin goes into a venv of its own: with the CUDA plugin installed jax and
    ``engine/platform.py`` expect a GPU)."""
    if plugin_installed(target.platform):
        return
    what, extra, size = _INSTALL[target.platform]
    venv = AOT_VENVS[target.platform]
    raise ConfigError(
        f"--target {target.name}: compiling for {target.description} needs {what}, not installed for {sys.executable}; "
        f"install it into a venv of its own ({size}; keep it out of the venv you train or test in): python -m venv {venv} "
        f"&& {venv}/bin/pip install -e '.[{extra}]' (from the checkout; 'asyncrl[{extra}]' otherwise), then run "
        f"{venv}/bin/python -m asyncrl.cli plan ... --target {target.name}")


def target_topology(target: Target, devices: Optional[int] = None, processes: Optional[int] = None) -> tuple[int, int]:
    """``(devices, hosts)`` of ``target`` for ``--devices`` / ``--processes`` (None: the target's
    own: one GPU, the TPU slice's chips and hosts, one CPU device). GPUs: up to
    ``gpus_per_host`` on one host, more on as many hosts as needed (or ``processes``); a TPU
    slice has its own count (another count is another target); cpu: one host."""
    if target.platform == "tpu":
        if devices not in (None, target.chips) or processes not in (None, target.hosts):
            family = str(target.topology).split(":")[0]
            same = [t.name for t in _table().values() if t.topology and t.topology.split(":")[0] == family]
            raise ConfigError(f"--target {target.name} is {target.chips} chips on {target.hosts} host(s); --devices/--processes "
                              f"cannot change a TPU slice: pick another target ({', '.join(same)})")
        return target.chips, target.hosts
    count = 1 if devices is None else devices
    if count < 1:
        raise ConfigError(f"--devices {count}: give at least 1")
    if target.platform == "cpu":
        if processes not in (None, 1):
            raise ConfigError(f"--target cpu --processes {processes}: the cpu target is one host; give --processes 1")
        return count, 1
    hosts = processes if processes is not None else -(-count // target.gpus_per_host)
    if hosts < 1 or count % hosts or count // hosts > target.gpus_per_host:
        raise ConfigError(f"--target {target.name} --devices {count} --processes {hosts}: give devices that the hosts divide, "
                          f"at most {target.gpus_per_host} GPUs per host")
    return count, hosts


def gpu_topology_name(devices: int, hosts: int) -> str:
    """The CUDA plugin's compile-only topology: ``partitions x hosts-per-partition x devices-per-host``
    (``1x1x8``: 8 GPUs of one host; ``2x1x4``: 2 hosts of 4)."""
    return f"{hosts}x1x{devices // hosts}"


def gpu_target_config(target: Target) -> str:
    """The GPU description text of ``target``: JAX's own for an attached GPU of the same model
    (``device_description_str`` equal to the device kind), else the shipped file."""
    text = (SPECS / str(target.spec)).read_text()
    attached = _attached_gpu_config()
    if attached is not None and _description_name(attached) == _description_name(text):
        return attached
    return text


def _attached_gpu_config() -> Optional[str]:
    """The target description JAX reports for this machine's first GPU, or None without one
    (or where the GPU backend was not started: ``asyncrl plan --target`` compiles under
    ``JAX_PLATFORMS=cpu`` unless a GPU is attached, :func:`target_env`)."""
    import jax

    try:
        gpus = jax.devices("cuda")
    except RuntimeError:  # no GPU backend in this process
        return None
    from jax._src.lib import xla_client

    return str(xla_client.get_topology_for_devices(gpus[:1]).target_config)


def _description_name(text: str) -> str:
    found = re.search(r'device_description_str:\s*"([^"]*)"', text)
    return found.group(1) if found else ""


def device_memory_bytes(target: Target) -> int:
    """Memory of one device: the GPU description's ``device_memory_size``, a TPU chip's HBM, or
    this machine's RAM for ``cpu``."""
    if target.platform == "gpu":
        found = re.search(r"device_memory_size:\s*(\d+)", gpu_target_config(target))
        if found is None:
            raise ConfigError(f"{SPECS / str(target.spec)}: no device_memory_size in gpu_device_info")
        return int(found.group(1))
    if target.platform == "tpu":
        return int(float(target.memory_gib or 0) * GIB)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def target_env(target: Target, devices: int, env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """``env`` (default ``os.environ``) as a process compiling for ``target`` on ``devices``
    devices needs it before jax starts: ``JAX_PLATFORMS=cpu`` (the compile-only devices need no
    accelerator; a machine with a GPU attached keeps its GPU backend so that
    :func:`gpu_target_config` reads the real one), forced host devices for ``cpu``, and
    ``TPU_WORKER_HOSTNAMES=localhost`` (it silences libtpu's host lookup) and
    ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (libtpu's lockfile keeps a second process off the chips;
    compile-only ones have none to share) for TPUs."""
    out = dict(os.environ if env is None else env)
    gpu_here = target.platform == "gpu" and Path("/dev/nvidia0").exists()
    if gpu_here:
        out["JAX_PLATFORMS"] = "cuda,cpu"
        out.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the backend is only asked what it is
    else:
        out["JAX_PLATFORMS"] = "cpu"
    if target.platform == "tpu":
        out.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        # libtpu locks /tmp/libtpu_lockfile so that two processes do not drive the same chips;
        # compile-only devices drive none, so several compiling processes may run at once.
        out.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if target.platform == "cpu":
        flag = f"--xla_force_host_platform_device_count={devices}"
        flags = [f for f in out.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        out["XLA_FLAGS"] = " ".join([*flags, flag])
    return out


def target_devices(target: Target, devices: int, hosts: int = 1) -> list[Any]:
    """``devices`` compile-only devices of ``target`` over ``hosts`` hosts (``process_index``
    0..hosts-1), in (process, id) order. GPUs: the CUDA plugin's topology
    (:func:`gpu_topology_name`) for :func:`gpu_target_config`; TPUs: libtpu's ``topology``;
    cpu: this process's CPU devices (:func:`target_env` forces their count). One-line
    ConfigErrors: the plugin missing (:func:`check_plugin`), a topology it does not know."""
    check_plugin(target)
    if target.platform == "cpu":
        import jax

        have = jax.devices("cpu")
        if len(have) < devices:
            raise ConfigError(f"--target cpu --devices {devices}: this process has {len(have)} CPU device(s); start it with "
                              f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} (asyncrl plan does)")
        return list(have[:devices])
    from jax.experimental import topologies

    try:
        if target.platform == "gpu":
            name = gpu_topology_name(devices, hosts)
            found = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(target), topology=name).devices
        else:
            name = str(target.topology)
            # libtpu's lockfile would refuse this process while another holds it; these chips are
            # compile-only (read when libtpu loads, so set before the first TPU topology).
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            found = topologies.get_topology_desc(name, "tpu", chip_config_name=target.chip_config,
                                                 chips_per_host_bounds=list(target.chips_per_host_bounds)).devices
    except Exception as err:  # noqa: BLE001 - the plugin's own error, reported in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        unknown = isinstance(err, NotImplementedError) or first.startswith(("INVALID_ARGUMENT", "UNIMPLEMENTED"))
        what = "does not know topology" if unknown else "could not make the compile-only devices of topology"
        raise ConfigError(f"--target {target.name}: the installed {_plugin_version(target.platform)} {what} {name!r} ({first}); "
                          f"upgrade it in its venv (pip install -U 'jax[{_INSTALL[target.platform][1]}]') or pick another "
                          "--target") from None
    if len(found) != devices:
        raise ConfigError(f"--target {target.name}: topology {name!r} gave {len(found)} devices, not {devices}")
    return sorted(found, key=lambda d: (d.process_index, d.id))


def host_devices(target: Target, devices: int, hosts: int) -> list[Any]:
    """The compile-only devices of one host of a multi-host ``target``: a topology of that host's
    chips alone (TPUs: ``chips_per_host_bounds``, ``v6e:2x2`` for one host of ``v6e-32``; GPUs:
    ``1x1xN`` for its N GPUs). Every host runs an engine of its own with no collective across
    hosts, so its programs are compiled there; libtpu compiles no program for a part of a larger
    compile-only slice. One-line ConfigErrors as :func:`target_devices`."""
    per_host = devices // hosts
    if target.platform != "tpu":
        return target_devices(target, per_host, 1)
    family, shape = str(target.topology).split(":")
    bounds = "x".join(str(b) for b in target.chips_per_host_bounds[: len(shape.split("x"))])
    return target_devices(dataclasses.replace(target, topology=f"{family}:{bounds}", chips=per_host, hosts=1), per_host, 1)


def _plugin_version(platform: str) -> str:
    from importlib import metadata

    for dist in (("jax-cuda13-plugin", "jax-cuda12-plugin") if platform == "gpu" else ("libtpu",)):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "plugin"
