"""Datasets, the seeded resumable sample order, synthetic tasks and their rewards."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.data import DataError, SampleOrder, read_jsonl, sample_at
from asyncrl.errors import ConfigError
from asyncrl.registry import resolve
from tests.helpers import SHARED_DATA, subprocess_env
from workflows.gsm8k import final_answer, gsm8k_answer
from workflows.synthetic import positional_match, solve, synthetic_task


def test_sample_order_is_a_pure_function_of_seed_and_id():
    samples = [{"prompt": str(i)} for i in range(7)]
    order = SampleOrder(samples, seed=3)
    drawn = [order.sample(i)["prompt"] for i in range(21)]
    # each epoch is a permutation of the whole split, and epochs differ
    for epoch in range(3):
        assert sorted(drawn[7 * epoch : 7 * epoch + 7]) == sorted(s["prompt"] for s in samples)
    assert drawn[:7] != drawn[7:14]
    # no state: any id, in any order, from a fresh object, gives the same draw
    fresh = SampleOrder(samples, seed=3)
    assert [fresh.sample(i)["prompt"] for i in reversed(range(21))] == drawn[::-1]
    assert [SampleOrder(samples, seed=4).sample(i)["prompt"] for i in range(7)] != drawn[:7]
    assert sample_at(order, 9) is order.sample(9)
    assert sample_at(samples, 9) is samples[2]  # a plain sequence cycles in order
    with pytest.raises(ValueError, match="non-negative"):
        order.sample(-1)


def test_empty_split_is_an_error():
    with pytest.raises(DataError, match="train split is empty"):
        SampleOrder([], seed=0)


@pytest.mark.parametrize("task", ["copy", "reverse", "add"])
def test_synthetic_tasks_solve_and_hold_out(task):
    data = resolve("dataset", task)(seed=0, train_size=300, eval_size=32, min_digits=1, max_digits=3)
    assert len(data.train) == 300 and len(data.eval) == 32
    assert not {s["prompt"] for s in data.train} & {s["prompt"] for s in data.eval}
    for sample in data.train[:50] + data.eval:
        assert solve(sample["prompt"]) == sample["answer"] == sample["response"]
    again = synthetic_task(task, seed=0, train_size=300, eval_size=32, min_digits=1, max_digits=3)
    assert again.train == data.train and again.eval == data.eval


def test_synthetic_task_bad_arguments():
    with pytest.raises(ValueError, match="unknown synthetic task"):
        synthetic_task("sort")
    with pytest.raises(ValueError, match="min_digits <= max_digits"):
        synthetic_task("copy", min_digits=3, max_digits=2)
    # one-digit prompts: the eval split takes all ten, leaving nothing to train on
    with pytest.raises(ValueError, match="cannot give 5 train prompts outside the eval split"):
        synthetic_task("copy", train_size=5, eval_size=200, min_digits=1, max_digits=1)


def test_positional_match_partial_credit():
    assert positional_match("C:1234", "1234", answer="1234") == 1.0
    assert positional_match("C:1234", "1299", answer="1234") == 0.5
    assert positional_match("C:1234", "12345678", answer="1234") == 0.5
    assert positional_match("C:1234", "", answer="1234") == 0.0
    assert positional_match("C:1234", " 1234 \n", answer="1234") == 1.0


def test_jsonl_dataset_mapping_split_and_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"question {i}", "a": str(i)}) for i in range(10)) + "\n")
    spec = {"target": "jsonl", "kwargs": {"path": str(path), "prompt_field": "q", "answer_field": "a", "eval_size": 3}}
    data = resolve("dataset", spec, where="data.dataset")(seed=1)
    assert len(data.train) == 7 and len(data.eval) == 3
    assert {s["prompt"] for s in data.train} | {s["prompt"] for s in data.eval} == {f"question {i}" for i in range(10)}
    assert all(s["answer"] == s["prompt"].split()[-1] for s in data.train)

    with pytest.raises(DataError, match=r"d.jsonl: record 1 has no field 'question'"):
        resolve("dataset", "jsonl")(path=str(path), prompt_field="question")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"q": 1}\n{oops\n')
    with pytest.raises(DataError, match=r"broken.jsonl:2: not valid JSON"):
        read_jsonl(broken)
    with pytest.raises(DataError, match="no such data file"):
        read_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match=r"data.dataset.kwargs: .*prompt_feld"):
        resolve("dataset", {"target": "jsonl", "kwargs": {"path": "x", "prompt_feld": "q"}}, where="data.dataset")


def test_datasets_by_name_read_the_local_copy_under_asyncrl_data_dir(tmp_path, monkeypatch):
    """GSM8K by name from ``$ASYNCRL_DATA_DIR/gsm8k/`` (the suite's copy), and any hub dataset of
    the ``hf`` built-in from ``<dir>/<name>/<split>.jsonl``: no network, no ``datasets`` call."""
    if not (SHARED_DATA / "gsm8k" / "test.jsonl").exists():
        pytest.skip(f"{SHARED_DATA / 'gsm8k'} not present")
    monkeypatch.setenv("ASYNCRL_DATA_DIR", str(SHARED_DATA))
    data = resolve("dataset", "gsm8k")(eval_split="test", max_samples=100)
    assert (len(data.train), len(data.eval)) == (100, 1319) and data.eval[0]["answer"].isdigit()
    held_out = resolve("dataset", "gsm8k")(eval_size=8, max_samples=50, seed=1)
    assert (len(held_out.train), len(held_out.eval)) == (42, 8)
    copy = tmp_path / "org" / "qa"
    copy.mkdir(parents=True)
    (copy / "train.jsonl").write_text("".join(json.dumps({"q": f"{i}?", "a": str(i)}) + "\n" for i in range(5)))
    monkeypatch.setenv("ASYNCRL_DATA_DIR", str(tmp_path))
    hub = resolve("dataset", "hf")(name="org/qa", prompt_field="q", answer_field="a", eval_size=1)
    assert len(hub.train) == 4 and {s["prompt"] for s in [*hub.train, *hub.eval]} == {f"{i}?" for i in range(5)}
    for kwargs, match in [({"eval_split": "test", "eval_path": "t.jsonl"}, "not both"),
                          ({"path": "train.jsonl", "eval_split": "test"}, "with path .* give eval_path")]:
        with pytest.raises(DataError, match=match):
            resolve("dataset", "gsm8k")(**kwargs)


def test_a_dataset_by_name_offline_without_a_copy_is_one_line_with_the_fetch_command(tmp_path):
    """Offline (the hub unreachable), nothing in ``datasets``' cache and no ``$ASYNCRL_DATA_DIR``:
    one line naming the dataset, the command that fetches it and the variable."""
    env = {k: v for k, v in subprocess_env().items() if k != "ASYNCRL_DATA_DIR"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    code = "from workflows.gsm8k import gsm8k\ntry:\n    gsm8k(eval_split='test')\nexcept Exception as err:\n    print(err)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("dataset gsm8k: cannot load openai/gsm8k (split train) from the Hugging Face hub: offline")
    assert """python -c "import datasets; datasets.load_dataset('openai/gsm8k', 'main')\"""" in lines[0]
    assert "set ASYNCRL_DATA_DIR to a folder holding gsm8k/train.jsonl" in lines[0]


def test_gsm8k_from_shared_data():
    path = SHARED_DATA / "gsm8k" / "test.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not present")
    data = resolve("dataset", "gsm8k")(path=str(path), seed=0, eval_size=100)
    assert len(data.train) + len(data.eval) == 1319
    sample = data.train[0]
    assert sample["response"].endswith(f"#### {sample['answer']}".replace(",", "")) or "####" in sample["response"]
    assert gsm8k_answer(sample["prompt"], sample["response"], answer=sample["answer"]) == 1.0
    assert final_answer("so the total is 1,250.") == "1250"
    assert gsm8k_answer("p", "no number here", answer="3") == 0.0
