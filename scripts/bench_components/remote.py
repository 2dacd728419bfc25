"""RemoteEngine's rollouts through ``asyncrl serve`` over HTTP against the in-process JaxEngine.

    python scripts/bench.py remote [--model tiny|bench-40m] [--requests 64] [--repeats 3]
    python scripts/bench.py remote --publish-only [--lora-rank 8] [--model bench-40m] [--weights-dir /dev/shm]

* ``tokens_per_s``: new tokens/s for ``--requests`` requests (n = 4 samples, 16-token prompt,
  32 new tokens, EOS ignored, temperature 1) submitted at once, through the in-process engine,
  through RemoteEngine with 1 server and with 2 servers (each ``asyncrl serve`` a subprocess with
  the same engine settings: 64 slots, KV 64, buckets [16, 64]).
* ``http_overhead_ms``: median latency of a 1-token greedy request through RemoteEngine -> 1 server
  minus the same request in process (serialisation, HTTP, validation, thread hops).
* ``pause_update_s``: median wall time of ``update_weights`` less its export of ``weights/vN`` (i.e.
  pause + load + continue + check on every server) with 1 and 2 servers, idle; ``write_weights_s``:
  the export alone.

``--publish-only`` (the cheaper publishes of docs/remote.md; one ``asyncrl serve`` subprocess, idle):

* ``full_publish_s``: median wall time of ``update_weights`` (write every tensor in bfloat16, then
  pause + load + continue + check) with every tensor changed, as a full-weight run's publish;
  ``full_bytes``: bytes written.
* ``lora_publish_s``: median wall time of ``update_lora`` with rank ``--lora-rank`` adapters on every
  linear layer after the first (base) publish: only the PEFT adapter written and loaded;
  ``lora_bytes``; ``lora_first_publish_s``: the first one, which writes the base too.
* ``*_write_s`` / ``*_server_load_s``: the two halves of each (the trainer's write; pause + the
  server's read and install + continue).
* ``lora_over_full``: the ratio (target: at most 0.1).
* ``server_bytes_read``: what the server read on the last full and LoRA loads (its
  ``/get_server_info``).

``--weights-dir``: the directory the versions go to (default: a temporary directory; ``/dev/shm``
puts them in RAM, as docs/remote.md recommends when the server runs on the same host).

Medians of ``--repeats`` timed runs after one warm-up. On a shared CPU the servers, the client and
the in-process engine compete for the same cores: read the load average printed beside.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_common import bench_40m_dir, load_avg, load_avg_since, median_time

REPO_ROOT = Path(__file__).resolve().parents[2]

ENGINE = ["--set", "engine.slots=64", "--set", "engine.kv_capacity=64", "--set", "engine.prefill_buckets=[16,64]"]
PROMPT, NEW, N = 16, 32, 4


def model_dir(name: str, tmp: Path) -> str:
    if name == "tiny":
        return "tiny"
    return str(bench_40m_dir(tmp / "bench-40m-hf"))


def write_config(tmp: Path, model: str) -> Path:
    path = tmp / "bench.yaml"
    path.write_text(f"model: {{path: {model}}}\ndata: {{max_prompt_tokens: 16}}\nrollout: {{max_new_tokens: 32}}\n"
                    "engine: {slots: 64, kv_capacity: 64, prefill_buckets: [16, 64]}\n")
    return path


def workload(vocab: int, count: int):
    from asyncrl.engine.protocol import GenerationRequest

    rng = np.random.default_rng(0)
    return [GenerationRequest(prompt_ids=[int(t) for t in rng.integers(3, vocab, PROMPT)], n=N, max_new_tokens=NEW,
                              stop_token_ids=[], sample_id=i) for i in range(count)]


def throughput(engine, requests, repeats) -> float:
    def run():
        futures = [engine.submit(r) for r in requests]
        for f in futures:
            f.result()

    return len(requests) * N * NEW / median_time(run, repeats)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", choices=["tiny", "bench-40m"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--publish-only", action="store_true", help="time the full publish against the LoRA adapter publish")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--weights-dir", default=None, help="where versions are written (e.g. /dev/shm); default: a temporary directory")


def run(args: argparse.Namespace) -> dict:
    if args.publish_only:
        return publish(args)
    import jax

    sys.path.insert(0, str(REPO_ROOT))  # the test suite's server wrapper
    from asyncrl.config import RemoteEngineConfig, load_config
    from asyncrl.engine.jax_engine import JaxEngine
    from asyncrl.engine.protocol import GenerationRequest
    from asyncrl.engine.remote import RemoteEngine
    from asyncrl.model import load_model
    from tests.remote_helpers import API_KEY, Server

    tmp = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    config = write_config(tmp, model_dir(args.model, tmp))
    cfg = load_config(config)
    loaded = load_model(cfg.model, with_tokenizer=False)
    graphdef, params = loaded.split()
    vocab = loaded.model.cfg.vocab_size
    requests = workload(vocab, args.requests)
    one_token = GenerationRequest(prompt_ids=[5, 6, 7], greedy=True, max_new_tokens=1, stop_token_ids=[])
    (tmp / "weights").mkdir()
    servers = [Server(tmp / "weights", tmp / f"serve{i}.log", model=str(config), extra=()) for i in range(2)]
    load_start = load_avg()
    out: dict = {"model": args.model, "requests": args.requests, "samples_per_request": N, "new_tokens": NEW}
    try:
        local = JaxEngine(graphdef, params, stop_token_ids=loaded.stop_token_ids, config=cfg.engine, warmup=True)
        out["tokens_per_s"] = {"in_process": throughput(local, requests, args.repeats)}
        local_latency = median_time(lambda: local.generate(one_token), 20)
        local.shutdown()
        for s in servers:
            s.wait_ready(300)
        version = 0
        for count in (1, 2):
            settings = RemoteEngineConfig(urls=[s.url for s in servers[:count]], health_check_every_s=0,
                                          max_concurrent_requests=256)
            remote = RemoteEngine(settings, graphdef=graphdef, stop_token_ids=loaded.stop_token_ids,
                                  weights_dir=tmp / "weights" / f"run{count}", api_key=API_KEY, version=version)
            out["tokens_per_s"][f"servers_{count}"] = throughput(remote, requests, args.repeats)
            if count == 1:
                remote_latency = median_time(functools.partial(remote.generate, one_token), 20)
                out["http_overhead_ms"] = 1e3 * (remote_latency - local_latency)
                out["one_token_latency_ms"] = {"in_process": 1e3 * local_latency, "remote": 1e3 * remote_latency}
            times, writes = [], []
            for k in range(args.repeats + 1):
                new = jax.tree.map(lambda x, k=k: x * (1 + 1e-3 * (k + 1)), params)
                t0 = time.perf_counter()
                remote.write_weights(new, version + 1)
                writes.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                remote.update_weights(new, version + 1)
                times.append(time.perf_counter() - t0 - writes[-1])  # update_weights writes again: count that once, apart
                version += 1
            out.setdefault("pause_update_s", {})[f"servers_{count}"] = statistics.median(times[1:])
            out["write_weights_s"] = statistics.median(writes[1:])
            remote.shutdown()
            if count == 1:  # the second server must catch up to the version before it joins
                for s in servers[1:]:
                    import httpx

                    httpx.post(f"{s.url}/update_weights_from_disk", headers={"Authorization": f"Bearer {API_KEY}"},
                               json={"model_path": str(tmp / "weights" / "run1" / f"v{version}"), "weight_version": str(version)},
                               timeout=300).raise_for_status()
    finally:
        for s in servers:
            s.terminate(10)
    out["speedup_2_servers_vs_in_process"] = out["tokens_per_s"]["servers_2"] / out["tokens_per_s"]["in_process"]
    return {**out, **load_avg_since(load_start)}


def publish(args: argparse.Namespace) -> dict:
    """``--publish-only``: the full publish against the LoRA adapter publish (module docstring)."""
    import httpx
    import jax

    sys.path.insert(0, str(REPO_ROOT))
    from asyncrl.config import RemoteEngineConfig, load_config
    from asyncrl.engine.remote import RemoteEngine
    from asyncrl.model import load_model
    from asyncrl.model.lora import LoraSpec, attach_lora
    from tests.remote_helpers import API_KEY, Server

    tmp = Path(tempfile.mkdtemp(prefix="bench-publish-"))
    root = Path(tempfile.mkdtemp(prefix="bench-publish-", dir=args.weights_dir)) if args.weights_dir else tmp / "weights"
    root.mkdir(exist_ok=True)
    config = write_config(tmp, model_dir(args.model, tmp))
    loaded = load_model(load_config(config).model, with_tokenizer=False)
    graphdef, params = loaded.split()
    server = Server(root, tmp / "serve.log", model=str(config), extra=())
    load_start = load_avg()
    out: dict = {"model": args.model, "lora_rank": args.lora_rank, "dtype": "bfloat16",
                 "weights_dir": "dev-shm" if str(root).startswith("/dev/shm") else "disk"}

    def read_bytes() -> float:
        info = httpx.get(f"{server.url}/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
        return float(info["serve/bytes_read"])

    try:
        server.wait_ready(300)
        settings = RemoteEngineConfig(urls=[server.url], health_check_every_s=0, publish_adapters=True)
        remote = RemoteEngine(settings, graphdef=graphdef, stop_token_ids=loaded.stop_token_ids, weights_dir=root / "run",
                              api_key=API_KEY, version=0)
        full, parts = [], []
        for k in range(args.repeats + 1):
            new = jax.tree.map(lambda x, k=k: x * (1 + 1e-3 * (k + 1)), params)
            jax.block_until_ready(new)
            t0 = time.perf_counter()
            remote.update_weights(new, remote.version + 1)
            full.append(time.perf_counter() - t0)
            parts.append((remote.writer.last_write_s, remote.metrics()["engine/pause_update_s"]))
        out["full_publish_s"] = statistics.median(full[1:])
        out["full_write_s"] = statistics.median(p[0] for p in parts[1:])  # the trainer's write (cast, hash, file)
        out["full_server_load_s"] = statistics.median(p[1] for p in parts[1:])  # pause + the server's read + install + continue
        out["full_bytes"] = remote.writer.last_bytes
        out.setdefault("server_bytes_read", {})["full"] = read_bytes()
        spec = LoraSpec(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
        lora = attach_lora(loaded.config, params, spec)
        times, parts = [], []
        for k in range(args.repeats + 1):
            adapters = jax.tree.map(lambda x, k=k: x + 1e-3 * (k + 1), lora.adapters)
            jax.block_until_ready(adapters)
            t0 = time.perf_counter()
            remote.update_lora(params, adapters, spec, remote.version + 1)
            times.append(time.perf_counter() - t0)
            parts.append((remote.writer.last_write_s, remote.metrics()["engine/pause_update_s"]))
        out["lora_write_s"] = statistics.median(p[0] for p in parts[1:])
        out["lora_server_load_s"] = statistics.median(p[1] for p in parts[1:])
        out["lora_first_publish_s"] = times[0]
        out["lora_publish_s"] = statistics.median(times[1:])
        out["lora_bytes"] = remote.writer.last_bytes
        out["server_bytes_read"]["lora"] = read_bytes()
        out["lora_over_full"] = out["lora_publish_s"] / out["full_publish_s"]
        remote.shutdown()
    finally:
        server.terminate(10)
        shutil.rmtree(root, ignore_errors=True)  # /dev/shm is RAM: leave nothing behind
        shutil.rmtree(tmp, ignore_errors=True)
    return {**out, **load_avg_since(load_start)}
