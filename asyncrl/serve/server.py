"""Starting ``asyncrl serve`` (:mod:`asyncrl.serve`): the model or run config loaded, its engine
placed by the run's rule, and uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any, Optional, Sequence

from asyncrl.errors import ConfigError
from asyncrl.serve.app import build_app
from asyncrl.serve.state import ServeState

logger = logging.getLogger("asyncrl.serve")


def build_state(model_or_config: str, *, weights_root: Optional[str], api_key: Optional[str], seed: Optional[int],
                weight_version: str, overrides: Sequence[str] = ()) -> ServeState:
    """Load the model (a model path, ``tiny[:...]``, or a YAML run config) and start its JaxEngine.
    A run config's engine is the one its run would have: ``engine.tensor_parallel`` and
    ``engine.slots`` chosen or checked, on its placement's engine devices (colocated: all of them),
    with ``run.seed`` (``seed`` wins); a model alone gets the default engine on one device."""
    from asyncrl.agent.api import Limits
    from asyncrl.config import EngineConfig, load_config
    from asyncrl.engine.jax_engine import JaxEngine
    from asyncrl.model import load_model

    if model_or_config.endswith((".yaml", ".yml")):
        from asyncrl.model.sharding import check_tensor_parallel
        from asyncrl.run.auto_slots import resolve_auto_tensor_parallel
        from asyncrl.run.build import build_local_engine

        cfg = load_config(model_or_config, overrides)
        if seed is not None:
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": seed})})
        cfg = resolve_auto_tensor_parallel(cfg)  # engine.tensor_parallel: auto (a number: checked), as a run does
        loaded = load_model(cfg.model, with_tokenizer=False)
        if cfg.engine.tensor_parallel != "auto":
            check_tensor_parallel(cfg.engine.tensor_parallel, loaded.config)
        graphdef, params = loaded.split()
        engine = build_local_engine(cfg, graphdef, params, loaded.stop_token_ids)
    else:
        if overrides:
            raise ConfigError(f"asyncrl serve: --set needs a YAML config, not the model {model_or_config!r}")
        loaded = load_model(model_or_config, with_tokenizer=False)
        graphdef, params = loaded.split()
        engine = JaxEngine(graphdef, params, stop_token_ids=loaded.stop_token_ids, config=EngineConfig(),
                           seed=0 if seed is None else seed)
    engine_cfg = engine.config
    root = Path(weights_root) if weights_root else None
    limits = Limits(max_new_tokens=engine_cfg.kv_capacity, max_total_tokens=engine_cfg.kv_capacity, total_field="engine.kv_capacity")
    return ServeState(engine, loaded.model.cfg, str(loaded.path), weights_root=root, api_key=api_key,
                      weight_version=weight_version, tokenizer=_tokenizer_of(Path(loaded.path)), openai_limits=limits)


def _tokenizer_of(model_dir: Path) -> Any:
    """The model directory's tokenizer for the OpenAI routes, or None (then they answer 404)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as err:  # noqa: BLE001 - a directory without a tokenizer still serves /generate
        logger.warning("asyncrl serve: no tokenizer in %s (%s): the OpenAI routes (/v1/...) are off", model_dir, err)
        return None


def serve(model_or_config: str, *, host: str = "127.0.0.1", port: int = 30000, weights_root: Optional[str] = None,
          api_key: Optional[str] = None, seed: Optional[int] = None, weight_version: str = "0",
          overrides: Sequence[str] = ()) -> None:
    """Run the server until SIGTERM/SIGINT (graceful: in-flight answers finish, then the engine stops)."""
    import uvicorn

    api_key = api_key if api_key is not None else os.environ.get("ASYNCRL_API_KEY") or None
    state = build_state(model_or_config, weights_root=weights_root, api_key=api_key, seed=seed,
                        weight_version=weight_version, overrides=overrides)
    config = uvicorn.Config(build_app(state), host=host, port=port, log_level="warning", timeout_graceful_shutdown=10,
                            access_log=False)
    server = uvicorn.Server(config)
    print(f"asyncrl serve: {state.model_path} on http://{host}:{port} (weights root: {state.weights_root}, "
          f"api key: {'on' if api_key else 'off'})", flush=True)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to the handler
    # that was there before: make that a no-op, so the engine stops below and the exit status is 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        state.engine.shutdown()
    print("asyncrl serve: stopped", flush=True)
