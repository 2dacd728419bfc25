"""Components by name: alias, import path and {target, kwargs}, with their errors."""

from __future__ import annotations

import functools

import pytest

from asyncrl import registry
from asyncrl.config import ComponentRef
from asyncrl.errors import ConfigError


def exact_match(prompt: str, completion: str, answer: str = "", scale: float = 1.0) -> float:
    return scale * float(completion.strip() == answer)


@pytest.fixture
def registered_reward():
    registry.register("reward", "test_exact")(exact_match)
    yield exact_match
    registry._registry["reward"].pop("test_exact", None)


def test_alias(registered_reward):
    assert registry.resolve("reward", "test_exact") is exact_match


def test_import_path():
    assert registry.resolve("reward", "tests.test_registry:exact_match") is exact_match
    assert registry.resolve("reward", "functools:partial") is functools.partial


def test_target_with_kwargs_binds_them(registered_reward):
    for spec in ({"target": "test_exact", "kwargs": {"scale": 2.0}}, ComponentRef(target="test_exact", kwargs={"scale": 2.0})):
        fn = registry.resolve("reward", spec, where="rewards.0")
        assert fn("p", " 7 ", answer="7") == 2.0


def test_unknown_alias_lists_known(registered_reward):
    with pytest.raises(ConfigError) as info:
        registry.resolve("reward", "test_exakt", where="rewards.1")
    message = str(info.value)
    assert message.startswith("rewards.1: unknown reward 'test_exakt'; did you mean 'test_exact'?")
    assert "Known rewards:" in message and "test_exact" in message


def test_missing_module_and_symbol():
    with pytest.raises(ConfigError, match=r"^workflow: cannot import module 'no_such_pkg.mod'"):
        registry.resolve("workflow", "no_such_pkg.mod:Thing")
    with pytest.raises(ConfigError, match=r"^workflow: module 'tests.test_registry' has no attribute 'Nope'"):
        registry.resolve("workflow", "tests.test_registry:Nope")


def test_wrong_kwargs_name_path_and_accepted(registered_reward):
    with pytest.raises(ConfigError) as info:
        registry.resolve("reward", {"target": "test_exact", "kwargs": {"sclae": 2}}, where="rewards.0")
    message = str(info.value)
    assert message.startswith("rewards.0.kwargs:") and "sclae" in message
    assert "it accepts: prompt, completion, answer, scale" in message


def test_malformed_specs():
    with pytest.raises(ConfigError, match="^workflow: a component mapping has keys 'target'"):
        registry.resolve("workflow", {"targte": "x"})
    with pytest.raises(ConfigError, match="^workflow: a component spec is an alias"):
        registry.resolve("workflow", 3)
    with pytest.raises(ConfigError, match="^workflow: empty component spec"):
        registry.resolve("workflow", " ")


def test_duplicate_alias_for_a_different_object_is_refused(registered_reward):
    with pytest.raises(ValueError, match="already registered"):
        registry.register("reward", "test_exact")(lambda prompt, completion: 0.0)


def _third_party_package(root, entry_name: str) -> None:
    """An installed-looking package ``mypkg`` (a dist-info with entry points) whose module registers a reward."""
    dist = root / "mypkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mypkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[asyncrl.components]\n{entry_name} = mypkg_rewards\n")
    (root / "mypkg_rewards.py").write_text(
        "from asyncrl.registry import register\n\n"
        "@register('reward', 'mine')\n"
        "def mine(prompt, completion, **fields):\n    return 7.0\n"
    )


def test_a_third_party_package_adds_components_through_the_entry_point_group(tmp_path):
    from tests.helpers import run_python, subprocess_env

    _third_party_package(tmp_path, "reward.mine")
    env = subprocess_env(PYTHONPATH=f"{subprocess_env()['PYTHONPATH']}:{tmp_path}")
    run_python("""
        from asyncrl.registry import resolve
        assert resolve("reward", "mine")("p", "c") == 7.0
        assert resolve("reward", "exact_match")  # the bundled ones still resolve beside it
        assert resolve("workflow", "single_turn") and resolve("engine", "jax") and resolve("estimator", "grpo")
    """, env=env)


def test_a_badly_named_entry_point_is_an_error_naming_its_package(tmp_path):
    from tests.helpers import run_python, subprocess_env

    _third_party_package(tmp_path, "rewards.mine")
    env = subprocess_env(PYTHONPATH=f"{subprocess_env()['PYTHONPATH']}:{tmp_path}")
    run_python("""
        from asyncrl.errors import ConfigError
        from asyncrl.registry import resolve
        try:
            resolve("reward", "mine")
        except ConfigError as err:
            assert "entry point 'rewards.mine = mypkg_rewards' of package mypkg" in str(err), err
            assert "'<kind>.<label>' with kind one of workflow, reward" in str(err), err
        else:
            raise AssertionError("no error")
    """, env=env)
