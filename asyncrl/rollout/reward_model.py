"""The ``reward_model`` reward: a learned reward model scoring completions on the device.

::

    rewards:
      - {fn: reward_model, kwargs: {path: /models/my-rm}, weight: 1.0}
      - {fn: gsm8k_format, weight: 0.1}        # rule rewards combine by weight as usual

``path`` is a Hugging Face sequence-classification directory (``Qwen2``/``Qwen3``/``Llama``
``ForSequenceClassification``, ``num_labels`` 1; :mod:`asyncrl.model.reward_model`). Its
raw score is the reward component; the weighted sum is the reward, like any reward function.

What is scored (its tokenizer and chat template are its own):

* same tokenizer as the policy (same vocabulary, and the reward model's chat template is
  absent or the policy's): the reward model scores exactly the tokens the policy saw,
  prompt ids (chat template included) + completion ids (its stop token included), with no
  re-rendering (the single-turn workflows pass them, :class:`~asyncrl.rollout.scoring_group.ScoringGroup`);
* another tokenizer: the conversation is re-rendered for the reward model: the sample's
  chat messages (system prompt included) + ``{"role": "assistant", "content": completion}``
  through the reward model's chat template (or ``kwargs.chat_template``) with its tokenizer,
  ``add_generation_prompt=False``. A reward model whose tokenizer differs and that has no
  chat template (and no ``kwargs.chat_template``) is a config error at start-up;
* a workflow that does not pass tokens (a custom one calling ``score(prompt, completion,
  sample)``): the prompt text as one user message + the completion, rendered as above
  (with the policy's tokenizer and template when they are the same).

Scoring is batched: every call goes to one :class:`~asyncrl.rollout.reward_scoring.RewardModelScorer`
per reward model (one scoring queue, jitted batches); the single-turn workflow's group is
submitted at once on its first completion's call, so a group shares batches. Placement:
``kwargs.devices`` (``"start:stop"``, placement syntax), default the engine's devices
(``placement.engine``, colocated: the trainer's). It needs no engine, so it works with
``engine.remote`` too.

Kwargs: ``path``; ``devices``; ``batch_size`` (most sequences per device call, 64);
``max_tokens`` (longest scored sequence, 2048; a longer one scores ``rollout.reward_fallback``,
counted as a reward error); ``chat_template`` (a Jinja template string for re-rendering);
``timeout_s`` (most seconds a call waits for its score, 300; ``rollout.reward_timeout_s``
applies as for every reward function). Everything is loaded, checked and compiled once at
start-up (:func:`prepare_reward_functions`, before step 1); the scorer is shared by every
stage and workflow of the process that names the same kwargs.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Mapping, Optional, Sequence

from asyncrl.errors import AsyncRLError, ConfigError
from asyncrl.registry import register
from asyncrl.rollout.reward_scoring import DEFAULT_LENGTH_BUCKETS, RewardModelClosed, RewardModelScorer
from asyncrl.rollout.scoring_group import ScoringGroup, current_scoring
from asyncrl.rollout.workflow import token_ids

DEFAULT_BATCH_SIZE = 64
DEFAULT_MAX_TOKENS = 2048
DEFAULT_TIMEOUT_S = 300.0
OWN_KWARGS = ("path", "devices", "batch_size", "max_tokens", "chat_template", "timeout_s")
"""The reward's own keyword arguments (a dataset field of one of these names is a config error)."""


# --------------------------------------------------------------------------- the prepared reward model


@dataclasses.dataclass
class PreparedRewardModel:
    """A loaded reward model, its scoring queue, and how it turns a sample into tokens."""

    scorer: RewardModelScorer
    render_tokenizer: Any  # the tokenizer that renders text: the policy's (same tokenizer) or the reward model's
    chat_template: Optional[str]  # the template to render with (None: render_tokenizer's own)
    template_kwargs: dict[str, Any]  # data.chat_template_kwargs when rendering with the policy's template
    reuse_policy_tokens: bool  # same tokenizer: score the policy's own ids

    def sequences(self, group: ScoringGroup) -> list[list[int]]:
        """The token ids scored for each completion of ``group``."""
        if self.reuse_policy_tokens:
            return [group.prompt_ids + ids for ids in group.completion_ids]
        return [self.render(group.messages, completion) for completion in group.completions]

    def render(self, messages: Sequence[Mapping[str, Any]], completion: str) -> list[int]:
        """``messages`` + the completion as the assistant's turn, through the chat template."""
        conversation = [*messages, {"role": "assistant", "content": completion}]
        extra = {"chat_template": self.chat_template} if self.chat_template is not None else {}
        return token_ids(self.render_tokenizer.apply_chat_template(
            conversation, add_generation_prompt=False, tokenize=True, **extra, **self.template_kwargs))


_prepared: dict[tuple, PreparedRewardModel] = {}
_closed: set[tuple] = set()
"""Keys whose scorer :func:`close_reward_models` closed: the reward refuses them rather than
loading the model again from a rollout thread still finishing after its run closed (a scorer
thread would then outlive the run). An explicit :func:`prepare_reward_model` reopens the key."""
_prepared_lock = threading.Lock()


