"""GSM8K: grade-school math word problems with a numeric final answer.

The data is not bundled: point ``path`` at a JSONL file with ``question`` and
``answer`` fields, the answer being a worked solution that ends in ``#### N``
(the layout of the original release).
"""

from __future__ import annotations

import re

from asyncrl.data import DataError, TaskData, read_jsonl, split_eval
from asyncrl.registry import register

INSTRUCTION = "Solve the problem step by step, then give the final answer after '####'."

_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def final_answer(solution: str) -> str | None:
    """The number after ``####`` (commas removed), or the last number in the text."""
    found = _FINAL.search(solution)
    if found is None:
        numbers = _NUMBER.findall(solution)
        if not numbers:
            return None
        text = numbers[-1]
    else:
        text = found.group(1)
    return text.replace(",", "").rstrip(".")


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a == b


@register("reward", "gsm8k_answer")
def gsm8k_answer(prompt: str, completion: str, answer: str = "", **_: object) -> float:
    """1.0 when the completion's final number equals the reference answer, else 0.0."""
    got = final_answer(completion)
    return float(got is not None and _same_number(got, answer))


@register("dataset", "gsm8k")
def gsm8k(path: str, *, seed: int = 0, eval_path: str | None = None, eval_size: int = 64) -> TaskData:
    """GSM8K from a local JSONL file; ``response`` is the worked solution (for SFT)."""

    def convert(records: list[dict], source: str) -> list[dict]:
        samples = []
        for number, record in enumerate(records, start=1):
            answer = final_answer(record["answer"])
            if answer is None:
                raise DataError(f"{source}: record {number}: field 'answer' has no final number")
            samples.append(
                {
                    "prompt": f"{record['question'].strip()}\n{INSTRUCTION}",
                    "answer": answer,
                    "response": record["answer"].strip(),
                }
            )
        return samples

    train = convert(read_jsonl(path, required=("question", "answer")), str(path))
    if eval_path is not None:
        return TaskData(train=train, eval=convert(read_jsonl(eval_path, required=("question", "answer")), str(eval_path)), reward="gsm8k_answer")
    train, held_out = split_eval(train, eval_size, seed)
    return TaskData(train=train, eval=held_out, reward="gsm8k_answer")
