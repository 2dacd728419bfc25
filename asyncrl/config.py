"""The configuration tree: pydantic models loaded from YAML, with ``--set`` overrides.

Every section forbids unknown keys and every field has a working default and a
docstring (the attribute docstring becomes the field's description, which is what
``docs/config.md`` is generated from). This module imports no jax, flax or
transformers, so validating a config and printing it are instant.

Errors are :class:`~asyncrl.errors.ConfigError` with one line per problem, each
naming the dotted path, what was given and what is allowed.
"""

from __future__ import annotations

import copy
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from asyncrl.errors import ConfigError


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings are docs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ComponentRef(Section):
    """A pluggable component given by import path or alias, with constructor kwargs."""

    target: str
    """A registered alias or an import path ``pkg.module:Symbol``."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments bound to the component when it is built."""


ComponentSpec = Union[str, ComponentRef]
"""A built-in alias, an import path ``pkg.module:Symbol``, or ``{target, kwargs}``."""


class RunConfig(Section):
    """Identity, output location, seeding and length of a run."""

    name: str = "asyncrl"
    """Run name, used in the default output directory and in logs."""
    output_dir: Optional[str] = None
    """Directory for metrics, checkpoints and exports; defaults to ``runs/<name>``."""
    seed: int = 0
    """Root seed; every random stream of the run is derived from it."""
    total_steps: int = Field(default=100, ge=1)
    """Number of trainer steps (each consumes ``rollout.batch_size`` groups and publishes once)."""
    overwrite: bool = False
    """Replace the metrics of an earlier run in ``output_dir`` (otherwise starting where a run completed a step is an error)."""

    @property
    def resolved_output_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a decoder layer that LoRA adapters may wrap (Hugging Face / PEFT names)."""


class LoraConfig(Section):
    """Low-rank adapters: train ``B @ A`` beside frozen base weights (see docs/lora.md)."""

    rank: int = Field(default=8, ge=1)
    """r: the inner dimension of each adapter pair ``A [in, r]``, ``B [r, out]``."""
    alpha: float = Field(default=16.0, gt=0)
    """The adapter's output is scaled by ``alpha / rank`` (PEFT's ``lora_alpha``)."""
    target_modules: list[Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]] = Field(
        default_factory=lambda: list(LORA_TARGET_MODULES), min_length=1
    )
    """Which linear layers of every decoder layer get an adapter."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input in training forward passes only (never in pi_prox, pi_ref, eval or the engine)."""

    @model_validator(mode="after")
    def _unique_targets(self) -> "LoraConfig":
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"target_modules lists a module twice: {self.target_modules}")
        return self

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class ModelConfig(Section):
    """The policy model: where its weights come from and the dtypes it runs in."""

    path: str = "tiny"
    """Local Hugging Face directory, hub id, or built-in spec: ``tiny`` (character vocabulary) or ``tiny-qwen3`` (Qwen3-shaped, BPE tokenizer trained on GSM8K)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the parameters are stored and updated in."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of activations and matmuls; norms and log-probs always run in float32."""
    remat: bool = False
    """Rematerialise each decoder layer in the backward pass (less memory, ~1/3 more compute)."""
    logprob_chunk_size: Optional[int] = Field(default=None, ge=1)
    """Sequence positions per lm-head chunk in ``per_token_logprobs`` (bounds [B, chunk, vocab] memory); null: no chunking."""
    lora: Optional[LoraConfig] = None
    """Train low-rank adapters on frozen base weights instead of every weight (``{rank, alpha, target_modules, dropout}``); null: off."""


