"""The ``algo`` config section: defaults, cross-field errors naming dotted paths, static params."""

from __future__ import annotations

import pytest

from asyncrl.algo.params import AlgoParams
from asyncrl.config import load_config
from asyncrl.errors import ConfigError


def test_defaults_and_static_params():
    cfg = load_config(data={"rollout": {"max_new_tokens": 48}})
    params = AlgoParams.from_config(cfg)
    assert (params.estimator, params.clip_low, params.clip_high, params.dual_clip) == ("grpo", 0.2, 0.2, None)
    assert (params.kl_coef, params.kl_estimator, params.aggregation) == (0.0, "k3", "token-mean")
    assert not params.decoupled and not params.weighted and not params.needs_prox_recompute
    assert not params.needs_reference
    assert params.loss_norm_tokens == 48 and params.max_new_tokens == 48  # null means rollout.max_new_tokens
    assert cfg.algo.ppo_epochs == 1 and cfg.algo.mini_batches == 1
    # Equal configs give equal, hashable params: one compilation for both.
    again = AlgoParams.from_config(load_config(data={"rollout": {"max_new_tokens": 48}}))
    assert again == params and hash(again) == hash(params)


def test_estimator_spec_kwargs_and_overrides():
    cfg = load_config(
        data={"algo": {"estimator": {"target": "grpo", "kwargs": {"eps": 1e-4}}, "loss_norm_tokens": 7}},
        overrides=["algo.decoupled=true", "algo.prox_logp=behave", "algo.kl_coef=0.01"],
    )
    params = AlgoParams.from_config(cfg)
    assert params.estimator_kwargs == (("eps", 1e-4),) and params.loss_norm_tokens == 7
    assert params.weighted and not params.needs_prox_recompute and params.needs_reference
    mismatch = AlgoParams.from_config(load_config(data={"algo": {"mismatch_correction": True}}))
    assert mismatch.weighted and mismatch.needs_prox_recompute
    with pytest.raises(ConfigError, match="algo.estimator.kwargs"):
        AlgoParams.from_config(load_config(data={"algo": {"estimator": {"target": "grpo", "kwargs": {"eps": [1]}}}}))


def test_decoupled_and_mismatch_correction_together_is_an_error():
    with pytest.raises(ConfigError) as err:
        load_config(data={"algo": {"decoupled": True, "mismatch_correction": True}})
    assert str(err.value).startswith("algo.mismatch_correction: cannot be combined with algo.decoupled")


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_normalised_estimator_needs_two_sequences_per_group(estimator):
    with pytest.raises(ConfigError) as err:
        load_config(data={"rollout": {"group_size": 1}, "algo": {"estimator": estimator}})
    assert str(err.value).startswith(f"rollout.group_size: 1 is too small for algo.estimator '{estimator}'")
    load_config(data={"rollout": {"group_size": 1}, "algo": {"estimator": "batch"}})
    load_config(data={"rollout": {"group_size": 2}, "algo": {"estimator": estimator}})


def test_both_errors_are_reported_together_with_the_file_name(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout: {group_size: 1}\nalgo: {decoupled: true, mismatch_correction: true}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert len(err.value.problems) == 2
    assert all(line.startswith(f"{path}: ") for line in err.value.problems)
    assert "algo.mismatch_correction" in err.value.problems[0] and "rollout.group_size" in err.value.problems[1]


def test_field_level_errors_name_paths():
    for data, path in (
        ({"algo": {"aggregation": "mean"}}, "algo.aggregation"),
        ({"algo": {"dual_clip": 1.0}}, "algo.dual_clip"),
        ({"algo": {"behave_weight_cap": 0.5}}, "algo.behave_weight_cap"),
        ({"algo": {"clip_lo": 0.1}}, "algo.clip_lo: unknown key; did you mean 'algo.clip_low'"),
        ({"algo": {"truncated": "penalty", "overlong_buffer": 64}}, "algo.overlong_buffer: 64 exceeds"),
    ):
        with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
            load_config(data=data)


def test_recipes_in_the_docs_are_valid_configs():
    import re
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert len(blocks) == 7
    for block in blocks:
        AlgoParams.from_config(load_config(data=yaml.safe_load(block)))
