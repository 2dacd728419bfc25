"""The tool-use example of docs/workflows.md, runnable: ``python docs/examples/tool_workflow.py``.

A two-turn workflow: the model writes an expression, a tool (the calculator of
``workflows/calculator.py``) answers, the model answers again; only the model's own tokens
are trained. Run as a script, it plays one episode against a scripted ``FakeEngine`` with the
``tiny`` model's character tokenizer and prints what each token is. The full built-in
version (tags, limits, budgets, episode metrics) is ``workflows/multi_turn.py``
(``workflow: multi_turn``).
"""

from asyncrl import GenerationRequest, RolloutWorkflow, TrajectoryGroup
from asyncrl.rollout import TrajectoryBuilder
from workflows.calculator import CalcError, calculate


def run_tool(text: str) -> str:
    """The tool: evaluate the model's arithmetic (no eval; refused input gets an error)."""
    try:
        return "=" + calculate(text) + "\n"
    except CalcError:
        return "=S\n"  # an error marker the tiny vocabulary can spell


def my_reward(sample, completion: str) -> float:
    return float(completion.strip().endswith(sample["answer"]))


class ToolWorkflow(RolloutWorkflow):
    """Write an expression, see the tool's answer, answer; only the model's own tokens are trained."""

    def __init__(self, cfg, tokenizer, max_turns: int = 2):
        super().__init__(cfg, tokenizer)                  # self.cfg, self.tokenizer
        self.max_turns = max_turns

    def run_episode(self, engine, sample):
        r = self.cfg.rollout
        messages, prompt = self.messages(sample)
        prompt_ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        trajectories = []
        for i in range(r.group_size):
            traj = TrajectoryBuilder().add_tokens(prompt_ids)     # not trained, version -1
            for turn in range(self.max_turns):
                out = engine.generate(GenerationRequest(
                    prompt_ids=traj.input_ids.tolist(), temperature=r.temperature,
                    max_new_tokens=r.max_new_tokens,
                    sample_id=sample["sample_id"], index_in_group=i, turn=turn,
                ))[0]
                traj.add_generation(out)                          # trained, with its logprobs/versions
                if out.stop_reason != "length" and turn + 1 < self.max_turns:
                    text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
                    traj.add_tokens(self.tokenizer.encode(run_tool(text), add_special_tokens=False))  # masked
            completion = self.tokenizer.decode(traj.input_ids[len(prompt_ids):], skip_special_tokens=True)
            trajectories.append(traj.build(temperature=r.temperature, reward=my_reward(sample, completion),
                                           metadata={"episode_metrics": {"turns": self.max_turns}}))
        return TrajectoryGroup(trajectories=trajectories, metadata={"sample_id": sample["sample_id"], "prompt": prompt})


def main() -> None:
    from asyncrl import FakeEngine, load_config
    from asyncrl.model.tiny import build_tiny_tokenizer
    from asyncrl.rollout.trajectory import check_group

    tok = build_tiny_tokenizer()
    cfg = load_config(data={"rollout": {"group_size": 2, "max_new_tokens": 8}})
    turns = {0: "12+34", 1: "46"}  # scripted model output per turn, each ended by EOS

    def respond(request, i):
        return tok.encode(turns[request.turn], add_special_tokens=False) + [tok.eos_token_id]

    engine = FakeEngine(vocab_size=len(tok), eos_token_id=tok.eos_token_id, responder=respond)
    group = ToolWorkflow(cfg, tok).run_episode(engine, {"prompt": "A:12+34", "answer": "46", "sample_id": 0})
    check_group(group, group_size=2, workflow="ToolWorkflow", sample_id=0)  # the executor's schema check
    traj = group.trajectories[0]
    for token, trained, version in zip(traj.input_ids.tolist(), traj.loss_mask.tolist(), traj.versions.tolist()):
        print(f"{tok.convert_ids_to_tokens(token)!r:>16}  trained={trained!s:<5}  version={version}")
    print(f"reward {traj.reward}  trained tokens {int(traj.loss_mask.sum())} of {traj.num_tokens}")


if __name__ == "__main__":
    main()