class RolloutConfig(Section):
    """How episodes are generated, and how stale their tokens may be when trained."""

    batch_size: int = Field(default=8, ge=1)
    """Groups (prompts) consumed by one trainer step: B."""
    group_size: int = Field(default=4, ge=1)
    """Sequences sampled per prompt; a group is kept or dropped whole."""
    max_staleness: int = Field(default=1, ge=0)
    """η: the most versions a trained token may lag the weights being trained; 0 is synchronous."""
    max_concurrent: int = Field(default=16, ge=1)
    """Most episodes running at once (rollout threads)."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of training rollouts (log-probs are taken at this temperature)."""
    max_new_tokens: int = Field(default=32, ge=1)
    """Most tokens generated per completion."""
    batch_order: Literal["admission", "completion"] = "admission"
    """``admission``: batches take the oldest tickets (lag <= η, no stale drops); ``completion``: the first finished groups."""
    episode_timeout_s: float = Field(default=600.0, gt=0)
    """An episode running longer is counted ``failed:timeout``; its slot is refilled and its worker thread abandoned (one replacement keeps the pool's size)."""
    reward_timeout_s: float = Field(default=30.0, gt=0)
    """A reward function call running longer gives ``reward_fallback`` (counted)."""
    reward_fallback: float = -1.0
    """Reward given in place of a reward function that raises or times out (counted, logged once)."""
    max_consecutive_failures: int = Field(default=20, ge=1)
    """This many failed episodes in a row stop training with the root cause."""
    max_consecutive_reward_failures: int = Field(default=100, ge=1)
    """This many failed or timed-out calls in a row of one reward function stop training with the cause (each still scores ``reward_fallback`` until then)."""
    max_consecutive_drops: Optional[int] = Field(default=None, ge=1)
    """This many finished groups in a row dropped (``too_long``, ``prompt_too_long``, ``aborted``, a workflow's ``SkipSample``; not ``stale`` or ``zero_variance``) with none kept stop training with the reason and the setting to change. Default: ``max(64, 4 * batch_size)``."""
    batch_timeout_s: float = Field(default=600.0, gt=0)
    """The trainer gives up (and the run stops with the rollout counts) when a batch is not ready after this long."""
    length_bucket: int = Field(default=64, ge=1)
    """Batch length ``L`` is the longest sequence rounded up to a multiple of this (fewer recompilations)."""
    max_seq_len: Optional[int] = Field(default=None, ge=2)
    """Cap on ``L``; a longer trajectory drops its group (``dropped:too_long``). Default: ``data.max_prompt_tokens + rollout.max_new_tokens``, room for one turn: a multi-turn workflow sets it to its whole episode's length (every turn, tool output and prompt)."""
    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal (they carry no GRPO signal), within ``max_filtered_per_step``."""
    max_filtered_per_step: Optional[int] = Field(default=None, ge=0)
    """Most zero-variance groups dropped per trainer step; then they are trained on. Default: ``4 * batch_size``."""

    @property
    def queue_capacity(self) -> int:
        """Groups the rollout queue holds: ``(max_staleness + 1) * batch_size``, enough for every admitted group."""
        return (self.max_staleness + 1) * self.batch_size

    @property
    def resolved_max_consecutive_drops(self) -> int:
        return max(64, 4 * self.batch_size) if self.max_consecutive_drops is None else self.max_consecutive_drops

    @property
    def resolved_max_filtered_per_step(self) -> int:
        return 4 * self.batch_size if self.max_filtered_per_step is None else self.max_filtered_per_step


class DataConfig(Section):
    """The prompts: which dataset, and limits applied to every sample."""

    dataset: ComponentSpec = "copy"
    """Dataset/task: a built-in (``copy``, ``reverse``, ``add``, ``gsm8k``, ``jsonl``, ``hf``), an import path, or ``{target, kwargs}`` (e.g. ``{target: jsonl, kwargs: {path: data.jsonl, eval_size: 64}}``)."""
    max_prompt_tokens: int = Field(default=256, ge=1)
    """A prompt longer than this (in tokens, chat template included) is skipped and counted (``dropped:prompt_too_long``)."""


class RewardSpec(Section):
    """One reward function ``fn(prompt: str, completion: str, **sample_fields) -> float`` and its weight."""

    fn: ComponentSpec
    """The function: a registered reward alias, ``pkg.module:function``, or ``{target, kwargs}``."""
    weight: float = 1.0
    """The reward is the weighted sum of the functions' raw scores."""
    name: Optional[str] = None
    """Key of its raw score in ``reward_components``; defaults to the alias or function name."""


