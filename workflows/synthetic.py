"""Synthetic digit tasks that a tiny model learns in minutes on a CPU.

Each task writes prompts in the `tiny` model's character alphabet and knows its own
solution, so it serves RL (a partial-credit reward) and SFT (reference responses)
alike:

  copy     ``C:4821``   -> ``4821``
  reverse  ``R:4821``   -> ``1284``
  add      ``A:12+345`` -> ``357``

Samples are a pure function of (seed, split, index), and the eval split never shares
a prompt with the train split, so held-out accuracy means what it says.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Callable

from asyncrl.data import TaskData
from asyncrl.registry import register


def positional_match(prompt: str, completion: str, answer: str = "", **_: object) -> float:
    """Partial credit in [0, 1]: matching characters position by position, over the
    longer of the answer and the completion (so padding an answer with junk costs)."""
    completion = completion.strip()
    longest = max(len(answer), len(completion))
    if longest == 0:
        return 1.0
    return sum(a == c for a, c in zip(answer, completion)) / longest


def exact_match(prompt: str, completion: str, answer: str = "", **_: object) -> float:
    """1.0 when the stripped completion equals the answer, else 0.0."""
    return float(completion.strip() == answer)


register("reward", "positional_match")(positional_match)
register("reward", "exact_match")(exact_match)


@dataclass(frozen=True)
class _Task:
    tag: str
    make: Callable[[random.Random, int, int], tuple[str, str]]  # (rng, min, max) -> (body, answer)


def _digits(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(low, high)))


def _copy(rng, low, high):
    body = _digits(rng, low, high)
    return body, body


def _reverse(rng, low, high):
    body = _digits(rng, low, high)
    return body, body[::-1]


def _add(rng, low, high):
    a, b = int(_digits(rng, low, high)), int(_digits(rng, low, high))
    return f"{a}+{b}", str(a + b)


_TASKS = {"copy": _Task("C", _copy), "reverse": _Task("R", _reverse), "add": _Task("A", _add)}


def solve(prompt: str) -> str:
    """The reference answer of any synthetic prompt (used for SFT data and checks)."""
    tag, _, body = prompt.partition(":")
    if tag == "C":
        return body
    if tag == "R":
        return body[::-1]
    if tag == "A":
        left, _, right = body.partition("+")
        return str(int(left) + int(right))
    raise ValueError(f"not a synthetic task prompt: {prompt!r}")


def synthetic_task(
    task: str = "copy",
    *,
    seed: int = 0,
    train_size: int = 4096,
    eval_size: int = 64,
    min_digits: int = 2,
    max_digits: int = 4,
) -> TaskData:
    """Build the train and eval splits of a synthetic task.

    Train prompts that collide with an eval prompt are skipped, so the eval split is
    truly held out; the splits are a pure function of the arguments.
    """
    if task not in _TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose one of {sorted(_TASKS)}")
    if train_size < 1:
        raise ValueError(f"train_size must be >= 1 (given {train_size})")
    if eval_size < 0:
        raise ValueError(f"eval_size must be >= 0 (given {eval_size})")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits (given {min_digits}, {max_digits})")
    spec = _TASKS[task]

    def make(split: str, index: int) -> dict:
        rng = random.Random(f"{task}/{seed}/{split}/{index}")
        body, answer = spec.make(rng, min_digits, max_digits)
        return {"prompt": f"{spec.tag}:{body}", "answer": answer, "response": answer}

    eval_samples = [make("eval", i) for i in range(eval_size)]
    held_out = {s["prompt"] for s in eval_samples}
    train_samples: list[dict] = []
    index = 0
    while len(train_samples) < train_size:
        sample = make("train", index)
        index += 1
        if sample["prompt"] not in held_out:
            train_samples.append(sample)
        if index > 50 * train_size + 1000:
            raise ValueError(
                f"synthetic task {task!r} with {min_digits}-{max_digits} digits cannot give {train_size} "
                f"train prompts outside the eval split; lower data.train_size or raise max_digits"
            )
    return TaskData(train=train_samples, eval=eval_samples, reward="positional_match", solver=solve)


for _name in _TASKS:
    register("dataset", _name)(functools.partial(synthetic_task, _name))
