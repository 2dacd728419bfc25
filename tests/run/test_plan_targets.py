"""``asyncrl plan --target``'s table (asyncrl/plan/targets.py): every target described, the
compile-only devices of the cpu target, and the one-line errors (unknown target, plugin not
installed, a device count a target cannot have). GPU and TPU devices are made only where their
plugin is importable (the aot venvs of tests/README.md)."""

from __future__ import annotations

import pytest

from asyncrl.errors import ConfigError
from asyncrl.plan import targets
from asyncrl.plan.targets import (
    device_memory_bytes,
    get_target,
    gpu_topology_name,
    host_devices,
    plugin_installed,
    target_devices,
    target_env,
    target_names,
    target_topology,
)

GIB = 2**30
GPUS = ("h100", "h200", "a100-80gb", "l4")
TPUS = ("v4-8", "v5e-1", "v5e-4", "v5e-8", "v5p-8", "v6e-1", "v6e-4", "v6e-8", "v6e-16", "v6e-32", "v5p-32")


def test_the_table_has_every_target_with_its_memory():
    assert set(target_names()) == {*GPUS, *TPUS, "cpu"}
    memory = {name: device_memory_bytes(get_target(name)) / GIB for name in (*GPUS, *TPUS)}
    assert memory["h100"] == pytest.approx(79.1, abs=0.1) and memory["h200"] == pytest.approx(141.0, abs=0.1)
    assert memory["a100-80gb"] == pytest.approx(79.3, abs=0.1) and memory["l4"] == pytest.approx(22.5, abs=0.1)
    assert memory["v6e-8"] == 32 and memory["v5e-4"] == 16 and memory["v5p-32"] == 95 and memory["v4-8"] == 32
    assert target_topology(get_target("v6e-32")) == (32, 8) and target_topology(get_target("v5p-32")) == (16, 4)


def test_gpu_device_counts_and_hosts():
    h100 = get_target("h100")
    assert target_topology(h100) == (1, 1) and target_topology(h100, 8) == (8, 1)
    assert target_topology(h100, 16) == (16, 2) and target_topology(h100, 8, 2) == (8, 2)
    assert gpu_topology_name(8, 1) == "1x1x8" and gpu_topology_name(8, 2) == "2x1x4"
    with pytest.raises(ConfigError, match="at most 8 GPUs per host"):
        target_topology(h100, 8, 3)


def test_one_line_errors():
    with pytest.raises(ConfigError) as err:
        get_target("h800")
    assert "known: h100, a100-80gb, h200, l4, v4-8" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"cannot change a TPU slice: pick another target \(v6e-1, v6e-4, v6e-8"):
        target_topology(get_target("v6e-8"), 4)
    with pytest.raises(ConfigError, match="the cpu target is one host"):
        target_topology(get_target("cpu"), 2, 2)


def test_missing_plugin_says_what_to_install(monkeypatch):
    monkeypatch.setattr(targets, "plugin_installed", lambda platform: platform == "cpu")
    for name, extra, size in (("h100", "cuda", "about 4 GB"), ("v6e-8", "tpu", "0.7 GB")):
        with pytest.raises(ConfigError) as err:
            target_devices(get_target(name), *target_topology(get_target(name)))
        text = str(err.value)
        assert f"pip install -e '.[{extra}]'" in text and size in text and "venv of its own" in text and "\n" not in text


def test_cpu_target_devices_and_env():
    cpu = get_target("cpu")
    devices = target_devices(cpu, 1)
    assert len(devices) == 1 and devices[0].platform == "cpu"
    env = target_env(cpu, 4, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_dump_to=x"})
    assert env["JAX_PLATFORMS"] == "cpu" and env["XLA_FLAGS"] == "--xla_dump_to=x --xla_force_host_platform_device_count=4"
    with pytest.raises(ConfigError, match="xla_force_host_platform_device_count=64"):
        target_devices(cpu, 64)
    assert target_env(get_target("v6e-8"), 8, {})["TPU_WORKER_HOSTNAMES"] == "localhost"


@pytest.mark.skipif(not plugin_installed("gpu"), reason="jax's CUDA plugin is not installed (tests/README.md: the aot venv)")
def test_gpu_compile_only_devices():
    for name in GPUS:
        devices = target_devices(get_target(name), 8, 2)
        assert len(devices) == 8 and {d.process_index for d in devices} == {0, 1}
    assert target_devices(get_target("h100"), 1)[0].device_kind == "NVIDIA H100 80GB HBM3"


@pytest.mark.skipif(not plugin_installed("tpu"), reason="libtpu is not installed (tests/README.md: the aot venv)")
def test_one_hosts_chips_of_a_multi_host_slice():
    for name, chips in (("v6e-32", 4), ("v5p-32", 4), ("v6e-16", 4)):
        target = get_target(name)
        devices = host_devices(target, *target_topology(target))
        assert len(devices) == chips and {d.process_index for d in devices} == {0}, name
        assert devices[0].device_kind == target_devices(target, *target_topology(target))[0].device_kind


@pytest.mark.skipif(not plugin_installed("tpu"), reason="libtpu is not installed (tests/README.md: the aot venv)")
def test_tpu_compile_only_devices():
    for name in TPUS:
        target = get_target(name)
        count, hosts = target_topology(target)
        devices = target_devices(target, count, hosts)
        assert len(devices) == count and len({d.process_index for d in devices}) == hosts, name
