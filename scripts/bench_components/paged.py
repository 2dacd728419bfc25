"""The paged KV cache against a contiguous engine, side by side in one run, on the CPU.

    git worktree add /tmp/contiguous COMMIT   # a checkout of the engine before the paged cache
    python scripts/bench.py paged --baseline /tmp/contiguous [--parts long_tail group short agent prefix]

Each side runs in a process of its own, with its checkout first on ``sys.path`` (``paged``: this
one; ``contiguous``: ``--baseline``; without it only the paged side runs and the ratios are null).
Parts and fields (``*_paged``, ``*_contiguous``, their ratio):

* ``long_tail``: bench-40m, prompts of 256 tokens, new-token budgets log-uniform between 16 and
  2,048 (``16 * 2 ** U(0, 7)``, rounded down: median about 181, mean about 419; EOS ignored, so each
  request generates its budget), a stream: as many client threads as the engine has slots, each
  sending its next request as soon as its last returns (rollout workers; with ``--long-group g``,
  each run of ``g`` consecutive requests shares one prompt, as a GRPO group's samples do), measured over
  ``--window-s`` seconds after ``--skip-s`` (a program first used in the window compiles in it). The same KV bytes on
  both sides: the contiguous engine's 8 slots of 2,304 positions, the paged engine's pool of
  8 x 2,304 / 16 = 1,152 pages of 16 with ``--paged-slots`` slots (64). In the window:
  ``sequences_per_step`` is decode tokens over decode steps (sequences decoding together; target
  paged >= 4x), ``new_tokens_per_s`` decode tokens per second (target >= 2x), ``preemptions``; the
  paged side's ``kv_pages_used_mean`` (the pool's share running sequences hold, sampled every second)
  and ``positions_per_sequence`` (those positions over ``sequences_per_step``: what bounds how many
  sequences the pool holds at once). Both
  engines with ``engine.attention_buckets: 4``.
* ``group``: 16 samples (``n = 16``) of a 1,024-token prompt, 64 new tokens each, on bench-40m:
  ``group_pages_max`` is the most pool pages in use during the request (sampled every few
  milliseconds), ``group_pages_expected`` the prompt's pages plus 16 x each sample's new pages
  (``64 + 16 x 4 = 128``; target: within one page per sample), ``group_positions_contiguous`` the
  positions the contiguous engine holds for the same request (16 x 1,088).
* ``short``: bench-40m, every one of ``--short-slots`` (256) slots busy with 32-token prompts and 32
  new tokens (``bench.py colocated``'s one-device line). Both sides' processes stay up and take
  turns, one round each in alternating order (``--repeats`` rounds per side after two untimed
  ones), so a change in the machine's load moves both alike: ``short_decode_ms_per_step`` of each
  (its decode time over its decode steps in those rounds), ``short_new_tokens_per_s`` (the median
  round), and the ratio: the median of the rounds' paired ratios (target: the page indirection
  costs at most 10%: ratio <= 1.10).
* ``agent``: the A/B/A probe through the engine (tiny, 8 slots): A (a 96-token system prompt + 10),
  B (the same system prompt, other 10), then A's next turn (A + its answer + 10):
  ``aba_hit_tokens`` (A's history reused) against ``aba_history_tokens`` (all of it).
* ``prefix``: each side's ``scripts/bench.py prefix`` (the calculator agent and multi-turn GSM8K,
  reuse on against off, ``--rl-steps`` RL steps): ``agent_prefill_per_generated`` (target: paged at
  most the contiguous's) and ``multi_turn_prefill_reduction`` (target: paged at least the
  contiguous's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

PARTS = ("long_tail", "group", "short", "agent", "prefix")
PROMPT, LONG_BUDGET, CONTIGUOUS_SLOTS, PAGE = 256, 2048, 8, 16
SHORT_PROMPT, SHORT_NEW = 32, 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", default=None, help="a checkout of the contiguous engine (its repository root)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--requests", type=int, default=1000, help="requests the long-tailed stream may draw (more than it uses)")
    parser.add_argument("--window-s", type=float, default=240.0, help="seconds the long-tailed stream is measured")
    parser.add_argument("--skip-s", type=float, default=90.0, help="seconds of the stream before the window")
    parser.add_argument("--paged-slots", type=int, default=64, help="the paged engine's slots in the long-tailed round")
    parser.add_argument("--long-group", type=int, default=1,
                        help="samples per prompt in the long-tailed stream (GRPO's group: consecutive requests share a prompt)")
    parser.add_argument("--short-slots", type=int, default=256, help="busy slots of the short round")
    parser.add_argument("--repeats", type=int, default=4, help="timed rounds of each side in the short part (after two untimed ones)")
    parser.add_argument("--rl-steps", type=int, default=8, help="RL steps of each prefix run")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "paged" or "contiguous": run here
    parser.add_argument("--short-turns", action="store_true", help=argparse.SUPPRESS)  # the short part, a round per line of input
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> dict:
    if args.long_group < 1:
        raise SystemExit(f"bench.py paged: --long-group must be at least 1 (given {args.long_group})")
    if args.child is not None:
        return child(args)
    from bench_common import load_avg, load_avg_since
    from runlib import REPO_ROOT, child_env

    load_start = load_avg()
    sides = {"paged": REPO_ROOT}
    if args.baseline is not None:
        sides["contiguous"] = Path(args.baseline).resolve()
    result: dict = {"requests": args.requests, "budgets": "16 * 2 ** U(0, 7) new tokens (log-uniform 16 to 2048)",
                    "long_group": args.long_group,
                    "baseline": str(sides.get("contiguous"))}
    figures: dict[str, dict] = {side: {} for side in sides}
    short_ratio = None
    if "short" in args.parts:
        short_ratio = _short_in_turns(sides, args, figures)
    for side, root in sides.items():
        engine_parts = [p for p in args.parts if p not in ("prefix", "short")]
        if engine_parts:
            argv = [sys.executable, str(REPO_ROOT / "scripts" / "bench.py"), "paged", "--child", side, "--root", str(root),
                    "--parts", *engine_parts, "--requests", str(args.requests), "--paged-slots", str(args.paged_slots),
                    "--long-group", str(args.long_group),
                    "--window-s", str(args.window_s), "--skip-s", str(args.skip_s),
                    "--short-slots", str(args.short_slots), "--repeats", str(args.repeats)]
            figures[side].update(_last_json(_child(argv, side, env=child_env(JAX_PLATFORMS="cpu"))))
        if "prefix" in args.parts:
            argv = [sys.executable, str(root / "scripts" / "bench.py"), "prefix", "--rl-steps", str(args.rl_steps)]
            prefix = _last_json(_child(argv, side, cwd=root, env=child_env(JAX_PLATFORMS="cpu")))
            figures[side].update({
                "agent_prefill_per_generated": prefix.get("agent_on_prefill_per_generated"),
                "multi_turn_prefill_reduction": prefix.get("multi_turn_prefill_reduction")})
    for side, values in figures.items():
        for name, value in values.items():
            if name not in ("bench", "load_avg"):
                result[f"{name}_{side}"] = value
    ratio = lambda name: (_ratio(figures["paged"].get(name), figures["contiguous"].get(name))  # noqa: E731
                          if "contiguous" in figures else None)
    result.update({
        "sequences_per_step_ratio": ratio("sequences_per_step"),  # target >= 4
        "new_tokens_per_s_ratio": ratio("new_tokens_per_s"),  # target >= 2
        "short_decode_ms_per_step_ratio": short_ratio,  # target <= 1.10
        "agent_prefill_per_generated_ratio": ratio("agent_prefill_per_generated"),  # target <= 1
        "multi_turn_prefill_reduction_ratio": ratio("multi_turn_prefill_reduction"),  # target >= 1
    })
    result.update(load_avg_since(load_start))
    return result


def _child(argv: list[str], side: str, **kwargs: Any) -> str:
    """``argv``'s stdout; a failure raises with the end of its stderr (a dataset offline: set
    ``ASYNCRL_DATA_DIR``, the prefix part trains on GSM8K)."""
    proc = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.py paged ({side}): {' '.join(argv[1:4])} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def _short_in_turns(sides: dict[str, Path], args: argparse.Namespace, figures: dict[str, dict]) -> Optional[float]:
    """The short part: one child per side, both alive, taking turns round by round (the first side
    first in even rounds, last in odd ones). Each side's figures go into ``figures``; returns the
    median of the rounds' paired ratios of decode ms per step (paged over contiguous), or None
    with one side."""
    import statistics
    import tempfile

    from runlib import REPO_ROOT, child_env

    children: dict[str, tuple[subprocess.Popen, Any]] = {}
    rounds: dict[str, list[dict]] = {side: [] for side in sides}
    try:
        for side, root in sides.items():  # one after the other: each compiles while the other waits
            argv = [sys.executable, str(REPO_ROOT / "scripts" / "bench.py"), "paged", "--child", side, "--root", str(root),
                    "--parts", "short", "--short-slots", str(args.short_slots), "--short-turns"]
            errors = tempfile.TemporaryFile("w+")
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True,
                                    env=child_env(JAX_PLATFORMS="cpu"))
            children[side] = (proc, errors)
            _turn_reply(proc, errors, side)  # ready
        order = list(children)
        for turn in range(args.repeats):
            for side in order if turn % 2 == 0 else order[::-1]:
                proc, errors = children[side]
                assert proc.stdin is not None
                proc.stdin.write("round\n")
                proc.stdin.flush()
                rounds[side].append(_turn_reply(proc, errors, side))
    finally:
        for proc, errors in children.values():
            if proc.stdin is not None:
                proc.stdin.close()  # the child's end of input: it shuts its engine down and exits
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            errors.close()
    per_step = {side: [1e3 * r["decode_s"] / r["steps"] for r in done] for side, done in rounds.items()}
    for side, done in rounds.items():
        figures[side].update({
            "short_decode_ms_per_step": round(1e3 * sum(r["decode_s"] for r in done) / sum(r["steps"] for r in done), 2),
            "short_new_tokens_per_s": round(args.short_slots * SHORT_NEW / statistics.median(r["seconds"] for r in done), 1),
            "short_round_ms_per_step": [round(x, 1) for x in per_step[side]]})
    if len(rounds) < 2:
        return None
    return round(statistics.median(p / c for p, c in zip(per_step["paged"], per_step["contiguous"])), 3)


def _turn_reply(proc: subprocess.Popen, errors: Any, side: str) -> dict:
    """The next JSON line a turn-taking child writes; a child that exits instead raises with its stderr's end."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    proc.wait()
    errors.seek(0)
    raise RuntimeError(f"bench.py paged ({side}): the short part's child exited {proc.returncode}:\n{errors.read()[-3000:]}")


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a is not None and b else None


