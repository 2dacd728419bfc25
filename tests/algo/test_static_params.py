"""The static parameter objects of jitted functions are derived from their config sections:
every field of ``algo`` reaches :class:`AlgoParams` and every field of ``optim`` reaches
:class:`OptimParams` (values unchanged, except the documented resolved fields), equal
configs give equal hashes, and any changed field gives a different static argument."""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel, ValidationError

from asyncrl.algo import params as algo_params
from asyncrl.algo.params import AlgoParams
from asyncrl.config import AlgoConfig, OptimConfig, load_config
from asyncrl.trainer import optim
from asyncrl.trainer.optim import OptimParams


def other_value(section: type[BaseModel], name: str):
    """A value of ``section.name`` other than its default that the field accepts, derived from
    the field's type (so a newly added field is covered without editing this test)."""
    field = section.model_fields[name]
    default = field.get_default(call_default_factory=True)
    annotation = field.annotation
    choices: list = []
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is typing.Literal:
            choices += list(typing.get_args(arg))
        elif arg is bool:
            choices += [not default]
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        choices += [default * 2, default + 1, default / 2, default + 0.05]
    choices += [2, 3, 0.5, 3.0, ["x"]]
    for value in choices:
        if value == default:
            continue
        try:
            section.model_validate({name: value})
        except ValidationError:
            continue
        return value
    raise AssertionError(f"no non-default value found for {section.__name__}.{name}")


GAE_ONLY = {"reward_kl_coef"}
"""Fields of ``algo`` that only a gae run may set."""


def test_algo_params_carry_every_field_of_the_section():
    assert set(AlgoConfig.model_fields) <= set(AlgoParams.model_fields)
    added = set(AlgoParams.model_fields) - set(AlgoConfig.model_fields)
    assert added <= set(algo_params.RESOLVED_FIELDS)
    base = AlgoParams.from_config(load_config())
    assert base == AlgoParams.from_config(load_config()) and hash(base) == hash(AlgoParams.from_config(load_config()))
    for name in AlgoConfig.model_fields:
        if name in algo_params.RESOLVED_FIELDS:
            continue
        value = other_value(AlgoConfig, name)
        # A field of the gae estimator is refused without it (and gae without a critic section).
        gae = {"algo": {"estimator": "gae"}, "critic": {}} if name in GAE_ONLY else {"algo": {}}
        cfg = load_config(data={**gae, "algo": {**gae["algo"], name: value}})
        params = AlgoParams.from_config(cfg)
        assert getattr(params, name) == getattr(cfg.algo, name) == value, name
        reference = base if name not in GAE_ONLY else AlgoParams.from_config(load_config(data=gae))
        assert params != reference, f"algo.{name} does not change the static argument"


def test_algo_params_replace_validates():
    base = AlgoParams()
    assert base.replace(decoupled=True) == AlgoParams(decoupled=True) and not base.decoupled
    with pytest.raises(ValidationError, match="aggregation"):
        base.replace(aggregation="mean")


def test_algo_params_resolved_fields():
    cfg = load_config(data={"rollout": {"max_new_tokens": 40},
                            "algo": {"estimator": {"target": "rloo", "kwargs": {"b": 1, "a": 2.0}}}})
    params = AlgoParams.from_config(cfg)
    assert (params.estimator, params.estimator_kwargs) == ("rloo", (("a", 2.0), ("b", 1)))
    assert params.max_new_tokens == params.loss_norm_tokens == 40
    assert AlgoParams.from_config(load_config(data={"algo": {"loss_norm_tokens": 5}})).loss_norm_tokens == 5
    with pytest.raises(ValidationError):  # immutable: a static argument must not change under jit's cache
        params.clip_low = 0.3


def test_optim_params_carry_every_field_of_the_section():
    assert set(OptimParams.model_fields) == set(OptimConfig.model_fields)
    base = OptimParams.from_config(load_config())
    assert hash(base) == hash(OptimParams.from_config(load_config()))
    # A token budget below one row is refused against the other sections: one that holds the longest row.
    across_sections = {"micro_batch_tokens": 1 << 20}
    for name in OptimConfig.model_fields:
        value = across_sections.get(name, other_value(OptimConfig, name))
        cfg = load_config(data={"optim": {name: value}})
        params = OptimParams.from_config(cfg)
        assert getattr(params, name) == getattr(cfg.optim, name), name
        assert name in optim.RESOLVED_FIELDS or getattr(params, name) == getattr(OptimConfig.model_validate({name: value}), name), name
        assert params != base, f"optim.{name} does not change the static argument"
    assert set(optim.RESOLVED_FIELDS) <= set(OptimConfig.model_fields)


def test_optim_params_resolve_the_decay_length():
    cfg = load_config(data={"run": {"total_steps": 10}, "algo": {"ppo_epochs": 2, "mini_batches": 3},
                            "optim": {"warmup_steps": 4}})
    assert OptimParams.from_config(cfg).decay_steps == 10 * 2 * 3 - 4
    assert OptimParams.from_config(cfg, updates_per_step=1).decay_steps == 10 - 4


def test_lora_spec_carries_every_field_of_the_section():
    from asyncrl.config import LoraConfig
    from asyncrl.model.lora import LoraSpec

    assert set(LoraSpec.model_fields) == set(LoraConfig.model_fields)
    base = LoraSpec.from_config(LoraConfig())
    assert hash(base) == hash(LoraSpec.from_config(LoraConfig())) and base.scale == LoraConfig().scale
    for name in LoraConfig.model_fields:
        value = ["q_proj"] if name == "target_modules" else other_value(LoraConfig, name)
        section = LoraConfig.model_validate({name: value})
        spec = LoraSpec.from_config(section)
        given = getattr(section, name)
        assert getattr(spec, name) == (tuple(given) if isinstance(given, list) else given), name
        assert spec != base and hash(spec) != hash(base), f"model.lora.{name} does not change the static argument"