class AlgoConfig(Section):
    """The RL objective: advantages, the clipped policy loss, KL, entropy and aggregation (``docs/algorithms.md``)."""

    estimator: ComponentSpec = "grpo"
    """Advantage estimator: ``grpo``, ``dr_grpo``, ``rloo``, ``batch``, or an import path; kwargs such as ``{eps: 1e-4}``."""
    reward_scale: float = 1.0
    """Rewards are multiplied by this before the estimator sees them."""
    reward_bias: float = 0.0
    """Added to rewards (after scaling) before the estimator sees them."""
    truncated: Literal["keep", "mask", "penalty"] = "keep"
    """Completions cut at ``rollout.max_new_tokens``: ``keep`` as is, ``mask`` out of the loss, or DAPO's soft overlong ``penalty``."""
    overlong_buffer: int = Field(default=8, ge=1)
    """DAPO's L_cache: with ``truncated: penalty`` the reward falls linearly to -``overlong_penalty`` over the last this many tokens."""
    overlong_penalty: float = Field(default=1.0, ge=0)
    """Largest overlong penalty (reward units) with ``truncated: penalty``; reached at ``rollout.max_new_tokens``."""
    ratio: Literal["token", "sequence"] = "token"
    """Importance ratio per ``token`` (PPO/GRPO) or per ``sequence`` (GSPO: exp of the mean token log-ratio)."""
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """The ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(default=0.2, ge=0)
    """The ratio is clipped above at 1 + clip_high (DAPO's clip-higher: 0.28)."""
    dual_clip: Optional[float] = Field(default=None, gt=1)
    """Dual clip c: for A < 0 the loss is at most -c*A (3.0 in the dual-clip paper); null is off."""
    decoupled: bool = False
    """AReaL's decoupled PPO: ratio against the proximal policy (weights at the step's start), times w = pi_prox/pi_behave."""
    prox_logp: Literal["recompute", "behave"] = "recompute"
    """With ``decoupled``: ``recompute`` pi_prox at the step's start, or take the behaviour logprobs (valid only when every token has the step's version)."""
    mismatch_correction: bool = False
    """Train/inference mismatch correction (truncated importance sampling): the same w, with pi_prox recomputed; exclusive with ``decoupled``."""
    behave_weight_cap: Optional[float] = Field(default=5.0, gt=1)
    """Cap of w = pi_prox/pi_behave (decoupled or mismatch correction); null is no cap."""
    behave_weight_mode: Literal["truncate", "mask"] = "truncate"
    """``truncate``: w = min(w, cap); ``mask``: tokens with w outside [1/cap, cap] get no loss."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Coefficient of the KL penalty to the frozen reference model; 0 is off (no reference model is loaded)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman's k1, k2, k3) with delta = log pi - log pi_ref."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Entropy bonus: the loss is reduced by this times the token entropy."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How token losses of a mini-batch become one scalar (real rows only)."""
    loss_norm_tokens: Optional[int] = Field(default=None, ge=1)
    """Constant token count of ``seq-mean-token-sum-norm`` (Dr. GRPO); null means ``rollout.max_new_tokens``."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each trainer step's batch."""
    mini_batches: int = Field(default=1, ge=1)
    """Optimizer updates per epoch: the batch is split into this many mini-batches."""


class EvalConfig(Section):
    """Evaluation on the task's held-out split (greedy reward/accuracy, optional pass@k)."""

    every_steps: int = Field(default=10, ge=0)
    """Evaluate before training, every this many steps, and after the last; 0 turns eval off."""
    max_prompts: Optional[int] = Field(default=None, ge=1)
    """Evaluate on at most this many eval prompts (default: the whole eval split)."""
    n_samples: int = Field(default=0, ge=0)
    """Sampled completions per prompt for pass@1 and pass@n (0: greedy only)."""
    temperature: Optional[float] = Field(default=None, gt=0)
    """Temperature of the pass@k samples (default: ``rollout.temperature``)."""
    max_new_tokens: Optional[int] = Field(default=None, ge=1)
    """Most tokens per eval engine call (default: what the workflow asks for, ``rollout.max_new_tokens`` for ``single_turn``)."""
    success_threshold: float = 1.0
    """A completion counts as correct (accuracy, pass@k) when its reward is at least this."""
    timeout_s: float = Field(default=300.0, gt=0)
    """Eval requests still unfinished after this long come back aborted."""


class RemoteEngineConfig(Section):
    """Rollouts on inference servers speaking SGLang's native HTTP API (SGLang, SGLang-Jax, ``asyncrl serve``); see docs/remote.md."""

    urls: list[str] = Field(min_length=1)
    """Base URLs of the servers, e.g. ``[http://10.0.0.5:30000, http://10.0.0.6:30000]``; every one must read ``weights_dir``."""
    api_key_env: Optional[str] = "ASYNCRL_API_KEY"
    """Environment variable holding the servers' API key (sent as ``Authorization: Bearer``); unset or empty: no key."""
    weights_dir: Optional[str] = None
    """Where published weights are written (``v{N}`` HF directories); null: ``<run.output_dir>/weights``. Must be readable by the servers at the same path."""
    keep_weights: int = Field(default=2, ge=1)
    """Weight versions kept on disk (older ones are removed after each publish)."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    """HTTP connect timeout; an unreachable URL at start fails within it."""
    read_timeout_s: float = Field(default=600.0, gt=0)
    """HTTP read timeout: the longest one generation (or weight load) may take to answer."""
    retries: int = Field(default=3, ge=0)
    """Retries of a call on connection errors and HTTP 5xx (never on 4xx) before the server counts as down."""
    backoff_s: float = Field(default=0.5, ge=0)
    """Wait before retry ``k`` (from 1): ``backoff_s * 2**(k-1)``."""
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """``/pause_generation`` mode before each update. ``abort`` keeps per-token versions exact (cut requests are resubmitted with their tokens so far); with ``retract``/``in_place`` (SGLang only) a request runs across the update and is tagged with the version it started on."""
    update_retries: int = Field(default=2, ge=0)
    """Retries of a server's whole pause/update/continue before it is taken out of rotation."""
    health_check_every_s: float = Field(default=5.0, ge=0)
    """Period of ``/health`` checks; a server that answers again rejoins once it loaded the current version. 0: no checks."""
    max_concurrent_requests: int = Field(default=64, ge=1)
    """Requests in flight at once over all servers (client threads and pooled connections)."""
    max_segments: int = Field(default=64, ge=1)
    """Times one sample may be cut and resubmitted before it is given up as ``aborted``."""

    @model_validator(mode="after")
    def _check_urls(self) -> "RemoteEngineConfig":
        bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"engine.remote.urls: {bad} must start with http:// or https://")
        return self


