"""One episode of the OpenAI-SDK calculator agent (workflows/calculator_agent.py), shown token by token.

    python docs/examples/calculator_agent.py          # the in-process client
    python docs/examples/calculator_agent.py --http   # the episode-scoped base_url, over HTTP

A scripted engine stands in for the model (it calls the calculator, then answers), so the
output is the same on every machine: the agent's conversation, then the trajectory the run
became, with the completions trained (their engine versions) and everything else masked.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the checkout

from asyncrl.config import load_config  # noqa: E402
from asyncrl.engine import FakeEngine  # noqa: E402
from asyncrl.model.tiny_qwen3 import chatml_char_tokenizer  # noqa: E402
from workflows.calculator_agent import CalculatorAgent  # noqa: E402


def main(http: bool) -> None:
    tokenizer = chatml_char_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>', "84"]
    engine = FakeEngine(vocab_size=len(tokenizer), eos_token_id=eos, version=3,
                        responder=lambda request, i: tokenizer.encode(turns[request.turn]) + [eos])
    cfg = load_config(data={
        "rollout": {"group_size": 1, "max_new_tokens": 128, "max_seq_len": 1152},
        "data": {"max_prompt_tokens": 1024},
        "engine": {"kv_capacity": 1152, "prefill_buckets": [1024]},
        "rewards": [{"fn": "exact_match"}], "algo": {"estimator": "batch"},
    })
    agent = CalculatorAgent(cfg, tokenizer, http=http)
    group = agent.run_episode(engine, {"prompt": "what is 12*7?", "answer": "84", "sample_id": 0})
    assert group is not None  # an AgentWorkflow always returns its group (or raises)
    [trajectory] = group.trajectories
    ids, trained, versions = trajectory.input_ids, trajectory.loss_mask, trajectory.versions
    print(tokenizer.decode(ids.tolist()).split("</tools>")[-1].split("<|im_end|>\n", 1)[-1])  # past the tools block
    for start in range(len(ids)):
        if start == 0 or trained[start] != trained[start - 1]:
            end = start + 1
            while end < len(ids) and trained[end] == trained[start]:
                end += 1
            text = tokenizer.decode(ids[start:end].tolist())
            label = f"trained, version {versions[start]}" if trained[start] else "masked"
            print(f"{label:20s} {end - start:4d} tokens  {text[-60:]!r}")
    print(f"reward {trajectory.reward}  trajectories {len(group.trajectories)}  "
          f"trained tokens {int(trained.sum())} of {len(ids)}  splits {int(agent.metrics()['agent_splits'])}")
    if http:
        agent.gateway().close()


if __name__ == "__main__":
    main(http="--http" in sys.argv[1:])
