"""Supervised fine-tuning data: a task's samples as right-padded ``TrainBatch`` es.

A stage of ``type: sft`` trains :class:`~asyncrl.trainer.Trainer` with ``objective="sft"``
on batches from :class:`SFTData`; the model, tokenizer, mesh, optimizer chain, metrics and
checkpoints are the RL stage's own. One SFT example is::

    input_ids = chat_template(prompt, add_generation_prompt=True) + tokens(response) + [eos]
    loss_mask = False ...                                          True ...           True

The prompt is formatted by the workflow's own ``messages(sample)`` (the same chat messages,
``prompt_field`` and system prompt as :class:`~asyncrl.rollout.workflow.SingleTurnWorkflow`
uses in RL and eval), so SFT teaches exactly the format RL samples in. The response is the
sample's ``response`` field (synthetic tasks: the reference answer; ``gsm8k``: the worked
solution; ``jsonl``: ``response_field``), or the task's ``solver(prompt)`` when the sample
has none. The EOS appended is the one generation stops on, so it is a trained token, as
in RL (docs/design.md "Log-probabilities").

Batches follow the run's batch rules: ``L`` is the longest example rounded up to
``rollout.length_bucket`` and capped by ``Config.max_seq_len``; rows are ``sft.batch_size``
examples padded up to the trainer's ``row_multiple`` with padding rows (``group_index``
-1, masks false). An example longer than the cap is skipped and counted
(``sft/skipped_too_long``), never an error. Non-SFT fields are filled so the batch obeys the
trajectory schema: ``versions`` 0 on trained tokens and -1 elsewhere, ``behavior_logprobs``
0, ``rewards`` 0, ``temperature`` 1.

Order: training draws sample id 0, 1, 2, ... from a :class:`~asyncrl.data.SampleOrder`
(a seeded permutation per epoch), so SFT is a pure function of ``run.seed`` and the position,
which :meth:`SFTData.state_dict` holds: a resumed run continues with the very next example.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from asyncrl.config import Config
from asyncrl.data import DataError, SampleOrder, sample_at
from asyncrl.rollout.batch import PreparedBatch, batch_shape
from asyncrl.rollout.trajectory import TrainBatch, check_batch

log = logging.getLogger(__name__)


def response_text(sample: Mapping[str, Any], prompt: str, solver: Optional[Callable[[str], str]] = None) -> str:
    """The reference response of ``sample``: its ``response`` field, else ``solver(prompt)``."""
    if "response" in sample and sample["response"] is not None:
        return str(sample["response"])
    if solver is not None:
        return str(solver(prompt))
    raise DataError(
        f"SFT: sample has no 'response' field and the task has no solver (fields: {', '.join(sorted(sample))}); "
        "for a jsonl dataset set data.dataset.kwargs.response_field to the field holding the reference response"
    )


def encode_example(
    sample: Mapping[str, Any],
    workflow: Any,
    eos_token_id: int,
    solver: Optional[Callable[[str], str]] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids int32 [T], loss_mask bool [T])`` of one SFT example (see the module docstring).

    ``workflow`` supplies ``messages(sample)`` and ``tokenizer`` (a SingleTurnWorkflow).
    """
    tokenizer = workflow.tokenizer
    messages, prompt = workflow.messages(sample)
    prompt_ids = workflow.prompt_ids(messages)
    if not prompt_ids:
        raise DataError(f"SFT: the chat template gave no prompt tokens for prompt {prompt[:60]!r}")
    response_ids = [int(t) for t in tokenizer.encode(response_text(sample, prompt, solver), add_special_tokens=False)]
    ids = np.asarray([*prompt_ids, *response_ids, int(eos_token_id)], np.int32)
    mask = np.zeros(len(ids), bool)
    mask[len(prompt_ids):] = True  # response + EOS
    return ids, mask


