"""The configuration layer: one pydantic tree (``extra="forbid"``) loaded from YAML.

:mod:`~asyncrl.config.sections` defines the sections, :mod:`~asyncrl.config.tree` the root
:class:`Config` with ``load_config``/``dump_config``; beside them, :mod:`~asyncrl.config.overrides`
parses ``--set a.b=VALUE``, :mod:`~asyncrl.config.errors` formats pydantic errors one line per
problem, :mod:`~asyncrl.config.paths` walks dotted paths, and :mod:`~asyncrl.config.docs`
generates ``docs/config.md``. Nothing here imports jax, flax or transformers.
"""

from asyncrl.config.tree import (
    LORA_TARGET_MODULES,
    AlgoConfig,
    ComponentRef,
    Config,
    CriticConfig,
    EngineConfig,
    LoraConfig,
    LoraTarget,
    ModelConfig,
    OptimConfig,
    RemoteEngineConfig,
    RewardSpec,
    Section,
    dump_config,
    load_config,
    read_utf8,
)

__all__ = [
    "LORA_TARGET_MODULES", "AlgoConfig", "ComponentRef", "Config", "CriticConfig", "EngineConfig", "LoraConfig", "LoraTarget",
    "ModelConfig", "OptimConfig", "RemoteEngineConfig", "RewardSpec", "Section", "dump_config", "load_config",
    "read_utf8",
]
