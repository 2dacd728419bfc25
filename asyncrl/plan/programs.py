"""What a config's stages compile: the one walk of its stages and programs that ``asyncrl plan
--target`` (:func:`~asyncrl.plan.target.target_reports`) and the run's peak for its remat choice
(:func:`~asyncrl.plan.auto.run_peak`) both take, so the two never disagree on which programs a
stage runs."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from asyncrl.config import Config

ENGINE_PROGRAMS = ("prefill", "decode_chunk", "beam_search", "publish")
"""The in-process engine's programs (prefix reuse's copy and extension are the prefill's kind)."""
PROGRAMS = ("train_step", "critic_step", *ENGINE_PROGRAMS)
"""Every program ``asyncrl plan --program`` names."""


@dataclasses.dataclass(frozen=True)
class StagePrograms:
    """One stage of a config and the programs it compiles."""

    stage: Any
    """The stage (``cfg.stage_configs()``'s first element: name, type)."""
    flat: Config
    """The stage's flat config."""
    sft: bool
    train: str
    """``critic_step`` with ``algo.estimator: gae`` (one program trains both), else ``train_step``."""
    engine: bool
    """Whether the stage's engine programs are its own to compile: the in-process engine serves every
    stage (the run's ``engine`` section), so they go with the RL stages, or with the only stages of
    an SFT-only run (its greedy eval); never with ``engine.remote``."""


def stage_programs(cfg: Config) -> Iterator[StagePrograms]:
    """Each stage of ``cfg`` with the programs it compiles (:class:`StagePrograms`)."""
    stages = cfg.stage_configs()
    sft_only = all(stage.type == "sft" for stage, _ in stages)
    for stage, flat in stages:
        sft = stage.type == "sft"
        critic = not sft and flat.algo.estimator == "gae"
        engine = flat.engine.remote is None and (not sft or sft_only)
        yield StagePrograms(stage, flat, sft, "critic_step" if critic else "train_step", engine)
