"""engine.prefix_cache: settings the run cannot honour are one line naming the field; settings that
only narrow reuse (the default buckets beside a small capacity) are valid."""

from __future__ import annotations

import json

import pytest

from asyncrl.config import load_config
from asyncrl.errors import ConfigError
from tests.helpers import REPO_ROOT

QUICKSTART = REPO_ROOT / "configs" / "quickstart.yaml"  # engine.kv_capacity 32
REMOTE = "engine.remote=" + json.dumps({"urls": ["http://127.0.0.1:30000"]})


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, list(overrides))
    return [line.removeprefix(f"{QUICKSTART}: ") for line in info.value.problems]


def test_reuse_across_versions_is_refused_with_remote_servers():
    (line,) = problems(REMOTE, "engine.prefix_cache.across_versions=true")
    assert line.startswith("engine.prefix_cache.across_versions: cannot be honoured with engine.remote set")
    assert line.endswith("set across_versions: false")
    load_config(QUICKSTART, [REMOTE])  # the servers' own cache: the default settings are fine
    load_config(QUICKSTART, [REMOTE, "engine.prefix_cache.across_versions=true", "engine.prefix_cache.enabled=false"])
    load_config(QUICKSTART, ["engine.prefix_cache.across_versions=true"])  # the in-process engine honours it


def test_reuse_across_versions_needs_staleness():
    (line,) = problems("engine.prefix_cache.across_versions=true", "rollout.max_staleness=0")
    assert line.startswith("engine.prefix_cache.across_versions: with rollout.max_staleness 0 a sample that reuses")
    assert line.endswith("set rollout.max_staleness >= 1 or across_versions: false")


def test_extension_buckets_must_fit_the_capacity():
    (line,) = problems("engine.prefix_cache.extend_buckets=[16, 64]")
    assert line == ("engine.prefix_cache.extend_buckets: [64] exceed engine.kv_capacity (32); the rest of a prompt "
                    "after a reused prefix is never longer, so drop them")
    (line,) = problems("engine.prefix_cache.extend_buckets=[0, 16]")
    assert line.startswith("engine.prefix_cache.extend_buckets: ") and "all >= 1" in line
    # The default [32, 128] beside a 32-token capacity: 128 is left out, as the engine does.
    assert load_config(QUICKSTART).engine.prefix_cache.extend_buckets == [32, 128]
    assert load_config(QUICKSTART, ["engine.prefix_cache.extend_buckets=[24, 8]"]).engine.prefix_cache.extend_buckets == [24, 8]