def build_sft_batch(
    examples: Sequence[tuple[np.ndarray, np.ndarray]], cfg: Config, *, row_multiple: int = 1
) -> TrainBatch:
    """Stack ``(input_ids, loss_mask)`` examples (each within ``cfg.max_seq_len``) into a
    right-padded TrainBatch: ``[rows, L]``, rows a multiple of ``row_multiple``."""
    if not examples:
        raise ValueError("build_sft_batch: no examples")
    real = len(examples)
    rows, length = batch_shape(real, max(len(ids) for ids, _ in examples), cfg, row_multiple, "build_sft_batch")
    input_ids = np.zeros((rows, length), np.int32)
    attention_mask = np.zeros((rows, length), bool)
    loss_mask = np.zeros((rows, length), bool)
    for row, (ids, mask) in enumerate(examples):
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = True
        loss_mask[row, : len(ids)] = mask
    group_index = np.where(np.arange(rows) < real, np.arange(rows), -1).astype(np.int32)
    batch = TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        behavior_logprobs=np.zeros((rows, length), np.float32),
        versions=np.where(loss_mask, 0, -1).astype(np.int32),
        rewards=np.zeros(rows, np.float32),
        group_index=group_index,
        truncated=np.zeros(rows, bool),
        temperature=1.0,
    )
    check_batch(batch, [f"SFT example {i}" for i in range(real)])
    return batch