class EngineConfig(Section):
    """The JAX inference engine: batch slots, KV cache, and the shapes it compiles for."""

    slots: int = Field(default=16, ge=1)
    """Sequences decoded together (batch rows of the KV cache); a request's ``n`` samples need ``n`` free slots."""
    kv_capacity: int = Field(default=512, ge=2)
    """Tokens one slot holds: prompt + ``max_new_tokens`` of every request must fit."""
    decode_chunk: int = Field(default=8, ge=1)
    """Tokens decoded per compiled call; finished slots are refilled and published weights installed between chunks."""
    prefill_buckets: list[int] = Field(default_factory=lambda: [16, 32, 64, 128, 256, 512])
    """Prompt lengths prefill is compiled for (one program each); a prompt uses the smallest that holds it."""
    max_stop_ids: int = Field(default=8, ge=1)
    """Most stop token ids one request may give (the width of the compiled stop-id table)."""
    request_timeout_s: Optional[float] = Field(default=None, gt=0)
    """Default timeout of a request without its own ``timeout_s``; unfinished samples come back ``aborted``. Null: none."""
    remote: Optional[RemoteEngineConfig] = None
    """Generate on inference servers instead of in-process (the fields above then apply to ``asyncrl serve`` only); null: the in-process JAX engine."""

    @model_validator(mode="after")
    def _check_buckets(self) -> "EngineConfig":
        if not self.prefill_buckets or min(self.prefill_buckets) < 1:
            raise ValueError(f"engine.prefill_buckets: need at least one bucket, all >= 1 (given {self.prefill_buckets})")
        if max(self.prefill_buckets) > self.kv_capacity:
            raise ValueError(
                f"engine.prefill_buckets: {max(self.prefill_buckets)} exceeds engine.kv_capacity ({self.kv_capacity})"
            )
        return self


class OptimConfig(Section):
    """The optimizer of the trainer: an optax chain of global-norm clipping and AdamW (or SGD), with a schedule.

    The schedule counts optimizer updates (``algo.ppo_epochs * algo.mini_batches`` per trainer
    step), not trainer steps; a skipped (non-finite) update advances neither Adam's count nor it.
    The defaults suit the ``tiny`` model on CPU; pretrained LMs usually want ``lr`` 1e-6 to 1e-5.
    """

    optimizer: Literal["adamw", "sgd"] = "adamw"
    """``adamw`` (decoupled weight decay on the parameters not matched by ``no_decay``), or plain ``sgd``."""
    lr: float = Field(default=1e-3, gt=0)
    """Peak learning rate (reached after ``warmup_steps`` updates)."""
    b1: float = Field(default=0.9, ge=0, lt=1)
    """AdamW's first-moment decay."""
    b2: float = Field(default=0.999, ge=0, lt=1)
    """AdamW's second-moment decay."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW's epsilon (added to the root of the second moment)."""
    weight_decay: float = Field(default=0.01, ge=0)
    """AdamW's decoupled weight decay, applied to every parameter except those matched by ``no_decay``."""
    no_decay: list[str] = Field(default_factory=lambda: ["embed", "norm", "bias"])
    """Regexes searched in each parameter's dotted path (``layers.0.self_attn.q_proj.bias``); a match gets no weight decay. Default: embeddings (and a tied lm head), norms, biases."""
    max_grad_norm: Optional[float] = Field(default=1.0, gt=0)
    """Clip the global gradient norm of each update (after accumulating all micro-batches) to this; null: no clipping."""
    warmup_steps: int = Field(default=0, ge=0)
    """Optimizer updates of linear warm-up: update k (from 0) uses ``lr * min(1, (k + 1) / warmup_steps)``."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: ``constant`` at ``lr``, or ``cosine`` decay to ``lr * min_lr_ratio`` over ``decay_steps`` updates."""
    decay_steps: Optional[int] = Field(default=None, ge=1)
    """Updates of the cosine decay; null: ``run.total_steps * algo.ppo_epochs * algo.mini_batches - warmup_steps``."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate of the cosine schedule, as a fraction of ``lr``."""
    micro_batches: int = Field(default=1, ge=1)
    """Gradient-accumulation chunks per optimizer update: each mini-batch is split into this many micro-batches (memory, not math: the update is the same)."""
    max_consecutive_nonfinite: int = Field(default=5, ge=1)
    """This many optimizer updates in a row with a non-finite loss or gradient (each skipped) stop training with an error."""


class SFTConfig(Section):
    """Supervised fine-tuning (a stage of ``type: sft``): prompt + reference response, cross-entropy on the response."""

    batch_size: int = Field(default=32, ge=1)
    """Examples (rows) per SFT step, padded up to the trainer's row multiple; one optimizer update each."""


