"""Shared pieces of the async-core tests: configs, a token-level workflow, group builders,
and a tiny character-level HF tokenizer with a chat template and an EOS token."""

from __future__ import annotations

import threading
from typing import Any, Mapping, Optional

import numpy as np

from asyncrl.config import Config, load_config
from asyncrl.engine.protocol import GenerationRequest
from asyncrl.rollout.trajectory import Trajectory, TrajectoryBuilder, TrajectoryGroup
from asyncrl.rollout.workflow import RolloutWorkflow

EOS = 1

# The calculator tool workflow on `tiny` (the add task), its tool tags spelled in the tiny
# character vocabulary: the run config sections the multi-turn loop tests share.
MULTI_TURN_ON_TINY: dict[str, Any] = {
    "data": {"dataset": {"target": "add", "kwargs": {"train_size": 64, "eval_size": 4, "min_digits": 1, "max_digits": 2}},
             "max_prompt_tokens": 16},
    "workflow": {"target": "multi_turn", "kwargs": {"system_prompt": None, "call_open": "C", "call_close": "=",
                                                     "result_template": "{result}\n", "error_template": "S\n"}},
    "rewards": [{"fn": "positional_match"}],
    "rollout": {"batch_size": 2, "group_size": 4, "max_new_tokens": 16, "length_bucket": 32, "max_concurrent": 4},
}


def make_cfg(rollout: Optional[dict] = None, data: Optional[dict] = None, **sections: Any) -> Config:
    base = {"batch_size": 4, "group_size": 2, "max_staleness": 1, "max_concurrent": 8, "max_new_tokens": 8, "length_bucket": 8}
    base.update(rollout or {})
    raw = {"rollout": base, "data": {"max_prompt_tokens": 16, **(data or {})}, **sections}
    return load_config(data=raw)


class TokenWorkflow(RolloutWorkflow):
    """Prompt = a few tokens derived from the sample; one engine call with n = group_size.

    ``fail_rate``: share of samples (chosen by a hash of seed and sample id, so fixed per
    sample) whose episode raises. ``hook(sample)`` runs first (tests use it to block or crash).
    """

    def __init__(self, cfg: Config, *, fail_rate: float = 0.0, seed: int = 0, hook=None):
        super().__init__(cfg, tokenizer=None)
        self.fail_rate = fail_rate
        self.seed = seed
        self.hook = hook
        self.episodes = 0
        self._lock = threading.Lock()

    def run_episode(self, engine, sample: Mapping[str, Any]) -> Optional[TrajectoryGroup]:
        with self._lock:
            self.episodes += 1
        if self.hook is not None:
            result = self.hook(sample)
            if result is not None:
                return result
        rng = np.random.default_rng([self.seed, sample["sample_id"], 99])
        if rng.random() < self.fail_rate:
            raise RuntimeError(f"scripted episode failure on sample {sample['sample_id']}")
        r = self.cfg.rollout
        prompt = [2 + (sample["sample_id"] + k) % 20 for k in range(3)]
        responses = engine.generate(GenerationRequest(prompt_ids=prompt, n=r.group_size, temperature=r.temperature,
                                                      max_new_tokens=r.max_new_tokens, sample_id=sample["sample_id"]))
        trajs = []
        for i, resp in enumerate(responses):
            reward = float(rng.integers(0, 2))
            trajs.append(TrajectoryBuilder().add_tokens(prompt).add_generation(resp).build(
                temperature=r.temperature, reward=reward, metadata={"sample_id": sample["sample_id"], "i": i}))
        return TrajectoryGroup(trajectories=trajs, metadata={"sample_id": sample["sample_id"]})


def make_traj(n_prompt: int = 3, n_gen: int = 4, version: int = 0, reward: float = 1.0, temperature: float = 1.0,
              stop_reason: str = "eos", **overrides: Any) -> Trajectory:
    fields = dict(
        input_ids=np.arange(n_prompt + n_gen, dtype=np.int32) + 2,
        loss_mask=np.r_[np.zeros(n_prompt, bool), np.ones(n_gen, bool)],
        behavior_logprobs=np.r_[np.zeros(n_prompt, np.float32), np.full(n_gen, -0.5, np.float32)],
        versions=np.r_[np.full(n_prompt, -1, np.int32), np.full(n_gen, version, np.int32)],
        temperature=temperature, reward=reward, stop_reason=stop_reason, metadata={"sample_id": 0},
    )
    fields.update(overrides)
    return Trajectory(**fields)


def make_group(group_size: int = 2, sample_id: int = 0, rewards=None, **traj_kwargs: Any) -> TrajectoryGroup:
    rewards = rewards if rewards is not None else [float(i) for i in range(group_size)]
    trajs = [make_traj(reward=rewards[i], **traj_kwargs) for i in range(group_size)]
    return TrajectoryGroup(trajectories=trajs, metadata={"sample_id": sample_id})


def char_tokenizer(chars: str = "abcdefghijklmnopqrstuvwxyz0123456789 +-=?.:", system: bool = False):
    """A character-level PreTrainedTokenizerFast over ``chars``: specials <pad>=0, <eos>=1, <u>=2,
    <a>=3 (and <s>=4, the system role, with ``system``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<u>", "<a>", *(["<s>"] if system else [])]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in chars:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    system_role = "{% elif m['role'] == 'system' %}<s>" if system else ""
    hf.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<u>" + system_role + "{% else %}<a>{% endif %}"
        "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    )
    return hf