def _last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


# --------------------------------------------------------------------------- one side, in its own process


def child(args: argparse.Namespace) -> dict:
    root = str(Path(args.root).resolve())
    # this checkout first: the editable install's finder would import the one the venv points at
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, root)
    for name in [m for m in sys.modules if m == "asyncrl" or m.startswith("asyncrl.")]:
        del sys.modules[name]
    import asyncrl

    assert asyncrl.__file__.startswith(root), asyncrl.__file__
    paged = args.child == "paged"
    out: dict = {}
    if "long_tail" in args.parts:
        out.update(long_tail(paged, args.requests, args.paged_slots, args.window_s, args.skip_s, args.long_group))
    if "group" in args.parts:
        out.update(group(paged))
    if "short" in args.parts:
        short_turns(paged, args.short_slots)
    if "agent" in args.parts:
        out.update(aba())
    return out


def _bench_40m() -> tuple[Any, Any]:
    """bench-40m (random init, float32), the same weights on both sides."""
    import dataclasses

    from asyncrl.model import bench_40m_config, init_decoder, split_params

    cfg = dataclasses.replace(bench_40m_config(), param_dtype="float32", compute_dtype="float32")
    return split_params(init_decoder(cfg, seed=0))


def _engine(graphdef: Any, params: Any, **config: Any) -> Any:
    from asyncrl.config import EngineConfig
    from asyncrl.engine.jax_engine import JaxEngine

    return JaxEngine(graphdef, params, stop_token_ids=(), config=EngineConfig(**config), warmup=False)


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, size=length)] for _ in range(count)]


