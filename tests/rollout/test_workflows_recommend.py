"""The next-item task of docs/decoding.md (workflows/recommend.py): its catalog, its held-out
split, and the constraint file written from it."""

from __future__ import annotations

import pytest

from asyncrl.engine.constraints import TokenTrie
from workflows.recommend import item_catalog, next_item_task, successors, trie_lines


def test_next_item_splits_are_held_out_and_consistent():
    task = next_item_task(items=20, history=3, train_size=50, eval_size=4, seed=1)
    catalog = item_catalog(20, seed=1)
    nxt = successors(catalog, seed=1)
    assert len(set(catalog)) == 20 and all(len(c) == 3 and c.isdigit() for c in catalog)
    assert len(task.train) == 50 and len(task.eval) == 4
    for sample in task.train + task.eval:
        history = sample["prompt"].removeprefix("M:").split(" ")
        assert len(history) == 3 and set(history) <= set(catalog)
        assert sample["answer"] == sample["response"] == nxt[history[-1]]
    assert not {s["prompt"] for s in task.eval} & {s["prompt"] for s in task.train}
    assert task.reward == "exact_match"
    assert next_item_task(items=20, train_size=50, eval_size=4, seed=1) == task  # a pure function
    with pytest.raises(ValueError, match="eval_size must be in"):
        next_item_task(items=4, history=1, eval_size=2)


def test_trie_lines_encode_every_item_with_the_end_token():
    from asyncrl.model import load_model

    lm = load_model("tiny", with_tokenizer=True)
    end = lm.stop_token_ids[0]
    trie = TokenTrie([[int(t) for t in line.split()] for line in trie_lines(lm.tokenizer, end, items=16, seed=2)])
    assert trie.num_sequences == 16 and trie.max_depth == 4
    for code in item_catalog(16, seed=2):
        assert trie.contains(list(lm.tokenizer.encode(code, add_special_tokens=False)) + [end])
