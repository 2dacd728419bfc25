"""Overhead of the OpenAI-SDK agent path: episodes/s of an AgentWorkflow against a plain
RolloutWorkflow making the same engine calls, on an instant scripted engine (so the number is
the client, transport, templating and assembly cost alone; on a real engine generation dominates).

    python scripts/bench.py agent [--episodes 64] [--turns 2] [--group-size 4]

Prints one JSON line: episodes/s and ms per completion of each path, and the ratio.
"""

from __future__ import annotations

import argparse
import time

from bench_common import load_avg, load_avg_since

from asyncrl.agent import AgentWorkflow
from asyncrl.config import load_config
from asyncrl.engine import FakeEngine, GenerationRequest
from asyncrl.model.tiny_qwen3 import chatml_char_tokenizer
from asyncrl.rollout.trajectory import TrajectoryBuilder, TrajectoryGroup
from asyncrl.rollout.workflow import RolloutWorkflow


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)


def run(args: argparse.Namespace) -> dict:
    load_start = load_avg()
    tok = chatml_char_tokenizer()
    cfg = load_config(data={"rollout": {"group_size": args.group_size, "max_new_tokens": 16, "max_seq_len": 512},
                            "data": {"max_prompt_tokens": 256}, "engine": {"kv_capacity": 512, "prefill_buckets": [256, 512]}})
    engine = FakeEngine(vocab_size=len(tok), eos_token_id=2, first_token_id=3, eos_prob=0.2)
    turns = args.turns

    class Agent(AgentWorkflow):
        async def run(self, client, sample):
            messages = [{"role": "user", "content": sample["prompt"]}]
            for _ in range(turns):
                answer = await client.chat.completions.create(model="policy", messages=messages)
                messages += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
            return 1.0

    class Plain(RolloutWorkflow):
        """The same conversation with engine.generate and token ids (what a hand-written workflow does)."""

        def run_episode(self, engine, sample):
            trajectories = []
            for index in range(args.group_size):
                messages = [{"role": "user", "content": sample["prompt"]}]
                builder, covered = TrajectoryBuilder(), 0
                for turn in range(turns):
                    prompt = self.prompt_ids(messages)
                    response = engine.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=16, sample_id=sample["sample_id"],
                                                                 index_in_group=index, turn=turn))[0]
                    builder.add_tokens(prompt[covered:]).add_generation(response)
                    covered = len(prompt) + len(response.output_ids)
                    text = tok.decode(list(response.output_ids), skip_special_tokens=True)
                    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
                trajectories.append(builder.build(temperature=1.0, reward=1.0))
            return TrajectoryGroup(trajectories=trajectories, metadata={"sample_id": sample["sample_id"]})

    result = {"episodes": args.episodes, "turns": turns, "group_size": args.group_size}
    completions = args.episodes * args.group_size * turns
    for name, workflow in (("plain", Plain(cfg, tok)), ("agent", Agent(cfg, tok))):
        workflow.run_episode(engine, {"prompt": "warm up", "sample_id": 10**6})
        start = time.perf_counter()
        for k in range(args.episodes):
            workflow.run_episode(engine, {"prompt": f"what is {k}+{k}?", "sample_id": k})
        seconds = time.perf_counter() - start
        result[f"{name}_episodes_per_s"] = round(args.episodes / seconds, 2)
        result[f"{name}_ms_per_completion"] = round(1000 * seconds / completions, 3)
    result["agent_overhead_ms_per_completion"] = round(result["agent_ms_per_completion"] - result["plain_ms_per_completion"], 3)
    return {**result, **load_avg_since(load_start)}
