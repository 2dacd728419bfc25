"""asyncrl's component benchmarks, one subcommand each; every run prints one JSON line.

    python scripts/bench.py train     # trainer step time and FLOP/s against the measured matmul peak
    python scripts/bench.py loop      # the train step inside the loop against the same step alone
    python scripts/bench.py engine    # engine tokens/s against transformers' generate; continuous vs static batching
    python scripts/bench.py model     # forward+backward time and memory, with and without log-prob chunking
    python scripts/bench.py batch     # validate-and-pack time of one batch (prepare_batch)
    python scripts/bench.py remote    # rollouts through asyncrl serve over HTTP against in-process
    python scripts/bench.py accel     # train-step FLOP utilisation, decode vs the memory floor (Qwen2.5-0.5B shape)
    python scripts/bench.py gpu       # rollouts on a GPU: decode vs the memory floor, vs generate, the GSM8K loop
    python scripts/bench.py reward_model  # reward-model scores per second, on the device and through the scoring queue
    python scripts/bench.py plan      # asyncrl plan's trainer and engine memory against a real step's
    python scripts/bench.py agent     # the OpenAI-SDK agent path's cost per completion against a plain workflow
    python scripts/bench.py pack      # trained tokens/s of the trainer step, packed against unpacked, GSM8K-like lengths
    python scripts/bench.py colocated # the engine's decode on 8 forced CPU devices (its own mesh on the trainer's) vs 1
    python scripts/bench.py prefix    # prompt tokens computed per generated token, prefix reuse on vs off (agent, multi-turn)
    python scripts/bench.py every_host  # rollout new tokens/s with every host generating vs process 0 alone (a core each)
    python scripts/bench.py serve_update  # serving copies of the weights alive when asyncrl serve installs an update
    python scripts/bench.py paged     # the paged KV cache beside a contiguous engine: long tails, groups, busy slots, reuse

``python scripts/bench.py SUBCOMMAND --help`` says what each measures and its fields. Each
lives in ``scripts/bench_components/<name>.py`` (``add_arguments(parser)`` and
``run(args) -> dict``) on the helpers of ``scripts/bench_common.py``; every line carries
``load_avg`` (the 1, 5 and 15 minute load averages at the start and the end: other work on a
shared machine moves every figure). The whole-loop benchmarks (``bench_rl.py``,
``bench_vs_trl.py``, ``bench_placement.py``) run training processes and stay scripts of their own.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

SUBCOMMANDS = ("train", "loop", "engine", "model", "batch", "remote", "accel", "gpu", "reward_model", "plan", "agent",
               "pack", "colocated", "prefix", "every_host", "serve_update", "paged")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n")[0],
                                  epilog="python scripts/bench.py SUBCOMMAND --help: what it measures and its fields")
    sub = top.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"bench_components.{name}")
        doc = module.__doc__ or name
        summary = " ".join(doc.split("\n\n")[0].split())  # the first paragraph, whole (it may wrap)
        command = sub.add_parser(name, help=summary, description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return top


def main(argv: Optional[list[str]] = None) -> dict:
    args = parser().parse_args(argv)
    result = {"bench": args.bench, **args.run(args)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
