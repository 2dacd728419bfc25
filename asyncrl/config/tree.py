"""The configuration tree: pydantic models loaded from YAML, with ``--set`` overrides.

The root :class:`Config` (its cross-field checks and multi-stage resolution) and
:func:`load_config` / :func:`dump_config` live here; the sections are defined in
:mod:`asyncrl.config.sections` and importable from this module. Beside the schema:
:mod:`asyncrl.config.overrides` parses ``--set a.b=VALUE``, :mod:`asyncrl.config.errors`
turns pydantic errors into one line per problem, :mod:`asyncrl.config.docs` generates
``docs/config.md``. This module imports no jax, flax or transformers, so validating a
config and printing it are instant.

Errors are :class:`~asyncrl.errors.ConfigError` with one line per problem, each
naming the dotted path, what was given and what is allowed.
"""

from __future__ import annotations

import copy
import typing
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, model_validator

from asyncrl.config.errors import format_validation_error
from asyncrl.config.overrides import apply_override
from asyncrl.config.sections import (
    LORA_TARGET_MODULES,
    AlgoConfig,
    CheckpointConfig,
    ComponentRef,
    ComponentSpec,
    CriticConfig,
    DataConfig,
    DistributedConfig,
    EngineConfig,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    LoraTarget,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    PlacementConfig,
    PrefixCacheConfig,
    RemoteEngineConfig,
    RewardSpec,
    RolloutConfig,
    RunConfig,
    Section,
    SFTConfig,
)
from asyncrl.errors import ConfigError

__all__ = [
    "LORA_TARGET_MODULES", "AlgoConfig", "CheckpointConfig", "ComponentRef", "ComponentSpec", "Config", "CriticConfig",
    "DataConfig",
    "DistributedConfig", "EngineConfig", "EvalConfig", "LoggingConfig", "LoraConfig", "LoraTarget", "MeshConfig",
    "ModelConfig", "OptimConfig", "PlacementConfig", "RemoteEngineConfig", "RewardSpec", "RolloutConfig", "RunConfig",
    "SFTConfig", "Section", "StageConfig", "STAGE_SECTIONS", "GROUP_NORMALISED_ESTIMATORS", "dump_config", "load_config",
    "read_utf8", "read_yaml", "validate_config",
]


def _estimator_target(spec: Any) -> Any:
    """The alias or import path of an ``algo.estimator`` value (a string or ``{target, kwargs}``)."""
    return spec.get("target") if isinstance(spec, dict) else spec