def long_tail(paged: bool, requests: int, paged_slots: int, window_s: float, skip_s: float, group: int = 1) -> dict:
    import threading
    import time

    import numpy as np

    from asyncrl.engine.protocol import GenerationRequest

    graphdef, params = _bench_40m()
    capacity = PROMPT + LONG_BUDGET
    config: dict[str, Any] = {"kv_capacity": capacity, "prefill_buckets": [PROMPT], "decode_chunk": 8, "attention_buckets": 4}
    if paged:
        config.update(slots=paged_slots, kv_pages=CONTIGUOUS_SLOTS * capacity // PAGE, page_size=PAGE)
    else:
        config.update(slots=CONTIGUOUS_SLOTS)
    vocab = int(params["embed_tokens"]["embedding"].shape[0])
    rng = np.random.default_rng(7)
    budgets = [int(16 * 2 ** rng.uniform(0, 7)) for _ in range(requests)]
    prompts = _prompts(vocab, -(-requests // group), PROMPT, 8)
    calls = [GenerationRequest(prompt_ids=prompts[i // group], max_new_tokens=b, stop_token_ids=[], sample_id=i)
             for i, b in enumerate(budgets)]
    engine = _engine(graphdef, params, **config)  # programs compile on first use (most before the window)
    taken, lock, stop = iter(calls), threading.Lock(), threading.Event()

    def client() -> None:  # a rollout worker: its next request as soon as the last one returns
        while not stop.is_set():
            with lock:
                call = next(taken, None)
            if call is None:
                return
            engine.generate(call)

    try:
        clients = [threading.Thread(target=client, daemon=True) for _ in range(int(config["slots"]))]
        for thread in clients:
            thread.start()
        time.sleep(skip_s)  # past the start, where every sequence is short at once
        first, started = engine.metrics(), time.monotonic()
        used = []  # the pool's share running sequences hold, once a second (the paged engine's metric)
        while time.monotonic() < started + window_s:
            time.sleep(min(1.0, max(started + window_s - time.monotonic(), 0.0)))
            used.append(engine.metrics().get("engine/kv_pages_used"))
        last, seconds = engine.metrics(), time.monotonic() - started
        stop.set()
        engine.abort_all()
        for thread in clients:
            thread.join(60)
    finally:
        engine.shutdown()
    delta = lambda name: last.get(name, 0.0) - first.get(name, 0.0)  # noqa: E731
    assert next(taken, None) is not None, "--requests ran out inside the window: give more"
    sequences = delta("engine/decode_tokens") / max(delta("engine/decode_steps"), 1)
    out = {"slots": config["slots"], "group": group, "budget_median": float(np.median(budgets)), "budget_mean": float(np.mean(budgets)),
           "sequences_per_step": round(sequences, 2), "new_tokens_per_s": round(delta("engine/decode_tokens") / seconds, 1),
           "window_s": round(seconds, 1), "preemptions": delta("engine/preemptions")}
    if paged and all(u is not None for u in used):
        # What the pool holds per running sequence: its pages over the sequences decoding together.
        used_mean = float(np.mean(used))
        out.update(kv_pages_used_mean=round(used_mean, 3),
                   positions_per_sequence=round(used_mean * config["kv_pages"] * PAGE / max(sequences, 1e-9), 1))
    return out


def group(paged: bool) -> dict:
    import threading
    import time

    from asyncrl.engine.protocol import GenerationRequest

    graphdef, params = _bench_40m()
    new, prompt_len, n = 64, 1024, 16
    config: dict[str, Any] = {"slots": n, "kv_capacity": prompt_len + new, "prefill_buckets": [256], "decode_chunk": 8}
    if not paged:
        return {"group_positions_contiguous": n * (prompt_len + new)}
    vocab = int(params["embed_tokens"]["embedding"].shape[0])
    engine = _engine(graphdef, params, **config, page_size=PAGE)
    most = [0.0]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.002):
            most[0] = max(most[0], engine.metrics()["engine/kv_pages_used"])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        started = time.monotonic()
        out = engine.generate(GenerationRequest(prompt_ids=_prompts(vocab, 1, prompt_len, 9)[0], n=n, max_new_tokens=new,
                                                stop_token_ids=[], temperature=1.0, sample_id=1))
        seconds = time.monotonic() - started
    finally:
        done.set()
        watcher.join(5)
        pool = engine.kv_pages
        engine.shutdown()
    assert all(len(o.output_ids) == new for o in out)
    return {"group_pages_max": round(most[0] * pool), "group_pages_expected": prompt_len // PAGE + n * new // PAGE,
            "group_pages_allowed": prompt_len // PAGE + n * new // PAGE + n, "group_s": round(seconds, 1)}


def short_turns(paged: bool, slots: int) -> None:
    """The short part's child: every slot busy (:func:`bench_common.busy_round`), two untimed rounds,
    then a line ``{"ready": true}``; after that one round per line read from stdin, each answered
    by a JSON line (``seconds``, ``decode_s``, ``steps``), until stdin ends."""
    from bench_common import busy_round

    graphdef, params = _bench_40m()
    config: dict[str, Any] = {"slots": slots, "kv_capacity": SHORT_PROMPT + SHORT_NEW, "prefill_buckets": [SHORT_PROMPT],
                              "decode_chunk": 8}
    if paged:
        config["page_size"] = PAGE
    vocab = int(params["embed_tokens"]["embedding"].shape[0])
    prompts = _prompts(vocab, slots, SHORT_PROMPT, 10)
    engine = _engine(graphdef, params, **config)
    try:
        for turn in range(2):  # compiles, then settles
            busy_round(engine, prompts, SHORT_NEW, turn * slots)
        print(json.dumps({"ready": True}), flush=True)
        for turn, _ in enumerate(sys.stdin, start=2):
            seconds, decode_s, steps = busy_round(engine, prompts, SHORT_NEW, turn * slots)
            print(json.dumps({"seconds": seconds, "decode_s": decode_s, "steps": steps}), flush=True)
    finally:
        engine.shutdown()


def aba() -> dict:
    from asyncrl.engine.protocol import GenerationRequest
    from asyncrl.model import load_model

    lm = load_model("tiny", with_tokenizer=False)
    graphdef, params = lm.split()
    engine = _engine(graphdef, params, slots=8, kv_capacity=160, prefill_buckets=[32, 128, 160], decode_chunk=4)
    system = _prompts(28, 1, 96, 11)[0]
    a_prompt, b_prompt = system + _prompts(28, 1, 10, 12)[0], system + _prompts(28, 1, 10, 13)[0]
    try:
        (a,) = engine.generate(GenerationRequest(prompt_ids=a_prompt, greedy=True, max_new_tokens=16, stop_token_ids=[]))
        engine.generate(GenerationRequest(prompt_ids=b_prompt, greedy=True, max_new_tokens=16, stop_token_ids=[]))
        turn = a_prompt + a.output_ids.tolist() + _prompts(28, 1, 10, 14)[0]
        (again,) = engine.generate(GenerationRequest(prompt_ids=turn, greedy=True, max_new_tokens=4, stop_token_ids=[]))
    finally:
        engine.shutdown()
    return {"aba_hit_tokens": again.usage.prefix_hit_tokens, "aba_history_tokens": len(a_prompt) - 1 + len(a.output_ids),
            "aba_prompt_tokens": len(turn)}
