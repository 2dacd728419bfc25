"""GSM8K answer extraction (strict and lenient), normalisation, rewards and eval metrics,
on completions written the way models write them."""

from __future__ import annotations

import pytest

from asyncrl.registry import resolve
from tests.helpers import SHARED_DATA
from workflows.gsm8k import (
    accuracy_lenient,
    accuracy_strict,
    extract_lenient,
    extract_strict,
    gsm8k_correct,
    gsm8k_format,
    normalize_number,
)

# (completion, reference answer, strict extraction, lenient extraction)
CASES = [
    # the required format, plain
    ("Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips altogether.\n#### 72", "72", "72", "72"),
    ("Weng earns 12/60 = $0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $10.\n#### 10", "10", "10", "10"),
    ("She needs 100 - 50 - 30 - 15 = 5 more.\n#### 5\n", "5", "5", "5"),
    ("Step 1: 3 * 4 = 12\nStep 2: 12 + 6 = 18\n####18", "18", "18", "18"),
    ("The total is 18.\n\n####  18  \n\n", "18", "18", "18"),
    # commas (thousands separators)
    ("Each month she saves 1,250, so in a year 12 x 1,250 = 15,000.\n#### 15,000", "15000", "15000", "15000"),
    ("The house costs 1,080 thousand... no: 1,080.\n#### 1,080", "1080", "1080", "1080"),
    ("3 payments of 36,000 = 108,000; plus 1,200 fee = 109,200.\n#### 109,200", "109200", "109200", "109200"),
    ("The farm has 2,520,000 seeds.\n#### 2,520,000", "2520000", "2520000", "2520000"),
    # dollars and units
    ("He pays 4 * $5 = $20 in total.\n#### $20", "20", "20", "20"),
    ("So the answer is\n#### $1,250.00", "1250", "1250", "1250"),
    ("Total distance = 60 * 3 = 180 miles.\n#### 180 miles", "180", "180", "180"),
    ("She earns 15 per hour for 8 hours.\n#### 120 dollars.", "120", "120", "120"),
    ("The discount is 20%.\n#### 20%", "20", "20", "20"),
    ("It takes 45 minutes.\n#### 45 minutes", "45", "45", "45"),
    # trailing zeros and decimals
    ("Half of 37 is 18.5 dollars.\n#### 18.50", "18.5", "18.5", "18.5"),
    ("7.0 + 3.0 = 10.0\n#### 10.0", "10", "10", "10"),
    ("The average is 2.25 liters.\n#### 2.25", "2.25", "2.25", "2.25"),
    ("He ran 0.5 miles each day.\n#### .5", "0.5", "0.5", "0.5"),
    ("The answer: 42.\n#### 42.", "42", "42", "42"),
    # negatives
    ("The temperature fell from 5 to -3, a change of -8 degrees.\n#### -8", "-8", "-8", "-8"),
    ("Balance: 20 - 35 = -15.\n#### -15", "-15", "-15", "-15"),
    ("Her account is at -$40.\n#### -$40", "-40", "-40", "-40"),
    ("10-4 = 6 apples remain", "6", None, "6"),  # the minus of a subtraction is no sign
    # boxed
    ("The total is 3 + 4 = 7.\nThe answer is $\\boxed{7}$.", "7", "7", "7"),
    ("So she has \\boxed{1,250} stickers.", "1250", "1250", "1250"),
    ("Therefore the final answer is \\boxed{\\$18.00}.", "18", "18", "18"),
    ("Thus \\boxed{\\text{45 minutes}}", "45", "45", "45"),
    ("The answer is \\boxed{3+4}", "7", None, "4"),  # a box that holds no single number
    ("We get \\boxed{12} at first, but correcting the error:\n12 - 2 = 10.", "10", None, "10"),
    # missing answer
    ("I am not sure how to solve this problem.", "5", None, None),
    ("", "5", None, None),
    ("The answer is\n####", "5", None, None),
    ("#### seventy-two", "72", None, None),
    # several numbers: lenient takes the last
    ("John has 5 apples and buys 7 more, so 5 + 7 = 12 apples.", "12", None, "12"),
    ("5 + 7 = 12 apples. Then he gives 3 away.", "9", None, "3"),
    ("Each of the 4 boxes holds 6, so 4*6=24.\nHe sold 24 for $2 each: <<24*2=48>>48.\n#### 48", "48", "48", "48"),
    ("First 12, then 15, then 20.\n#### 20", "20", "20", "20"),
    # the answer in the wrong place: strict needs it at the end
    ("#### 42\nWait, I made a mistake. 6 * 8 = 48.", "48", None, "48"),
    ("The answer is #### 72 clips in total", "72", None, "72"),
    ("#### 72 and then 3 more", "75", None, "3"),
    ("Answer: 72\n#### 72\nI hope this helps!", "72", None, "72"),
    # wrong answers in the right format
    ("48 + 24 = 70\n#### 70", "72", "70", "70"),
    ("#### 7.5", "7", "7.5", "7.5"),
    ("#### -72", "72", "-72", "-72"),
    # model chatter around a correct answer
    ("Let's think step by step.\n1. 3 dozen = 36 eggs\n2. 36 - 12 = 24\nFinal answer:\n#### 24", "24", "24", "24"),
    ("<think>36 - 12 = 24</think>\nThe answer is 24.\n#### 24", "24", "24", "24"),
    ("Total = 3 * 1,000 = 3,000 grams = 3 kg\n#### 3 kg", "3", "3", "3"),
]


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("completion,answer,strict,lenient", CASES)
def test_extraction(completion, answer, strict, lenient):
    assert extract_strict(completion) == strict
    assert extract_lenient(completion) == lenient
    # the rewards and eval metrics agree with the extractions
    assert gsm8k_correct("q", completion, answer=answer, extraction="strict") == float(strict is not None and float(strict) == float(answer))
    assert gsm8k_correct("q", completion, answer=answer) == float(lenient is not None and float(lenient) == float(answer))
    assert accuracy_strict("q", completion, answer=answer) == gsm8k_correct("q", completion, answer=answer, extraction="strict")
    assert accuracy_lenient("q", completion, answer=answer) == gsm8k_correct("q", completion, answer=answer)
    assert gsm8k_format("q", completion) == float(strict is not None)