class StageConfig(Section):
    """One stage of a multi-stage run: SFT or RL, with overrides of the top-level sections."""

    name: str = "rl"
    """Stage name: tags its metrics (``stage`` in metrics.jsonl, ``tensorboard/<name>/``) and checkpoints."""
    type: Literal["sft", "rl"] = "rl"
    """``sft``: cross-entropy on reference responses; ``rl``: GRPO/PPO with rollouts."""
    total_steps: int = Field(default=100, ge=1)
    """Trainer steps of this stage."""
    data: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the top-level ``data`` section for this stage (only the keys given)."""
    workflow: Optional[ComponentSpec] = None
    """Overrides the top-level ``workflow`` for this stage."""
    rewards: Optional[list[RewardSpec]] = None
    """Overrides the top-level ``rewards`` for this stage."""
    algo: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the top-level ``algo`` section for this stage."""
    optim: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the top-level ``optim`` section for this stage (each stage starts a fresh optimizer)."""
    eval: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the top-level ``eval`` section for this stage."""
    sft: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the top-level ``sft`` section for this stage (``type: sft``)."""


STAGE_SECTIONS = ("data", "workflow", "rewards", "algo", "optim", "eval", "sft")
"""Top-level sections a stage may override."""


class Config(Section):
    """The whole configuration of a run."""

    run: RunConfig = Field(default_factory=RunConfig)
    """Identity, output location, seeding and length of the run."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout generation and staleness control."""
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    """The RL objective."""
    critic: Optional[CriticConfig] = None
    """The value model of ``algo.estimator: gae`` (``{path, optim, lora, value_clip, loss_coef}``); null: no critic (group-relative estimators need none)."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Prompt limits."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The JAX inference engine."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """The trainer's optimizer and schedule."""
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    """The trainer's device mesh and multi-process setup."""
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """Which devices train and which generate (default: the engine colocated with the trainer)."""
    workflow: ComponentSpec = "single_turn"
    """The rollout workflow (``RolloutWorkflow`` subclass): alias, ``pkg.module:Class``, or ``{target, kwargs}``."""
    rewards: list[RewardSpec] = Field(default_factory=list)
    """Reward functions of the workflow, weighted and summed."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation on the held-out split."""
    sft: SFTConfig = Field(default_factory=SFTConfig)
    """Supervised fine-tuning batches (stages of ``type: sft``)."""
    stages: list[StageConfig] = Field(default_factory=list)
    """Stages run in order on one model (e.g. ``[{name: sft, type: sft, total_steps: 50}, {name: rl, total_steps: 100}]``); empty: one RL stage of ``run.total_steps``."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Logging."""

    @model_validator(mode="after")
    def _check_algo(self, info: ValidationInfo) -> "Config":
        problems = []
        algo = self.algo
        if algo.decoupled and algo.mismatch_correction:
            problems.append(
                "algo.mismatch_correction: cannot be combined with algo.decoupled (both apply the same weight "
                "w = pi_prox/pi_behave, so it would be applied twice); set one of them to false"
            )
        target = algo.estimator if isinstance(algo.estimator, str) else algo.estimator.target
        if target in GROUP_NORMALISED_ESTIMATORS and self.rollout.group_size < 2:
            problems.append(
                f"rollout.group_size: {self.rollout.group_size} is too small for algo.estimator '{target}', which "
                "compares each sequence with the rest of its group; use group_size >= 2 or algo.estimator: batch"
            )
        if target == "gae" and self.critic is None:
            problems.append("algo.estimator: gae needs a value model; add a critic section (e.g. critic: {}) or use grpo")
        # Unused critic settings: judged on the whole run (a stage may switch to gae), not on a
        # stage's resolved config (an SFT stage before a gae stage inherits them unused).
        if not (info.context or {}).get("stage"):
            run_targets = {target} | {_estimator_target(stage.algo["estimator"]) for stage in self.stages
                                      if "estimator" in stage.algo}
            if self.critic is not None and "gae" not in run_targets:
                problems.append(f"critic: only algo.estimator: gae uses a critic (the estimator is '{target}'); "
                                "remove the critic section or set algo.estimator: gae")
            if algo.reward_kl_coef > 0 and "gae" not in run_targets:
                problems.append(f"algo.reward_kl_coef: the KL penalty in the reward is part of gae (the estimator is "
                                f"'{target}'); use algo.kl_coef")
        if algo.truncated == "penalty" and algo.overlong_buffer > self.rollout.max_new_tokens:
            problems.append(
                f"algo.overlong_buffer: {algo.overlong_buffer} exceeds rollout.max_new_tokens "
                f"({self.rollout.max_new_tokens}); the buffer is the last part of the allowed length"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _check_lengths(self) -> "Config":
        needed = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        if self.rollout.max_seq_len is not None and self.rollout.max_seq_len < needed:
            raise ValueError(
                f"rollout.max_seq_len ({self.rollout.max_seq_len}) must be at least data.max_prompt_tokens + "
                f"rollout.max_new_tokens ({needed}), or every long completion would be dropped"
            )
        return self

    @model_validator(mode="after")
    def _check_micro_batches(self) -> "Config":
        optim, problems = self.optim, []
        if optim.micro_batch_tokens is not None and optim.micro_batches not in (1, "auto"):
            problems.append(f"optim.micro_batch_tokens: a token budget per micro-batch replaces optim.micro_batches "
                            f"({optim.micro_batches}); give one of them")
        if optim.by_tokens and self.rollout.pack is False:
            field = "optim.micro_batch_tokens" if optim.micro_batch_tokens is not None else "optim.micro_batches: auto"
            problems.append(f"{field}: micro-batches by a token budget pack their rows; set rollout.pack: true (or auto)")
        if optim.micro_batch_tokens is not None and optim.micro_batch_tokens < self.longest_row:
            problems.append(
                f"optim.micro_batch_tokens: {optim.micro_batch_tokens} is below one row of the longest sequence, "
                f"{self.longest_row} tokens (data.max_prompt_tokens + rollout.max_new_tokens, or rollout.max_seq_len, "
                f"rounded up to rollout.length_bucket {self.rollout.length_bucket}); give at least {self.longest_row}")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _check_engine(self) -> "Config":
        engine, problems = self.engine, []
        needed = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        if engine.kv_capacity < needed:
            problems.append(
                f"engine.kv_capacity ({engine.kv_capacity}) must be at least data.max_prompt_tokens + "
                f"rollout.max_new_tokens ({needed}), or long prompts could not be served"
            )
        if engine.remote is not None and (self.placement.engine is not None
                                          or (isinstance(engine.tensor_parallel, int) and engine.tensor_parallel > 1)):
            problems.append(
                "placement.engine / engine.tensor_parallel: place the in-process engine; with engine.remote set "
                "generation runs on the servers, so leave both at their defaults"
            )
        if engine.remote is not None and engine.remote.publish_adapters and self.model.lora is None:
            problems.append("engine.remote.publish_adapters: needs model.lora (without adapters there is nothing but the "
                            "whole model to publish); set model.lora or drop publish_adapters")
        if engine.remote is not None and engine.remote.publish_adapters and self.mesh.distributed.enabled:
            problems.append("engine.remote.publish_adapters: one-process runs only (the adapters are written by one "
                            "process); with mesh.distributed.enabled drop publish_adapters (the merged model is published)")
        reuse = engine.prefix_cache
        if engine.remote is not None and reuse.enabled and reuse.across_versions:
            problems.append(
                "engine.prefix_cache.across_versions: cannot be honoured with engine.remote set (the servers keep their "
                "own cache, SGLang's flushed at each weight update, and a server's tokens must carry a version it "
                "served since the request was sent); set across_versions: false"
            )
        if reuse.enabled and reuse.across_versions and self.rollout.max_staleness == 0:
            problems.append(
                "engine.prefix_cache.across_versions: with rollout.max_staleness 0 a sample that reuses KV of older "
                "weights carries their version and is dropped as stale; set rollout.max_staleness >= 1 or "
                "across_versions: false"
            )
        too_long = [b for b in reuse.extend_buckets if b > engine.kv_capacity]
        if too_long and reuse.extend_buckets != PrefixCacheConfig().extend_buckets:  # the default's are left out
            problems.append(
                f"engine.prefix_cache.extend_buckets: {too_long} exceed engine.kv_capacity ({engine.kv_capacity}); "
                "the rest of a prompt after a reused prefix is never longer, so drop them"
            )
        rollout_decoding, eval_decoding = self.rollout.decoding, self.eval.decoding
        if rollout_decoding.strategy != "sample":
            problems.append(
                f"rollout.decoding.strategy: training rollouts must sample (given {rollout_decoding.strategy!r}); greedy and "
                "beam completions are not samples of the policy, so their log-probs cannot be trained on. Use eval.decoding"
            )
        if engine.remote is not None and (rollout_decoding.constraint or eval_decoding.constraint or eval_decoding.strategy == "beam"):
            problems.append(
                "rollout.decoding / eval.decoding: trie constraints and beam search need the in-process engine; "
                "engine.remote is set (drop the constraint and use strategy greedy or sample)"
            )
        # engine.slots: auto is sized at start to at least these (asyncrl.run.auto_slots.minimum_slots)
        slots = engine.slots if isinstance(engine.slots, int) else None
        if slots is not None and eval_decoding.strategy == "beam" and eval_decoding.beam_width > slots:
            problems.append(f"eval.decoding.beam_width ({eval_decoding.beam_width}) must be at most engine.slots ({engine.slots})")
        if eval_decoding.constraint and rollout_decoding.constraint:
            problems.append("eval.decoding.constraint: eval decodes under rollout.decoding.constraint when that is set; "
                            "leave eval.decoding.constraint null")
        if eval_decoding.strategy == "sample":
            problems.append("eval.decoding.strategy: 'greedy' or 'beam' (eval's sampled completions are eval.n_samples)")
        if slots is not None and self.rollout.group_size > slots:
            problems.append(
                f"engine.slots ({engine.slots}) must be at least rollout.group_size ({self.rollout.group_size}): "
                "a group's samples share one prefill and decode together"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _check_stages(self, info: ValidationInfo) -> "Config":
        if not self.stages:
            # Without stages the run is one RL stage, which never reads the sft section: settings
            # there would be dropped in silence (and an SFT recipe would train with RL).
            if self.sft != SFTConfig() and not (info.context or {}).get("stage"):
                raise ValueError(
                    "sft: set, but without stages the run is one RL stage, which does not use it; to train with "
                    "SFT add stages: [{name: sft, type: sft, total_steps: N}] (and drop run.total_steps), "
                    "or remove the sft section")
            return self
        problems = []
        if "total_steps" in self.run.model_fields_set:
            problems.append("run.total_steps: with stages, set each stage's total_steps instead")
        names = [stage.name for stage in self.stages]
        if len(set(names)) != len(names):
            problems.append(f"stages: stage names must differ (given {names})")
        for index in range(len(self.stages)):
            try:
                self.stage_config(index)
            except ValidationError as err:
                problems.extend(
                    f"stages.{index}.{line}".replace("did you mean '", f"did you mean 'stages.{index}.")
                    for line in format_validation_error(err, Config)
                )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def stage_configs(self) -> list[tuple["StageConfig", "Config"]]:
        """Each stage with its flat config (the top level, overridden by the stage, no stages)."""
        if not self.stages:
            return [(StageConfig(name="rl", type="rl", total_steps=self.run.total_steps), self)]
        return [(stage, self.stage_config(index)) for index, stage in enumerate(self.stages)]

    def stage_config(self, index: int) -> "Config":
        stage = self.stages[index]
        raw = self.model_dump(mode="json", exclude={"stages"})
        for section in STAGE_SECTIONS:
            override = getattr(stage, section)
            if override is None or override == {}:
                continue
            if isinstance(override, dict) and isinstance(raw.get(section), dict):
                raw[section] = _deep_merge(raw[section], override)
            else:
                raw[section] = override.model_dump(mode="json") if isinstance(override, BaseModel) else (
                    [r.model_dump(mode="json") for r in override] if isinstance(override, list) else override
                )
        raw["run"]["total_steps"] = stage.total_steps
        return Config.model_validate(raw, context={"stage": True})

    @property
    def total_steps(self) -> int:
        """Trainer steps of the whole run: ``run.total_steps``, or the stages' sum."""
        return sum(stage.total_steps for stage in self.stages) if self.stages else self.run.total_steps

    @property
    def max_seq_len(self) -> int:
        """The cap on a batch's length ``L``: ``rollout.max_seq_len`` or prompt + completion limits."""
        if self.rollout.max_seq_len is not None:
            return self.rollout.max_seq_len
        return self.data.max_prompt_tokens + self.rollout.max_new_tokens

    @property
    def context_limit(self) -> tuple[int, str]:
        """The most tokens one rollout's context may reach, and the setting that bounds it:
        :attr:`max_seq_len`, or ``engine.kv_capacity`` when smaller and the engine is in-process
        (servers of ``engine.remote`` have their own context length)."""
        if self.engine.remote is None and self.engine.kv_capacity < self.max_seq_len:
            return self.engine.kv_capacity, "engine.kv_capacity"
        return self.max_seq_len, "rollout.max_seq_len"

    @property
    def longest_row(self) -> int:
        """The longest batch length ``L`` a step can have: :attr:`max_seq_len` rounded up to ``rollout.length_bucket``."""
        bucket = self.rollout.length_bucket
        return -(-self.max_seq_len // bucket) * bucket

    @property
    def packs(self) -> bool:
        """Whether the trainer packs its rows (``rollout.pack``; ``auto``: with micro-batches by a token
        budget, or where the length cap is at least :data:`PACK_AUTO_MIN_LENGTH` tokens)."""
        pack = self.rollout.pack
        if pack != "auto":
            return bool(pack)
        return self.optim.by_tokens or self.max_seq_len >= PACK_AUTO_MIN_LENGTH


PACK_AUTO_MIN_LENGTH = 4096
"""``rollout.pack: auto`` packs where the length cap (:attr:`Config.max_seq_len`) is at least this
many tokens (docs/performance.md "Sequence packing": the rule and its measurement)."""

GROUP_NORMALISED_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
"""Built-in advantage estimators that need at least two sequences per group."""


def _deep_merge(base: dict, override: dict) -> dict:
    """``override`` on top of ``base``, dict by dict. A component (``{target, kwargs}``) whose
    ``target`` changes is replaced whole: the new component takes only the kwargs given with it
    (another dataset must not inherit the base dataset's ``train_size``)."""
    if "target" in override and "target" in base and override["target"] != base["target"]:
        return dict(override)
    merged = dict(base)
    for key, value in override.items():
        merged[key] = _deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


# --------------------------------------------------------------------------- loading


def load_config(
    path: str | Path | None = None,
    overrides: typing.Sequence[str] = (),
    *,
    data: dict | None = None,
) -> Config:
    """Build a :class:`Config` from a YAML file (or a dict) and ``a.b=VALUE`` overrides.

    Raises :class:`ConfigError` naming every problem by dotted path.
    """
    if path is not None and data is not None:
        raise ValueError("give a config path or a dict, not both")
    raw = read_yaml(path) if path is not None else copy.deepcopy(data or {})
    problems: list[str] = []
    for item in overrides:
        try:
            apply_override(raw, Config, item)
        except ConfigError as err:
            problems.extend(err.problems)
    # Report the bad overrides together with whatever else is wrong, in one go.
    try:
        cfg = validate_config(raw, source=str(path) if path is not None else None)
    except ConfigError as err:
        problems.extend(err.problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping with ``yaml.safe_load``; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        loaded = yaml.safe_load(read_utf8(path, ConfigError))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}")
    return loaded


def read_utf8(path: Path, error: type[Exception]) -> str:
    """A text file's contents; a file that is not UTF-8 (or is binary) raises ``error`` naming
    the file, the line and the byte offset."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}); "
                    "save the file as UTF-8") from None


def validate_config(raw: dict, source: str | None = None) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, Config, source)) from None


# --------------------------------------------------------------------------- output


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML; :func:`load_config` reads it back to an equal config."""
    data = cfg.model_dump(mode="json")
    if cfg.stages:
        del data["run"]["total_steps"]  # each stage has its own; setting both is an error
    return yaml.safe_dump(data, sort_keys=False)
