"""Config loading, validation messages and --set overrides."""

from __future__ import annotations

from typing import Optional

import pytest
from pydantic import Field

from asyncrl.config import Config, Section, dump_config, load_config
from asyncrl.config.overrides import apply_override
from asyncrl.errors import ConfigError
from tests.helpers import REPO_ROOT


def problems_of(**kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    return info.value.problems


def test_defaults_validate():
    cfg = load_config(data={})
    assert cfg == Config()
    assert cfg.run.resolved_output_dir.as_posix() == "runs/asyncrl"


def test_unknown_key_names_path_and_closest_key():
    (line,) = problems_of(data={"rollout": {"batch_sise": 4}})
    assert line == "rollout.batch_sise: unknown key; did you mean 'rollout.batch_size'?"


def test_unknown_key_without_close_match_lists_allowed_keys():
    (line,) = problems_of(data={"run": {"zzz": 1}})
    assert line.startswith("run.zzz: unknown key; allowed keys: name, output_dir, seed, total_steps")


def test_unknown_section():
    (line,) = problems_of(data={"rollouts": {}})
    assert line == "rollouts: unknown key; did you mean 'rollout'?"


def test_bad_type_names_path_given_and_allowed():
    (line,) = problems_of(data={"rollout": {"batch_size": "many"}})
    assert line.startswith("rollout.batch_size: ")
    assert "valid integer" in line and "given 'many'" in line


def test_bad_value_lists_allowed_values():
    (line,) = problems_of(data={"rollout": {"batch_order": "fifo"}})
    assert line == "rollout.batch_order: Input should be 'admission' or 'completion' (given 'fifo')"


def test_bound_violation():
    (line,) = problems_of(data={"rollout": {"temperature": 0}})
    assert line == "rollout.temperature: Input should be greater than 0 (given 0)"


def test_every_problem_reported_at_once():
    lines = problems_of(data={"rollout": {"temperature": 0, "group_size": 0}, "run": {"seed": "x"}})
    assert {line.split(":")[0] for line in lines} == {"rollout.temperature", "rollout.group_size", "run.seed"}


def test_file_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.yaml"
    assert problems_of(path=missing) == [f"{missing}: no such config file"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  name: [unclosed\n")
    (line,) = problems_of(path=bad)
    assert line.startswith(f"{bad}:") and "not valid YAML" in line
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("- 1\n- 2\n")
    (line,) = problems_of(path=scalar)
    assert "top level must be a mapping" in line
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("rollout:\n  batch_size: -1\n")
    (line,) = problems_of(path=wrong)
    assert line.startswith(f"{wrong}: rollout.batch_size:")


def test_set_nested_bool_null_and_float():
    cfg = load_config(
        data={"run": {"output_dir": "x"}},
        overrides=["rollout.batch_size=16", "run.output_dir=null", "rollout.temperature=1e-5"],
    )
    assert cfg.rollout.batch_size == 16
    assert cfg.run.output_dir is None
    assert cfg.rollout.temperature == pytest.approx(1e-5)


def test_set_str_fields_take_raw_text():
    # YAML 1.1 would read these as False and 83.
    cfg = load_config(overrides=["run.name=no", "model.path=0123"])
    assert cfg.run.name == "no"
    assert cfg.model.path == "0123"


def test_set_path_errors():
    lines = problems_of(overrides=["model.pth=x", "rollout.batch_size.x=1", "nonsense", "rollout.batch_size=lots"])
    assert lines[0] == "--set model.pth: 'model.pth' does not exist; did you mean 'model.path'?"
    assert lines[1].startswith("--set rollout.batch_size.x: 'rollout.batch_size.x' does not exist")
    assert lines[2].startswith("--set 'nonsense': expected PATH=VALUE")
    assert lines[3].startswith("rollout.batch_size:") and "given 'lots'" in lines[3]


class _Item(Section):
    name: str = "a"
    """Name."""
    weight: float = 1.0
    """Weight."""


class _Root(Section):
    items: list[_Item] = Field(default_factory=list)
    """Items."""
    numbers: list[int] = Field(default_factory=list)
    """Numbers."""
    flag: Optional[bool] = None
    """Flag."""


def test_set_list_index_and_whole_list():
    raw = {"items": [{"name": "x"}, {"name": "y"}], "numbers": [5]}
    apply_override(raw, _Root, "items.1.weight=0.5")
    apply_override(raw, _Root, "items.0.name=off")
    apply_override(raw, _Root, "numbers=[1, 2]")
    apply_override(raw, _Root, "flag=yes")
    root = _Root.model_validate(raw)
    assert root.items[1].weight == 0.5 and root.items[0].name == "off"
    assert root.numbers == [1, 2]
    assert root.flag is True
    with pytest.raises(ConfigError, match=r"index 2 is out of range \('items.2' has 2 items\)"):
        apply_override(raw, _Root, "items.2.name=z")
    with pytest.raises(ConfigError, match="'items.0.nam' does not exist; did you mean 'items.0.name'"):
        apply_override(raw, _Root, "items.0.nam=z")


def test_dump_round_trip(tmp_path):
    cfg = load_config(overrides=["run.name=no", "rollout.temperature=0.7", "rollout.batch_order=completion"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_stages_override_sections_and_report_errors_by_stage():
    cfg = load_config(
        data={"stages": [
            {"name": "sft", "type": "sft", "total_steps": 5, "optim": {"lr": 0.01}},
            {"name": "rl", "total_steps": 7, "algo": {"clip_high": 0.28}},
        ]},
        overrides=["stages.1.total_steps=9", "stages.0.optim.warmup_steps=2"],
    )
    (sft, sft_cfg), (rl, rl_cfg) = cfg.stage_configs()
    assert (sft.type, sft_cfg.run.total_steps, sft_cfg.optim.lr, sft_cfg.optim.warmup_steps) == ("sft", 5, 0.01, 2)
    assert (rl.type, rl_cfg.run.total_steps, rl_cfg.optim.lr, rl_cfg.algo.clip_high) == ("rl", 9, 1e-3, 0.28)
    assert cfg.total_steps == 14 and not sft_cfg.stages
    lines = problems_of(data={"stages": [{"name": "a", "algo": {"clip_hgh": 1}}, {"name": "a", "optim": {"lr": -1}}]})
    assert "stages: stage names must differ (given ['a', 'a'])" in lines
    assert "stages.0.algo.clip_hgh: unknown key; did you mean 'stages.0.algo.clip_high'?" in lines
    assert "stages.1.optim.lr: Input should be greater than 0 (given -1)" in lines
    assert problems_of(data={"run": {"total_steps": 3}, "stages": [{"name": "x"}]}) == [
        "run.total_steps: with stages, set each stage's total_steps instead"
    ]


def test_no_stages_is_one_rl_stage():
    cfg = load_config(overrides=["run.total_steps=4"])
    ((stage, stage_cfg),) = cfg.stage_configs()
    assert (stage.type, stage.total_steps) == ("rl", 4) and stage_cfg is cfg and cfg.total_steps == 4
    # that RL stage never reads the sft section: a setting there is refused, not dropped
    (line,) = problems_of(data={"sft": {"batch_size": 8}})
    assert line.startswith("sft: set, but without stages the run is one RL stage") and "type: sft" in line
    assert load_config(REPO_ROOT / "configs" / "gsm8k_sft.yaml").stage_configs()[0][0].type == "sft"


def test_dump_round_trip_with_stages(tmp_path):
    cfg = load_config(data={"stages": [{"name": "sft", "type": "sft", "total_steps": 2}, {"name": "rl", "total_steps": 3}]})
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize("extra, needle", [
    ((), "engine.remote.publish_adapters: needs model.lora"),
    (("model.lora={rank: 4, alpha: 8}", "mesh.distributed.enabled=true"), "engine.remote.publish_adapters: one-process runs only"),
])
def test_adapter_publishes_need_lora_and_one_process(extra, needle):
    import json


    quickstart = REPO_ROOT / "configs" / "quickstart.yaml"
    remote = json.dumps({"urls": ["http://127.0.0.1:30000"], "publish_adapters": True})
    with pytest.raises(ConfigError, match=needle):
        load_config(quickstart, [f"engine.remote={remote}", *extra])
    load_config(quickstart, [f"engine.remote={remote}", "model.lora={rank: 4, alpha: 8}"])


@pytest.mark.parametrize("field", ["slots", "tensor_parallel", "decode_inner_steps"])
def test_a_field_validators_message_is_the_line_as_it_wrote_it(field):
    """A field validator's message names the field and what was given: the line is that message,
    not the path and the given value a second time around it."""
    with pytest.raises(ConfigError) as err:
        load_config(data={"engine": {field: 0}})
    assert str(err.value) == f"engine.{field}: at least 1, or auto (given 0)"


def test_the_context_limit_is_max_seq_len_or_the_in_process_engines_smaller_capacity():
    """A rollout's context is bounded by ``rollout.max_seq_len``, and by ``engine.kv_capacity`` when
    that is smaller and the engine runs in process (remote servers have their own context length)."""
    long = {"rollout": {"max_seq_len": 2048}, "engine": {"kv_capacity": 1024}}
    assert load_config(data=long).context_limit == (1024, "engine.kv_capacity")
    remote = {**long, "engine": {**long["engine"], "remote": {"urls": ["http://127.0.0.1:1"]}}}
    assert load_config(data=remote).context_limit == (2048, "rollout.max_seq_len")
    assert load_config(data={"rollout": {"max_seq_len": 300}, "engine": {"kv_capacity": 1024}}).context_limit == (300, "rollout.max_seq_len")