class SFTData:
    """SFT batches drawn in a seeded, resumable order: the SFT stage's
    :class:`~asyncrl.rollout.batch.BatchSource`.

    Args:
        samples: the split. A :class:`~asyncrl.data.SampleOrder` is drawn in its seeded
            order (training); a plain sequence is cycled in order.
        workflow: formats prompts (``messages(sample)``, ``tokenizer``): the run's workflow.
        cfg: the run config (``sft.batch_size``, ``rollout.length_bucket``, ``Config.max_seq_len``).
        eos_token_id: the token appended to every response (default: the tokenizer's
            ``eos_token_id``; the loop passes the model's first stop id).
        row_multiple: the trainer's ``row_multiple``.
        solver: the task's solver, for samples without a ``response`` field.
        batch_size: examples per batch (default ``cfg.sft.batch_size``).

    Usage::

        data = SFTData.for_task(task, workflow, cfg, eos_token_id=..., row_multiple=trainer.row_multiple)
        got = data.next_batch()             # PreparedBatch; advances the position
        metrics = trainer.step(got.batch)   # Trainer(..., objective="sft")
        got.metrics                         # {"sft/skipped_too_long": ..., "sft/samples_drawn": ..., "sft/epoch": ...}
    """

    def __init__(
        self,
        samples: Sequence[Mapping[str, Any]],
        workflow: Any,
        cfg: Config,
        *,
        eos_token_id: Optional[int] = None,
        row_multiple: int = 1,
        solver: Optional[Callable[[str], str]] = None,
        batch_size: Optional[int] = None,
    ):
        if len(samples) == 0:
            raise DataError("SFT: the split is empty: nothing to train or evaluate on")
        if eos_token_id is None:
            eos_token_id = getattr(workflow.tokenizer, "eos_token_id", None)
            if eos_token_id is None:
                raise DataError("SFT: the tokenizer has no eos_token_id; pass eos_token_id (the model's stop token)")
        self.samples = samples
        self.workflow = workflow
        self.cfg = cfg
        self.eos_token_id = int(eos_token_id)
        self.row_multiple = row_multiple
        self.solver = solver
        self.batch_size = batch_size or cfg.sft.batch_size
        self.position = 0
        """Samples drawn so far: the next example is sample id ``position``."""
        self.skipped_too_long = 0
        """Drawn samples longer than ``Config.max_seq_len`` (not trained)."""

    @classmethod
    def for_task(cls, task: Any, workflow: Any, cfg: Config, *, split: str = "train", **kwargs: Any) -> "SFTData":
        """The ``train`` split in the seeded :class:`SampleOrder` of ``run.seed``, or the ``eval`` split in order."""
        if split == "train":
            samples: Sequence = SampleOrder(task.train, cfg.run.seed)
        elif split == "eval":
            samples = list(task.eval)
        else:
            raise ValueError(f"SFTData.for_task: split must be 'train' or 'eval' (given {split!r})")
        kwargs.setdefault("solver", getattr(task, "solver", None))
        return cls(samples, workflow, cfg, **kwargs)

    def encode(self, sample: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        return encode_example(sample, self.workflow, self.eos_token_id, self.solver)

    def _fits(self, ids: np.ndarray, where: str) -> bool:
        cap = self.cfg.max_seq_len
        if len(ids) <= cap:
            return True
        if self.skipped_too_long == 0:
            log.warning("SFT: %s has %d tokens (prompt + response + EOS) > Config.max_seq_len %d; skipped "
                        "(counted in sft/skipped_too_long; raise rollout.max_seq_len to keep such examples)",
                        where, len(ids), cap)
        self.skipped_too_long += 1
        return False

    def next_batch(self, version: Optional[int] = None, timeout: Optional[float] = None, *,
                   abandon_if: Optional[Callable[[], bool]] = None) -> PreparedBatch:
        """The next ``batch_size`` examples that fit, in draw order, with their sample ids and
        :meth:`metrics`; advances :attr:`position`. Never waits: ``version``, ``timeout`` and
        ``abandon_if`` (the :class:`~asyncrl.rollout.batch.BatchSource` interface) change nothing."""
        examples: list[tuple[np.ndarray, np.ndarray]] = []
        sample_ids: list[int] = []
        skipped_in_a_row = 0
        while len(examples) < self.batch_size:
            sample_id = self.position
            ids, mask = self.encode(sample_at(self.samples, sample_id))
            self.position += 1
            if self._fits(ids, f"sample {sample_id}"):
                examples.append((ids, mask))
                sample_ids.append(sample_id)
                skipped_in_a_row = 0
            else:
                skipped_in_a_row += 1
                if skipped_in_a_row >= len(self.samples):
                    raise DataError(
                        f"SFT: every one of the {len(self.samples)} samples is longer than Config.max_seq_len "
                        f"({self.cfg.max_seq_len} tokens); raise rollout.max_seq_len"
                    )
        batch = build_sft_batch(examples, self.cfg, row_multiple=self.row_multiple)
        return PreparedBatch(batch, sample_ids=tuple(sample_ids), metrics=self.metrics())

    def batches_once(self, limit: Optional[int] = None) -> Iterator[TrainBatch]:
        """Every sample once, in split order, as batches (eval); does not move :attr:`position`.
        Examples longer than the cap are skipped and counted in :attr:`skipped_too_long`."""
        count = len(self.samples) if limit is None else min(limit, len(self.samples))
        examples = []
        for index in range(count):
            ids, mask = self.encode(self.samples[index])
            if self._fits(ids, f"eval sample {index}"):
                examples.append((ids, mask))
            if len(examples) == self.batch_size:
                yield build_sft_batch(examples, self.cfg, row_multiple=self.row_multiple)
                examples = []
        if examples:
            yield build_sft_batch(examples, self.cfg, row_multiple=self.row_multiple)

    def metrics(self) -> dict[str, float]:
        return {
            "sft/skipped_too_long": float(self.skipped_too_long),
            "sft/samples_drawn": float(self.position),
            "sft/epoch": self.position / len(self.samples),
        }

    def state_dict(self) -> dict:
        return {"position": self.position, "skipped_too_long": self.skipped_too_long}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.position = int(state["position"])
        self.skipped_too_long = int(state["skipped_too_long"])

    def checkpoint_state(self) -> dict:
        """:meth:`state_dict`: the position changes only when a batch is taken."""
        return self.state_dict()

    def set_version(self, version: int) -> None:
        """Nothing to do: SFT batches do not depend on the served weights."""

    def close(self) -> None:
        """Nothing to do: no background work."""


def eval_loss(trainer: Any, data: SFTData, limit: Optional[int] = None) -> dict[str, float]:
    """Token-mean cross-entropy of ``data``'s split (every sample once, at most ``limit``,
    default ``eval.max_prompts``) under ``trainer``'s current weights: ``eval/loss``,
    ``eval/loss_tokens`` and ``eval/skipped_too_long``."""
    limit = limit if limit is not None else data.cfg.eval.max_prompts
    skipped_before = data.skipped_too_long
    total, tokens = 0.0, 0
    for batch in data.batches_once(limit):
        batch_total, batch_tokens = trainer.nll(batch)
        total += batch_total
        tokens += batch_tokens
    if tokens == 0:
        raise DataError("SFT eval: no eval example fits Config.max_seq_len; nothing to evaluate")
    return {
        "eval/loss": total / tokens,
        "eval/loss_tokens": float(tokens),
        "eval/skipped_too_long": float(data.skipped_too_long - skipped_before),
    }
