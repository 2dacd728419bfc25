"""GSM8K: grade-school math word problems with a numeric final answer.

The data comes by name from the Hugging Face hub (``openai/gsm8k``, config ``main``: 7,473 train
and 1,319 test problems, MIT licence) through ``datasets``, cached where ``datasets`` caches;
``$ASYNCRL_DATA_DIR/gsm8k/{train,test}.jsonl`` is used instead when present, and ``path`` names a
local JSONL file outright. Records have ``question`` and ``answer`` fields, the answer a worked
solution that ends in ``#### N`` (the original release's layout, which the hub keeps).

Answers are read from a completion in two ways:

* **strict** (:func:`extract_strict`): the answer in the required format at the end:
  the last non-empty line is ``#### N`` (``N`` a number, optionally with ``$``, commas, a
  unit and a final period), or holds ``\\boxed{N}``. Anything after it, or a box that
  holds no single number, is no strict answer.
* **lenient** (:func:`extract_lenient`): the last number anywhere in the completion.

Both normalise the number (:func:`normalize_number`): thousands commas, ``$``, a
trailing unit word or ``%``, and trailing zeros after the point (``18.00`` -> ``18``)
are removed, so ``$1,250.00 dollars`` reads ``1250``. Answers compare as exact decimals.

Rewards (``fn(prompt, completion, answer=..., **fields) -> float``):

* ``gsm8k_correct``: 1.0 when the extracted answer equals the reference
  (``extraction: lenient`` by default, or ``strict``);
* ``gsm8k_format``: 1.0 when the completion ends in the strict format, whatever the
  number; give it a small weight (``configs/gsm8k_grpo.yaml`` uses 0.1);
* ``gsm8k_answer``: the older single reward: the number after ``####`` anywhere, else the
  last number (the task's default when the config names no reward).

The task's eval metrics are ``accuracy_strict`` and ``accuracy_lenient`` (reported as
``eval/accuracy_strict`` and ``eval/accuracy_lenient``).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from asyncrl.data import DataError, TaskData, hub_rows, read_jsonl, split_eval
from asyncrl.registry import register

INSTRUCTION = "Solve the problem step by step, then give the final answer after '####'."

_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")

# A number as written in a completion: an optional minus (not one between two operands,
# as in "10-4"), an optional "$", then digits with thousands commas ("1,250") or plain
# digits, and an optional decimal part; or a bare decimal (".5").
_NUMBER_TEXT = r"(?:(?<![\w)\]])-\s?)?\$?\s?-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])-?\.\d+"
_ANY_NUMBER = re.compile(_NUMBER_TEXT)
# A whole answer string: a number, then at most a short unit ("dollars", "cm", "%", "per hour").
_ANSWER = re.compile(rf"^\s*(?P<number>{_NUMBER_TEXT})\s*(?P<unit>%|[A-Za-z][A-Za-z ./]{{0,24}})?\s*\.?\s*$")
_STRICT_HASH = re.compile(r"^\s*####\s*(?P<body>.+?)\s*$")
_BOXED = re.compile(r"\\boxed\s*\{")
_LATEX_NOISE = re.compile(r"\\text\s*\{([^{}]*)\}|\\mathrm\s*\{([^{}]*)\}|\\[,!;: ]|\\\$|\\%")

MAX_COMPLETION_CHARS = 100_000
"""Longer completions are read from their last this many characters (the answer is at the end)."""


def normalize_number(text: str) -> str | None:
    """Canonical form of one answer string, or None when it is not a single number.

    ``"$1,250.00"``, ``"1250 dollars"``, ``"1,250."`` -> ``"1250"``; ``"-3.50"`` -> ``"-3.5"``;
    ``"50%"`` -> ``"50"``; ``"0.0"`` -> ``"0"``; ``"3 + 4"``, ``"abc"`` -> None.
    """
    text = _LATEX_NOISE.sub(lambda m: m.group(1) or m.group(2) or "", text)
    found = _ANSWER.match(text)
    if found is None:
        return None
    return _canonical(found.group("number"))


def _canonical(number: str) -> str | None:
    raw = number.replace(",", "").replace("$", "").replace(" ", "")
    negative = raw.count("-") % 2 == 1
    raw = raw.replace("-", "")
    try:
        value = Decimal(raw)
    except InvalidOperation:
        return None
    if negative:
        value = -value
    if value == 0:
        return "0"  # also "-0", "0.00"
    text = format(value.normalize(), "f")
    return text


def same_answer(got: str | None, reference: str) -> bool:
    """True when ``got`` (a canonical number) equals the reference answer as a decimal."""
    if got is None:
        return False
    want = normalize_number(str(reference))
    if want is None:
        return got.strip() == str(reference).strip()
    return Decimal(got) == Decimal(want)


def _last_line(completion: str) -> str:
    lines = [line for line in completion[-MAX_COMPLETION_CHARS:].splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _last_boxed(line: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` in ``line`` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(line)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for pos in range(start, len(line)):
        if line[pos] == "{":
            depth += 1
        elif line[pos] == "}":
            depth -= 1
            if depth == 0:
                return line[start:pos]
    return None  # unbalanced: no answer


def extract_strict(completion: str) -> str | None:
    """The answer given in the required format at the end of ``completion``, normalised.

    The last non-empty line must be ``#### N`` or hold a ``\\boxed{N}``; else None.
    """
    line = _last_line(completion)
    found = _STRICT_HASH.match(line)
    if found is not None:
        return normalize_number(found.group("body"))
    boxed = _last_boxed(line)
    if boxed is not None:
        return normalize_number(boxed)
    return None


def extract_lenient(completion: str) -> str | None:
    """The last number anywhere in ``completion``, normalised (None when there is none)."""
    numbers = _ANY_NUMBER.findall(completion[-MAX_COMPLETION_CHARS:])
    return _canonical(numbers[-1]) if numbers else None


def final_answer(solution: str) -> str | None:
    """The reference answer of a worked solution: the number after ``####`` (commas removed),
    or the last number in the text."""
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


@register("reward", "gsm8k_correct")
def gsm8k_correct(prompt: str, completion: str, answer: str = "", *, extraction: str = "lenient", **_: object) -> float:
    """1.0 when the answer extracted from the completion (``lenient``: the last number;
    ``strict``: ``#### N`` / ``\\boxed{N}`` at the end) equals ``answer``, else 0.0."""
    if extraction not in ("lenient", "strict"):
        raise ValueError(f"gsm8k_correct: extraction must be 'lenient' or 'strict' (given {extraction!r})")
    got = extract_strict(completion) if extraction == "strict" else extract_lenient(completion)
    return float(same_answer(got, answer))


@register("reward", "gsm8k_format")
def gsm8k_format(prompt: str, completion: str, **_: object) -> float:
    """1.0 when the completion ends in the required format (``#### N`` or ``\\boxed{N}``), else 0.0."""
    return float(extract_strict(completion) is not None)


def accuracy_strict(prompt: str, completion: str, answer: str = "", **_: object) -> float:
    """Eval metric: the strict answer is correct."""
    return float(same_answer(extract_strict(completion), answer))


def accuracy_lenient(prompt: str, completion: str, answer: str = "", **_: object) -> float:
    """Eval metric: the last number is correct."""
    return float(same_answer(extract_lenient(completion), answer))


EVAL_METRICS = {"accuracy_strict": accuracy_strict, "accuracy_lenient": accuracy_lenient}
"""``TaskData.eval_metrics`` of the task: reported as ``eval/<name>``."""


HUB_NAME, HUB_CONFIG = "openai/gsm8k", "main"


@register("dataset", "gsm8k")
def gsm8k(
    path: str | None = None,
    *,
    seed: int = 0,
    eval_path: str | None = None,
    eval_split: str | None = None,
    eval_size: int = 64,
    max_samples: int | None = None,
) -> TaskData:
    """GSM8K; ``response`` is the worked solution (for SFT).

    The train split is ``path`` (a local JSONL file) or, without it, ``openai/gsm8k``'s ``train``
    split (a local copy in ``$ASYNCRL_DATA_DIR/gsm8k/``, else through ``datasets``). The eval split is
    ``eval_path`` (a file), ``eval_split`` (``test``: the hub's or the local copy's split), or
    ``eval_size`` problems held out of the train split by ``seed``. ``max_samples`` keeps the first
    this many train records (smoke runs)."""

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

    def records(split: str) -> list[dict]:
        rows = hub_rows(HUB_NAME, HUB_CONFIG, split, local_name="gsm8k", task="gsm8k")
        missing = [name for name in ("question", "answer") if rows and name not in rows[0]]
        if missing:
            raise DataError(f"gsm8k: {HUB_NAME} split {split}: records have no field '{missing[0]}' (fields: {', '.join(rows[0])})")
        return rows

    if max_samples is not None and max_samples < 1:
        raise DataError(f"gsm8k: max_samples must be >= 1 (given {max_samples})")
    if eval_path is not None and eval_split is not None:
        raise DataError("gsm8k: give eval_path (a file) or eval_split (a split of the dataset), not both")
    if path is not None and eval_split is not None:
        raise DataError(f"gsm8k: eval_split {eval_split!r} is a split of {HUB_NAME}; with path (a local file) give "
                        "eval_path, or eval_size to hold problems out of it")
    if path is not None:
        train = convert(read_jsonl(path, required=("question", "answer"))[:max_samples], str(path))
    else:
        train = convert(records("train")[:max_samples], f"{HUB_NAME}:train")
    if eval_path is not None:
        held_out = convert(read_jsonl(eval_path, required=("question", "answer")), str(eval_path))
    elif eval_split is not None:
        held_out = convert(records(eval_split), f"{HUB_NAME}:{eval_split}")
    else:
        train, held_out = split_eval(train, eval_size, seed)
    return TaskData(train=train, eval=held_out, reward="gsm8k_answer", eval_metrics=dict(EVAL_METRICS))
