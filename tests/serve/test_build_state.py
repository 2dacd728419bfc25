"""``asyncrl serve``'s start-up (asyncrl/serve/server.py): a run config's engine is built by the
run's own rule (:func:`asyncrl.run.build.build_local_engine`), its ``auto`` fields resolved."""

from __future__ import annotations

import pytest
import yaml

from asyncrl.engine.protocol import GenerationRequest
from asyncrl.errors import ConfigError
from asyncrl.serve.server import build_state
from tests.helpers import REPO_ROOT


@pytest.mark.timeout(300)
def test_a_run_config_with_auto_fields_serves_the_runs_engine(tmp_path):
    """The quickstart keeps ``engine.tensor_parallel: auto`` (the default) and sizes its slots; the
    served engine is the one the run builds, with ``--seed`` over ``run.seed``."""
    cfg = yaml.safe_load((REPO_ROOT / "configs" / "quickstart.yaml").read_text())
    cfg.setdefault("engine", {}).pop("tensor_parallel", None)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    state = build_state(str(path), weights_root=None, api_key=None, seed=3, weight_version="0",
                        overrides=["engine.slots=auto"])
    try:
        engine = state.engine
        assert engine.mesh is None and isinstance(engine.config.slots, int) and engine.config.slots >= 1
        assert engine.config.tensor_parallel == 1  # auto, resolved as a run resolves it on one device
        [answer] = engine.generate(GenerationRequest(prompt_ids=[5, 6, 7], max_new_tokens=3, greedy=True))
        assert len(answer.output_ids) == 3 and state.label == "0"
        limits = state.openai.limits  # a chat prompt is bounded by the context only: long ones are prefilled in chunks
        assert limits.max_prompt_tokens is None and limits.max_total_tokens == engine.config.kv_capacity
    finally:
        state.engine.shutdown()


def test_set_needs_a_run_config():
    with pytest.raises(ConfigError, match="--set needs a YAML config, not the model 'tiny'"):
        build_state("tiny", weights_root=None, api_key=None, seed=None, weight_version="0", overrides=["engine.slots=4"])
