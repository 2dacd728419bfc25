"""A small generative-recommendation task (docs/decoding.md): predict a user's next item.

Items are 3-digit codes (``"482"``), so in the `tiny` model's character vocabulary an item ID
is 3 tokens; with the end token, 4. A catalog of ``items`` codes is a pure function of the
seed, and so is what users view next: every item has one successor (a random cycle through
the catalog), the item viewed after it. A sample shows a user's last ``history`` items (the
earlier ones random, the last one's successor unknown to the model) and asks for the next:

  ``M:482 193 775`` -> ``306``

A model decoding freely may invent codes that are not in the catalog; decoding under the
catalog's trie (``rollout.decoding.constraint``, written by ``scripts/make_item_trie.py``)
it can only name real items, and RL on the held-out next item (reward ``exact_match``) stays
exact because the trainer scores under the same trie.

The eval split is ``eval_size`` histories that never appear in training (train samples that
collide with one are skipped): the model must have learnt each item's successor, not the prompts.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.data import TaskData
from asyncrl.registry import register


def item_catalog(items: int = 16, seed: int = 0) -> list[str]:
    """``items`` distinct 3-digit item codes, in catalog order (a pure function of the seed)."""
    if not 2 <= items <= 1000:
        raise ValueError(f"items must be in [2, 1000] (3-digit codes; given {items})")
    return random.Random(f"catalog/{seed}").sample([f"{i:03d}" for i in range(1000)], items)


def successors(catalog: list[str], seed: int = 0) -> dict[str, str]:
    """Each item's next item: one random cycle through the catalog."""
    order = random.Random(f"cycle/{seed}").sample(catalog, len(catalog))
    return {item: order[(i + 1) % len(order)] for i, item in enumerate(order)}


@register("dataset", "next_item")
def next_item_task(*, items: int = 16, history: int = 3, seed: int = 0, train_size: int = 512,
                   eval_size: int = 32) -> TaskData:
    """Train and eval splits of the next-item task (module docstring), a pure function of the
    arguments; each sample has ``prompt``, ``answer`` and ``response`` (the answer, for SFT)."""
    if history < 1:
        raise ValueError(f"history must be >= 1 (given {history})")
    if not 0 <= eval_size <= items ** history // 4:
        raise ValueError(f"eval_size must be in [0, items ** history / 4] (given {eval_size} with {items} items)")
    if train_size < 1:
        raise ValueError(f"train_size must be >= 1 (given {train_size})")
    catalog = item_catalog(items, seed)
    nxt = successors(catalog, seed)

    def sample(split: str, index: int) -> dict:
        seen = random.Random(f"next_item/{seed}/{split}/{index}").choices(catalog, k=history)
        return {"prompt": "M:" + " ".join(seen), "answer": nxt[seen[-1]], "response": nxt[seen[-1]]}

    evaluation = [sample("eval", i) for i in range(eval_size)]
    held_out = {s["prompt"] for s in evaluation}
    train: list[dict] = []
    index = 0
    while len(train) < train_size:
        candidate = sample("train", index)
        index += 1
        if candidate["prompt"] not in held_out:
            train.append(candidate)
    return TaskData(train=train, eval=evaluation, reward="exact_match")


def trie_lines(tokenizer: Any, end_token_id: int, items: int = 16, seed: int = 0) -> list[str]:
    """The catalog as a constraint file's lines: each item's token ids, then ``end_token_id``."""
    lines = []
    for code in item_catalog(items, seed):
        ids = list(tokenizer.encode(code, add_special_tokens=False))
        lines.append(" ".join(str(t) for t in [*ids, end_token_id]))
    return lines