class DistributedConfig(Section):
    """Multi-process (multi-host) SPMD training on JAX's own distributed runtime."""

    enabled: bool = False
    """Call ``jax.distributed.initialize`` before anything else touches JAX; every process runs the same program."""
    coordinator_address: Optional[str] = None
    """``host:port`` of process 0's coordinator; null: JAX's detection (``JAX_COORDINATOR_ADDRESS``, SLURM, Open MPI, Kubernetes, ...)."""
    num_processes: Optional[int] = Field(default=None, ge=1)
    """Number of processes; null: JAX's cluster detection."""
    process_id: Optional[int] = Field(default=None, ge=0)
    """This process's index in ``[0, num_processes)``; null: JAX's cluster detection."""


class MeshConfig(Section):
    """The trainer's device mesh (axes ``data``, ``fsdp``, ``tensor``) over ``jax.devices()``.

    Parameters and optimizer state are placed by the model's partition rules
    (``asyncrl/model/sharding.py``); batch rows are split over ``data`` x ``fsdp``.
    """

    data: Optional[int] = Field(default=None, ge=1)
    """Data-parallel replicas; null: all devices left over by ``fsdp`` x ``tensor``."""
    fsdp: int = Field(default=1, ge=1)
    """Devices each parameter's hidden dimension is split over (ZeRO-3 style); also splits batch rows."""
    tensor: int = Field(default=1, ge=1)
    """Devices attention heads, MLP width and vocabulary are split over (Megatron style)."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Multi-process setup (off by default: one process)."""


class CheckpointConfig(Section):
    """Checkpoints under ``<run.output_dir>/checkpoints/step_<k>/`` and resuming from them (``docs/checkpoints.md``)."""

    every_steps: int = Field(default=50, ge=0)
    """Write a checkpoint every this many trainer steps, after the last step, and on SIGINT/SIGTERM; 0: only after the last step and on a signal."""
    keep: Optional[int] = Field(default=3, ge=1)
    """Keep the newest this many complete checkpoints (older ones are deleted once the new one is in place); null keeps all."""
    resume: Literal["never", "auto"] = "never"
    """``auto`` (or ``asyncrl train --resume``): continue from the newest complete checkpoint in ``run.output_dir``, or start fresh if there is none; ``never``: always start fresh."""


class LoggingConfig(Section):
    """What the run reports and how."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Python logging level of asyncrl's own loggers."""
    dump_every_steps: int = Field(default=10, ge=0)
    """Append a few of the step's trajectories (prompt, completion, reward components, versions) to ``trajectories.jsonl`` every this many steps; 0 is off."""
    dump_groups: int = Field(default=2, ge=1)
    """Groups written per trajectory dump."""