@pytest.mark.parametrize(
    "text,expected",
    [("$1,250.00", "1250"), ("1250 dollars", "1250"), ("1,250.", "1250"), ("-3.50", "-3.5"), ("50%", "50"),
     ("0.0", "0"), ("-0", "0"), ("100", "100"), ("1e5", None), ("3 + 4", None), ("abc", None), ("", None),
     ("12 apples per day", "12"), ("\\$5", "5")],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_reference_answers_compare_as_decimals():
    assert gsm8k_correct("q", "#### 18.00", answer="18") == 1.0
    assert gsm8k_correct("q", "#### 1,000", answer="1000") == 1.0
    assert gsm8k_correct("q", "#### 1000", answer="1,000") == 1.0
    assert gsm8k_correct("q", "#### 18.01", answer="18") == 0.0
    with pytest.raises(ValueError, match="extraction must be"):
        gsm8k_correct("q", "#### 1", answer="1", extraction="loose")


def test_rewards_resolve_by_alias_with_kwargs():
    strict = resolve("reward", {"target": "gsm8k_correct", "kwargs": {"extraction": "strict"}})
    assert strict("q", "so 12\n#### 12", answer="12") == 1.0
    assert strict("q", "#### 12\nso 12", answer="12") == 0.0
    assert resolve("reward", "gsm8k_format")("q", "\\boxed{3}") == 1.0


def test_gsm8k_task_has_strict_and_lenient_eval_metrics():
    path = SHARED_DATA / "gsm8k" / "train.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not present")
    task = resolve("dataset", "gsm8k")(path=str(path), seed=0, eval_size=8, max_samples=50)
    assert len(task.train) == 42 and len(task.eval) == 8
    assert set(task.eval_metrics) == {"accuracy_strict", "accuracy_lenient"}
    for sample in task.eval:  # the reference solutions are correct under both readings
        fields = {k: v for k, v in sample.items() if k != "prompt"}
        assert task.eval_metrics["accuracy_strict"](sample["prompt"], sample["response"], **fields) == 1.0
        assert task.eval_metrics["accuracy_lenient"](sample["prompt"], sample["response"], **fields) == 1.0