def _key(path: str, devices: Optional[str], batch_size: int, max_tokens: int, chat_template: Optional[str]) -> tuple:
    return (str(path), devices, int(batch_size), int(max_tokens), chat_template)


def prepare_reward_model(*, cfg: Any = None, tokenizer: Any = None, where: str = "rewards.N",
                         sample: Optional[Mapping[str, Any]] = None, path: Optional[str] = None,
                         devices: Optional[str] = None, batch_size: int = DEFAULT_BATCH_SIZE,
                         max_tokens: int = DEFAULT_MAX_TOKENS, chat_template: Optional[str] = None,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> PreparedRewardModel:
    """Load, check, place and compile the reward model of one ``rewards.N`` entry (start-up).

    ``cfg``/``tokenizer``: the run config and the policy's tokenizer (None: unknown, so the text
    is always rendered with the reward model's own template). ``sample``: a dataset sample, to
    check no field shadows this reward's kwargs. Errors are one :class:`ConfigError` line naming
    ``where`` (``rewards.N``) and the kwarg.
    """
    if not path:
        raise ConfigError(f"{where}.kwargs.path: reward_model needs the path of a Hugging Face sequence-classification directory")
    shadowed = sorted(set(sample or {}) & set(OWN_KWARGS))
    if shadowed:
        raise ConfigError(f"{where}: the dataset's field(s) {shadowed} would override reward_model's kwargs of that name; rename the field(s)")
    if batch_size < 1 or max_tokens < 1 or timeout_s <= 0:
        raise ConfigError(f"{where}.kwargs: batch_size and max_tokens must be >= 1 and timeout_s > 0 (given {batch_size}, {max_tokens}, {timeout_s})")
    key = _key(path, devices, batch_size, max_tokens, chat_template)
    with _prepared_lock:
        found = _prepared.get(key)
        if found is not None and not found.scorer.closed:
            if tokenizer is None:
                return found
            # Loaded already (another stage, an earlier run in this process): decide again for
            # this policy's tokenizer, with the same checks, and keep the one scoring queue.
            prepared = _rendering(found.scorer, cfg, tokenizer, where, path, chat_template)
        else:
            prepared = _load(cfg, tokenizer, where, path, devices, batch_size, max_tokens, chat_template)
        _prepared[key] = prepared
        _closed.discard(key)
        return prepared


def _rendering(scorer: RewardModelScorer, cfg: Any, tokenizer: Any, where: str, path: str,
               chat_template: Optional[str]) -> PreparedRewardModel:
    """How text becomes the reward model's tokens with this policy tokenizer (module docstring)."""
    reuse, render_tokenizer, template = _render_choice(scorer.model.tokenizer, tokenizer, chat_template, where, path)
    template_kwargs = dict(cfg.data.chat_template_kwargs) if (cfg is not None and render_tokenizer is tokenizer) else {}
    return PreparedRewardModel(scorer, render_tokenizer, template, template_kwargs, reuse)


def _load(cfg: Any, tokenizer: Any, where: str, path: str, devices: Optional[str], batch_size: int,
          max_tokens: int, chat_template: Optional[str]) -> PreparedRewardModel:
    from asyncrl.model.loading import resolve_model_dir
    from asyncrl.model.reward_model import load_reward_model

    try:
        model = load_reward_model(resolve_model_dir(path))
    except AsyncRLError as err:
        raise ConfigError(f"{where}.kwargs.path: {str(err).replace(chr(10), ' ')}") from None
    _render_choice(model.tokenizer, tokenizer, chat_template, where, path)  # its errors before anything is placed
    buckets = sorted({b for b in DEFAULT_LENGTH_BUCKETS if b < max_tokens} | {max_tokens})
    scorer = RewardModelScorer(model, devices=_devices(cfg, devices, where), batch_size=batch_size,
                               length_buckets=buckets, name=f"{where} (reward_model {path})",
                               pack=bool(cfg is not None and cfg.packs),
                               pack_max_segments=cfg.rollout.pack_max_segments if cfg is not None else 16)
    try:
        scorer.warm_up()  # compiles now, and a device that cannot hold it fails before step 1
    except Exception as err:
        scorer.close()
        raise ConfigError(f"{where}: the reward model {path} cannot score on its devices: {err}") from None
    return _rendering(scorer, cfg, tokenizer, where, path, chat_template)


def _render_choice(rm_tokenizer: Any, policy_tokenizer: Any, chat_template: Optional[str], where: str,
                   path: str) -> tuple[bool, Any, Optional[str]]:
    """``(reuse policy tokens, tokenizer to render with, template)`` (see the module docstring)."""
    own_template = chat_template or getattr(rm_tokenizer, "chat_template", None)
    policy_template = getattr(policy_tokenizer, "chat_template", None) if policy_tokenizer is not None else None
    same_vocab = policy_tokenizer is not None and policy_tokenizer.get_vocab() == rm_tokenizer.get_vocab()
    if same_vocab and (own_template is None or own_template == policy_template):
        return True, policy_tokenizer, None
    if own_template is None:
        what = "differs from the policy's" if policy_tokenizer is not None else "is used to render the text"
        raise ConfigError(
            f"{where}.kwargs.path: the reward model's tokenizer ({path}) {what} and it has no chat template; "
            "give one as rewards.N.kwargs.chat_template or use a checkpoint whose tokenizer has one"
        )
    return False, rm_tokenizer, chat_template


def _devices(cfg: Any, devices: Optional[str], where: str) -> list[Any]:
    """The reward model's devices: its own range, else the engine's (``placement``)."""
    import jax

    from asyncrl.cluster.placement import device_range, resolve_placement

    if devices is not None:
        chosen = device_range(devices, f"{where}.kwargs.devices")
    elif cfg is not None:
        # The engine's devices in this process (in a multi-process run they are process 0's,
        # where rollouts run; another process keeps its copy on its first device).
        here = [d for d in resolve_placement(cfg).engine_devices if d.process_index == jax.process_index()]
        chosen = here or list(jax.local_devices()[:1])
    else:
        chosen = list(jax.local_devices())
    foreign = [d for d in chosen if d.process_index != jax.process_index()]
    if foreign:
        raise ConfigError(f"{where}.kwargs.devices: {len(foreign)} of its devices belong to other processes; give this process's devices")
    return chosen


def prepare_reward_functions(functions: Sequence[Any], cfg: Any, tokenizer: Any, sample: Optional[Mapping[str, Any]] = None) -> None:
    """Start-up hook of reward functions (``functions[i]`` is ``rewards.i``, a
    :class:`~asyncrl.rollout.rewards.RewardFunction`): each whose function has a ``prepare``
    attribute (like ``reward_model``) gets ``prepare(cfg=, tokenizer=, where=, sample=, **its kwargs)``
    before step 1, to load and check what it needs; errors name ``rewards.N``."""
    for index, rf in enumerate(functions):
        fn = rf.fn
        target = fn.func if isinstance(fn, functools.partial) else fn
        prepare = getattr(target, "prepare", None)
        if callable(prepare):
            keywords = dict(fn.keywords) if isinstance(fn, functools.partial) else {}
            prepare(cfg=cfg, tokenizer=tokenizer, where=f"rewards.{index}", sample=sample, **keywords)


def close_reward_models() -> None:
    """Close every prepared reward model's scorer (their threads end). The reward then refuses
    those models until :func:`prepare_reward_model` (the next run's start-up) prepares them again."""
    with _prepared_lock:
        prepared = list(_prepared.values())
        _closed.update(_prepared)
        _prepared.clear()
    for p in prepared:
        p.scorer.close()


def reward_model_metrics() -> dict[str, float]:
    """``reward_model/*`` of every prepared scorer, summed (batches run, sequences scored, mean
    rows per batch); empty when the run has no learned reward model. The run logs them per step."""
    with _prepared_lock:
        scorers = {id(p.scorer): p.scorer for p in _prepared.values()}
    if not scorers:
        return {}
    counts = [s.metrics() for s in scorers.values()]
    batches = sum(c["reward_model/batches"] for c in counts)
    scored = sum(c["reward_model/scored"] for c in counts)
    return {"reward_model/batches": batches, "reward_model/scored": scored,
            "reward_model/mean_batch": scored / batches if batches else 0.0}


# --------------------------------------------------------------------------- the reward


@register("reward", "reward_model")
def reward_model(prompt: str, completion: str, *, path: Optional[str] = None, devices: Optional[str] = None,
                 batch_size: int = DEFAULT_BATCH_SIZE, max_tokens: int = DEFAULT_MAX_TOKENS,
                 chat_template: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S, **fields: Any) -> float:
    """The learned reward model's score of ``completion`` (see the module docstring)."""
    key = _key(str(path), devices, batch_size, max_tokens, chat_template)
    with _prepared_lock:
        prepared = _prepared.get(key)
        closed_with_its_run = prepared is None and key in _closed
    if closed_with_its_run:
        raise RewardModelClosed(f"reward_model {path}: closed when its run ended; call reward_model.prepare(path=...) "
                                "to use it again outside a run")
    if prepared is None or prepared.scorer.closed:  # used outside asyncrl train/eval: no policy tokenizer known
        prepared = prepare_reward_model(path=path, devices=devices, batch_size=batch_size, max_tokens=max_tokens,
                                        chat_template=chat_template, timeout_s=timeout_s)
    current = current_scoring()
    if current is None:
        future = prepared.scorer.submit(prepared.render([{"role": "user", "content": prompt}], completion))
    else:
        group, index = current
        futures = group.futures(key, lambda: [prepared.scorer.submit(ids) for ids in prepared.sequences(group)])
        future = futures[index]
    return float(future.result(timeout=timeout_s))


reward_model.prepare = prepare_reward_model  # type: ignore[attr-defined,unused-ignore]