class StageConfig(Section):
    """One stage of a multi-stage run: SFT or RL, with overrides of the top-level sections."""

    name: str = "rl"
    """Stage name: tags its metrics (``stage`` in metrics.jsonl, ``tensorboard/<name>/``) and checkpoints."""
    type: Literal["sft", "rl"] = "rl"
    """``sft``: cross-entropy on reference responses; ``rl``: GRPO/PPO with rollouts."""
    total_steps: int = Field(default=100, ge=1)
    """Trainer steps of this stage."""
    data: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the top-level ``data`` section for this stage (only the keys given)."""
    workflow: Optional[ComponentSpec] = None
    """Overrides the top-level ``workflow`` for this stage."""
    rewards: Optional[list[RewardSpec]] = None
    """Overrides the top-level ``rewards`` for this stage."""
    algo: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the top-level ``algo`` section for this stage."""
    optim: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the top-level ``optim`` section for this stage (each stage starts a fresh optimizer)."""
    eval: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the top-level ``eval`` section for this stage."""
    sft: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the top-level ``sft`` section for this stage (``type: sft``)."""


STAGE_SECTIONS = ("data", "workflow", "rewards", "algo", "optim", "eval", "sft")
"""Top-level sections a stage may override."""


class Config(Section):
    """The whole configuration of a run."""

    run: RunConfig = Field(default_factory=RunConfig)
    """Identity, output location, seeding and length of the run."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout generation and staleness control."""
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    """The RL objective."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Prompt limits."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The JAX inference engine."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """The trainer's optimizer and schedule."""
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    """The trainer's device mesh and multi-process setup."""
    workflow: ComponentSpec = "single_turn"
    """The rollout workflow (``RolloutWorkflow`` subclass): alias, ``pkg.module:Class``, or ``{target, kwargs}``."""
    rewards: list[RewardSpec] = Field(default_factory=list)
    """Reward functions of the workflow, weighted and summed."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation on the held-out split."""
    sft: SFTConfig = Field(default_factory=SFTConfig)
    """Supervised fine-tuning batches (stages of ``type: sft``)."""
    stages: list[StageConfig] = Field(default_factory=list)
    """Stages run in order on one model (e.g. ``[{name: sft, type: sft, total_steps: 50}, {name: rl, total_steps: 100}]``); empty: one RL stage of ``run.total_steps``."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Logging."""

    @model_validator(mode="after")
    def _check_algo(self) -> "Config":
        problems = []
        algo = self.algo
        if algo.decoupled and algo.mismatch_correction:
            problems.append(
                "algo.mismatch_correction: cannot be combined with algo.decoupled (both apply the same weight "
                "w = pi_prox/pi_behave, so it would be applied twice); set one of them to false"
            )
        target = algo.estimator if isinstance(algo.estimator, str) else algo.estimator.target
        if target in GROUP_NORMALISED_ESTIMATORS and self.rollout.group_size < 2:
            problems.append(
                f"rollout.group_size: {self.rollout.group_size} is too small for algo.estimator '{target}', which "
                "compares each sequence with the rest of its group; use group_size >= 2 or algo.estimator: batch"
            )
        if algo.truncated == "penalty" and algo.overlong_buffer > self.rollout.max_new_tokens:
            problems.append(
                f"algo.overlong_buffer: {algo.overlong_buffer} exceeds rollout.max_new_tokens "
                f"({self.rollout.max_new_tokens}); the buffer is the last part of the allowed length"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _check_lengths(self) -> "Config":
        needed = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        if self.rollout.max_seq_len is not None and self.rollout.max_seq_len < needed:
            raise ValueError(
                f"rollout.max_seq_len ({self.rollout.max_seq_len}) must be at least data.max_prompt_tokens + "
                f"rollout.max_new_tokens ({needed}), or every long completion would be dropped"
            )
        return self

    @model_validator(mode="after")
    def _check_engine(self) -> "Config":
        engine, problems = self.engine, []
        needed = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        if engine.kv_capacity < needed:
            problems.append(
                f"engine.kv_capacity ({engine.kv_capacity}) must be at least data.max_prompt_tokens + "
                f"rollout.max_new_tokens ({needed}), or long prompts could not be served"
            )
        elif max(engine.prefill_buckets) < self.data.max_prompt_tokens - 1:
            problems.append(
                f"engine.prefill_buckets: the largest ({max(engine.prefill_buckets)}) must hold data.max_prompt_tokens - 1 "
                f"({self.data.max_prompt_tokens - 1}) tokens (the last prompt token is decoded)"
            )
        if self.rollout.group_size > engine.slots:
            problems.append(
                f"engine.slots ({engine.slots}) must be at least rollout.group_size ({self.rollout.group_size}): "
                "a group's samples share one prefill and decode together"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _check_stages(self) -> "Config":
        if not self.stages:
            return self
        problems = []
        if "total_steps" in self.run.model_fields_set:
            problems.append("run.total_steps: with stages, set each stage's total_steps instead")
        names = [stage.name for stage in self.stages]
        if len(set(names)) != len(names):
            problems.append(f"stages: stage names must differ (given {names})")
        for index in range(len(self.stages)):
            try:
                self.stage_config(index)
            except ValidationError as err:
                problems.extend(
                    f"stages.{index}.{line}".replace("did you mean '", f"did you mean 'stages.{index}.")
                    for line in format_validation_error(err, Config)
                )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def stage_configs(self) -> list[tuple["StageConfig", "Config"]]:
        """Each stage with its flat config (the top level, overridden by the stage, no stages)."""
        if not self.stages:
            return [(StageConfig(name="rl", type="rl", total_steps=self.run.total_steps), self)]
        return [(stage, self.stage_config(index)) for index, stage in enumerate(self.stages)]

    def stage_config(self, index: int) -> "Config":
        stage = self.stages[index]
        raw = self.model_dump(mode="json", exclude={"stages"})
        for section in STAGE_SECTIONS:
            override = getattr(stage, section)
            if override is None or override == {}:
                continue
            if isinstance(override, dict) and isinstance(raw.get(section), dict):
                raw[section] = _deep_merge(raw[section], override)
            else:
                raw[section] = override.model_dump(mode="json") if isinstance(override, BaseModel) else (
                    [r.model_dump(mode="json") for r in override] if isinstance(override, list) else override
                )
        raw["run"]["total_steps"] = stage.total_steps
        return Config.model_validate(raw)

    @property
    def total_steps(self) -> int:
        """Trainer steps of the whole run: ``run.total_steps``, or the stages' sum."""
        return sum(stage.total_steps for stage in self.stages) if self.stages else self.run.total_steps

    @property
    def max_seq_len(self) -> int:
        """The cap on a batch's length ``L``: ``rollout.max_seq_len`` or prompt + completion limits."""
        if self.rollout.max_seq_len is not None:
            return self.rollout.max_seq_len
        return self.data.max_prompt_tokens + self.rollout.max_new_tokens


GROUP_NORMALISED_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
"""Built-in advantage estimators that need at least two sequences per group."""


def _deep_merge(base: dict, override: dict) -> dict:
    """``override`` on top of ``base``, dict by dict. A component (``{target, kwargs}``) whose
    ``target`` changes is replaced whole: the new component takes only the kwargs given with it
    (another dataset must not inherit the base dataset's ``train_size``)."""
    if "target" in override and "target" in base and override["target"] != base["target"]:
        return dict(override)
    merged = dict(base)
    for key, value in override.items():
        merged[key] = _deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


# --------------------------------------------------------------------------- loading


def load_config(
    path: str | Path | None = None,
    overrides: typing.Sequence[str] = (),
    *,
    data: dict | None = None,
) -> Config:
    """Build a :class:`Config` from a YAML file (or a dict) and ``a.b=VALUE`` overrides.

    Raises :class:`ConfigError` naming every problem by dotted path.
    """
    if path is not None and data is not None:
        raise ValueError("give a config path or a dict, not both")
    raw = read_yaml(path) if path is not None else copy.deepcopy(data or {})
    problems: list[str] = []
    for item in overrides:
        try:
            apply_override(raw, Config, item)
        except ConfigError as err:
            problems.extend(err.problems)
    # Report the bad overrides together with whatever else is wrong, in one go.
    try:
        cfg = validate_config(raw, source=str(path) if path is not None else None)
    except ConfigError as err:
        problems.extend(err.problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping with ``yaml.safe_load``; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        loaded = yaml.safe_load(read_utf8(path, ConfigError))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}")
    return loaded


def read_utf8(path: Path, error: type[Exception]) -> str:
    """A text file's contents; a file that is not UTF-8 (or is binary) raises ``error`` naming
    the file, the line and the byte offset."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}); "
                    "save the file as UTF-8") from None


def validate_config(raw: dict, source: str | None = None) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, Config, source)) from None


def format_validation_error(err: ValidationError, root: type[BaseModel], source: str | None = None) -> list[str]:
    """One line per problem: ``path: what is wrong (given ...; allowed ...)``."""
    lines = []
    prefix = f"{source}: " if source else ""
    for item in err.errors():
        loc = _clean_loc(item["loc"])
        dotted = ".".join(str(p) for p in loc) or "<root>"
        if item["type"] == "extra_forbidden":
            siblings = _field_names_at(root, loc[:-1])
            hint = _closest(str(loc[-1]), siblings)
            allowed = f"did you mean '{_join(loc[:-1], hint)}'?" if hint else f"allowed keys: {', '.join(siblings)}"
            lines.append(f"{prefix}{dotted}: unknown key; {allowed}")
            continue
        given = item.get("input")
        msg = item["msg"]
        if item["type"] == "value_error" and not loc:
            # Cross-field validators on the root name their own dotted paths, one per line.
            lines.extend(f"{prefix}{line}" for line in msg.removeprefix("Value error, ").splitlines())
            continue
        if item["type"] == "missing":
            lines.append(f"{prefix}{dotted}: required field is missing")
        else:
            lines.append(f"{prefix}{dotted}: {msg} (given {_short(given)})")
    return lines


def _clean_loc(loc: tuple) -> tuple:
    # Union members appear in pydantic's loc as type tags ("str", "ComponentRef",
    # "function-after[...]"); they are not part of the user's path.
    out = []
    for part in loc:
        if isinstance(part, str) and (part in {"str", "int", "float", "bool", "none"} or "[" in part or part[:1].isupper()):
            continue
        out.append(part)
    return tuple(out)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _join(prefix: tuple, name: str) -> str:
    return ".".join([*(str(p) for p in prefix), name])


def _closest(name: str, options: list[str]) -> str | None:
    found = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return found[0] if found else None


# --------------------------------------------------------------------------- schema walking


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """Strip ``Optional``/``Annotated``; return (inner annotation, allows None)."""
    allows_none = False
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
            continue
        if origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) < len(typing.get_args(annotation)):
                allows_none = True
            if len(args) == 1:
                annotation = args[0]
                continue
            annotation = Union[tuple(args)] if len(args) > 1 else annotation
        return annotation, allows_none


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _child_annotation(annotation: Any, key: str | int) -> Any:
    """Annotation of ``annotation[key]``; raises KeyError when there is no such child."""
    annotation, _ = _unwrap_optional(annotation)
    if _is_model(annotation):
        if key not in annotation.model_fields:
            raise KeyError(key)
        return annotation.model_fields[key].annotation
    origin = typing.get_origin(annotation)
    if origin in (list, tuple) and isinstance(key, int):
        return typing.get_args(annotation)[0]
    if origin is dict:
        return typing.get_args(annotation)[1]
    if annotation is Any:
        return Any
    # Unions of a model with other things (component specs): look inside the model member.
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(annotation):
            try:
                return _child_annotation(arg, key)
            except KeyError:
                continue
    raise KeyError(key)


def _field_names_at(root: type[BaseModel], loc: tuple) -> list[str]:
    annotation: Any = root
    try:
        for part in loc:
            annotation = _child_annotation(annotation, part)
    except KeyError:
        return []
    annotation, _ = _unwrap_optional(annotation)
    if _is_model(annotation):
        return list(annotation.model_fields)
    for arg in typing.get_args(annotation):
        if _is_model(arg):
            return list(arg.model_fields)
    return []


def _takes_raw_text(annotation: Any) -> bool:
    """True for fields whose values are plain strings (``str`` or a union led by str
    with nothing but models beside it): ``--set`` gives those the raw text."""
    annotation, _ = _unwrap_optional(annotation)
    if annotation is str:
        return True
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = typing.get_args(annotation)
        return str in args and all(a is str or _is_model(a) for a in args)
    return False


def apply_override(raw: dict, root: type[BaseModel], item: str) -> None:
    """Apply one ``a.b.c=VALUE`` override to the raw (unvalidated) config mapping.

    VALUE is parsed as YAML, except that a field of type ``str`` takes the raw text
    (YAML 1.1 would turn ``no`` into false and ``0123`` into 83); ``null`` still means
    None where the field allows it, and a value that is a YAML mapping still builds
    a component spec. Integer parts index lists. A path that is not in the schema is
    an error.
    """
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected PATH=VALUE, e.g. rollout.batch_size=16")
    dotted, text = item.split("=", 1)
    dotted = dotted.strip()
    parts: list[str | int] = [int(p) if p.lstrip("-").isdigit() else p for p in dotted.split(".")]
    if not dotted or any(p == "" for p in parts):
        raise ConfigError(f"--set {item!r}: empty path")

    annotation: Any = root
    container: Any = raw
    for depth, part in enumerate(parts):
        where = ".".join(str(p) for p in parts[: depth + 1])
        try:
            annotation = _child_annotation(annotation, part)
        except KeyError:
            siblings = _field_names_at(root, tuple(parts[:depth]))
            hint = _closest(str(part), siblings) if isinstance(part, str) else None
            if hint:
                suggestion = f"did you mean '{_join(tuple(parts[:depth]), hint)}'?"
            elif siblings:
                suggestion = f"allowed keys: {', '.join(siblings)}"
            else:
                suggestion = "it is not a section or a list"
            raise ConfigError(f"--set {dotted}: '{where}' does not exist; {suggestion}") from None
        last = depth == len(parts) - 1
        if isinstance(part, int):
            if not isinstance(container, list) or not -len(container) <= part < len(container):
                size = len(container) if isinstance(container, list) else 0
                raise ConfigError(f"--set {dotted}: index {part} is out of range ('{where}' has {size} items)")
        elif not isinstance(container, dict):
            raise ConfigError(f"--set {dotted}: '{where}' is inside a value that is not a mapping")
        if last:
            container[part] = _parse_value(text, annotation)
            return
        child = container[part] if (isinstance(part, int) or part in container) else None
        if child is None:
            child = {}
            container[part] = child
        container = child


def _parse_value(text: str, annotation: Any) -> Any:
    _, allows_none = _unwrap_optional(annotation)
    stripped = text.strip()
    if _takes_raw_text(annotation):
        if allows_none and stripped in ("null", "~", "None"):
            return None
        if stripped.startswith("{"):
            return _yaml_value(text)
        return text
    return _yaml_value(text)


def _yaml_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


# --------------------------------------------------------------------------- output


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML; :func:`load_config` reads it back to an equal config."""
    data = cfg.model_dump(mode="json")
    if cfg.stages:
        del data["run"]["total_steps"]  # each stage has its own; setting both is an error
    return yaml.safe_dump(data, sort_keys=False)


def config_reference_markdown() -> str:
    """The config reference (``docs/config.md``), generated from the models."""
    lines = [
        "# Config reference",
        "",
        "Generated from `asyncrl/config.py` by `python scripts/gen_config_docs.py`; do not edit by hand.",
        "Every section rejects unknown keys. Override any field on the command line with",
        "`--set section.field=VALUE` (YAML, except that `str` fields take the raw text).",
        "",
    ]
    seen: set[type] = set()

    def section(model: type[BaseModel], dotted: str) -> None:
        lines.append(f"## `{dotted}`" if dotted else "## Top level")
        lines.append("")
        if model.__doc__:
            lines.append(model.__doc__.strip().splitlines()[0])
            lines.append("")
        lines.append("| field | type | default | description |")
        lines.append("|---|---|---|---|")
        nested = []
        for name, field in model.model_fields.items():
            inner, _ = _unwrap_optional(field.annotation)
            if _is_model(inner) and inner is not ComponentRef:
                nested.append((inner, f"{dotted}.{name}".lstrip(".")))
                default = "see below"
            else:
                default = _default_text(field)
            description = (field.description or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{name}` | {_type_text(field.annotation)} | {default} | {description} |")
            inner_list = typing.get_args(inner) if typing.get_origin(inner) is list else ()
            if inner_list and _is_model(inner_list[0]) and inner_list[0] not in seen:
                nested.append((inner_list[0], f"{dotted}.{name}[]".lstrip(".")))
        lines.append("")
        for model_, path in nested:
            seen.add(model_)
            section(model_, path)

    section(Config, "")
    return "\n".join(lines).rstrip() + "\n"


def _default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
    else:
        value = field.default
    return "`" + yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip() + "`"


def _type_text(annotation: Any) -> str:
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = text.replace("typing.", "").replace("asyncrl.config.", "").replace("NoneType", "None")
    return text.replace("|", "\\|")
