"""Serving copies of the weights alive when asyncrl serve installs an update.

``/update_weights_from_disk`` (``ServeState.load_and_install``, what the route runs) on an engine
that serves a model of ``--model`` (a ``tiny:`` spec; default bench-40m's layer shapes), with
``--adapter-base`` also holding an adapter's unmerged base as after ``/load_lora_adapter``. The
moment the engine has installed the new weights, the process's live device arrays are summed
(``jax.live_arrays()``). Fields: ``weights_mb`` (one serving copy), ``live_before_mb`` and
``live_at_install_mb``, and ``serving_copies_at_peak`` = 1 + the growth over the weights (1.0:
the old copy is gone before the new one arrives; 2.0: both at once).

    python scripts/bench.py serve_update [--model tiny:hidden=512,layers=8,intermediate=1536,heads=8,kv_heads=4]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from bench_common import load_avg, load_avg_since

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = "tiny:hidden=512,layers=8,intermediate=1536,heads=8,kv_heads=4"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"a tiny: spec (default {DEFAULT_MODEL})")
    parser.add_argument("--adapter-base", action="store_true",
                        help="the server also holds an adapter's unmerged base, as after /load_lora_adapter")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import numpy as np
    from safetensors.numpy import save_file

    from asyncrl.config import load_config
    from asyncrl.model import load_model
    from asyncrl.model.hf import hf_tensors_from_params
    from asyncrl.run.build import build_local_engine
    from asyncrl.serve.state import ServeState

    start = load_avg()
    loaded = load_model(args.model, with_tokenizer=False)
    cfg = load_config(REPO_ROOT / "configs" / "quickstart.yaml", ["model.compute_dtype=float32"])
    model_cfg, model_path, stop_ids = loaded.config, str(loaded.path), loaded.stop_token_ids
    graphdef, params = loaded.split()
    params = jax.tree.map(np.asarray, params)  # host values: the engine's device copy is the only one
    del loaded
    engine = build_local_engine(cfg, graphdef, params, stop_ids)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        state = ServeState(engine, model_cfg, model_path, weights_root=root, api_key=None)
        if args.adapter_base:
            state.base = engine.served_params
        weights = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.served_params))
        (root / "v1").mkdir()
        save_file({k: np.asarray(v) * 2 for k, v in hf_tensors_from_params(model_cfg, params).items()},
                  str(root / "v1" / "model.safetensors"))
        del params

        def live() -> int:
            return sum(a.nbytes for a in jax.live_arrays())

        install, at_install = engine._take, []

        def measured_take(new: Any) -> None:
            install(new)
            at_install.append(live())

        engine._take = measured_take
        before = live()
        try:
            state.load_and_install(root / "v1", "1")
        finally:
            engine.shutdown()
    return {"model": args.model, "adapter_base": args.adapter_base, "weights_mb": round(weights / 1e6, 1),
            "live_before_mb": round(before / 1e6, 1), "live_at_install_mb": round(at_install[0] / 1e6, 1),
            "serving_copies_at_peak": round(1 + (at_install[0] - before) / weights, 2), **load_avg_since(start)}
