"""The sections of the configuration tree: one pydantic model per top-level key of a run config.

Every section forbids unknown keys and every field has a working default and a docstring
(the attribute docstring becomes the field's description, which is what ``docs/config.md``
is generated from). The root :class:`~asyncrl.config.Config`, its cross-field checks, stages,
loading and dumping are :mod:`asyncrl.config`'s (import sections from there). No jax here.
It stays one file: one model per section, in the order of a config file, which is the order
``docs/config.md`` lists them in.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


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
    keep_host_memory: bool = False
    """Keep freed host memory mapped for reuse (glibc ``mallopt``, set when the run starts). On the CPU backend each train step's scratch buffer otherwise comes back as fresh zero-filled pages (about 450,000 page faults per ``bench-40m`` step at 32 x 80 tokens); with this on, that step's system time fell by a third and its wall time by 17%, but the process's peak resident memory rose by half (2.96 to 4.42 GB), as freed blocks stay in the heap. Off by default; worth it when host memory is plentiful (``asyncrl.run.host_memory``, docs/performance.md)."""
    compile_cache: bool = True
    """Keep XLA's compiled programs in JAX's persistent cache so a later run starts in seconds: ``$JAX_COMPILATION_CACHE_DIR``, else ``<asyncrl cache>/jax`` (``$ASYNCRL_CACHE_DIR``, ``$XDG_CACHE_HOME/asyncrl`` or ``~/.cache/asyncrl``). ``ASYNCRL_COMPILE_CACHE=0`` in the environment turns it off too (docs/performance.md)."""

    @property
    def resolved_output_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""A linear layer of a decoder layer that LoRA adapters may wrap (Hugging Face / PEFT names)."""
LORA_TARGET_MODULES: tuple[LoraTarget, ...] = typing.get_args(LoraTarget)
"""Every :data:`LoraTarget`, in layer order (the default of ``model.lora.target_modules``)."""


class LoraConfig(Section):
    """Low-rank adapters: train ``B @ A`` beside frozen base weights (see docs/lora.md)."""

    rank: int = Field(default=8, ge=1)
    """r: the inner dimension of each adapter pair ``A [in, r]``, ``B [r, out]``."""
    alpha: float = Field(default=16.0, gt=0)
    """The adapter's output is scaled by ``alpha / rank`` (PEFT's ``lora_alpha``)."""
    target_modules: list[LoraTarget] = Field(default_factory=lambda: list(LORA_TARGET_MODULES), min_length=1)
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
    """Local Hugging Face directory, hub id, or built-in spec: ``tiny`` (character vocabulary; ``tiny:family=gemma3`` in Gemma 3's layout) or ``tiny-qwen3`` (Qwen3-shaped, BPE tokenizer trained on GSM8K)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the parameters are stored and updated in."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of activations and matmuls; norms, softmax and log-probs always run in float32. ``auto``: bfloat16 on GPU/TPU (with float32 ``param_dtype``: float32 master weights and optimizer state), float32 on CPU (as fast there, and more accurate)."""
    remat: bool = False
    """Rematerialise each decoder layer in the backward pass (less memory, ~1/3 more compute)."""
    remat_policy: Literal["auto", "full", "save_dots"] = "auto"
    """With ``remat``: what a layer keeps for the backward pass. ``full``: only its input (the whole layer is recomputed); ``save_dots``: also its weight matmuls' outputs (q/k/v/o, gate/up/down projections: JAX's ``dots_with_no_batch_dims_saveable``), so the backward recomputes only norms, rope, attention and activations, for more memory than ``full`` (``asyncrl plan`` counts it). ``auto``: a run picks at start, from the memory its GPU or TPU reports (``memory_stats()['bytes_limit']``) and ``asyncrl plan``'s formulas (no compile), ``save_dots`` where the plan is under that memory by more than the formulas' 10% tolerance, else ``full``, and logs the choice in one line; ``full`` on a CPU (no device memory limit to choose against). ``asyncrl plan --target`` picks for that target the same way, compiling where the formulas cannot tell (XLA's peak decides), and prints the choice as the ``--set`` that pins it."""
    scan_layers: Union[bool, Literal["auto"]] = "auto"
    """Run the decoder's identical layers as one ``lax.scan`` over their stacked weights in training and scoring (no KV cache), so XLA compiles one layer instead of every layer; weights, checkpoints and exports stay per layer, and each forward holds a stacked copy of the layer weights (``asyncrl plan`` counts it). ``auto``: on GPUs and TPUs; not on CPUs, where XLA compiled the scanned train step more slowly (docs/performance.md). The engine's prefill and decode keep every layer unrolled."""
    logprob_chunk_size: Union[int, Literal["auto"], None] = "auto"
    """Sequence positions per lm-head chunk in ``per_token_logprobs`` (bounds [B, chunk, vocab] memory); null: chosen under ``logprob_chunk_budget_mb``. ``auto``: null in a run; ``asyncrl plan --target`` picks, for that target, the largest chunk (the trained window whole first, then halves of it down to 32 positions) whose XLA compiled peak of the run fits the device's memory, and prints it as the ``--set`` that pins it."""
    logprob_chunk_budget_mb: float = Field(default=1024.0, ge=0)
    """With ``logprob_chunk_size`` null: the lm head is chunked (under ``jax.checkpoint``) when one float32 ``[rows, positions, vocab]`` logits tensor of a forward would exceed this many MiB, with the most positions per chunk that fit; 0: never chunk automatically."""
    attention: Literal["auto", "xla", "cudnn", "splash", "reference"] = "auto"
    """Attention of training, scoring and prefill (more than one new token). ``auto``: the fused kernel of the platform the program is compiled for (the mesh's devices): cuDNN's flash attention on GPUs with bfloat16/float16 compute, Pallas' splash attention on TPUs, XLA's on the CPU; the causal mask, padding (row lengths on GPUs, segment ids on TPUs) and packing's segment ids go to the kernel as its own mask structure, never as a dense [T, T] mask; a model the kernel cannot take falls back to ``xla`` with one log line saying why (asyncrl/model/attention.py). ``xla``: ``jax.nn.dot_product_attention`` with XLA's implementation and a dense mask; ``cudnn`` / ``splash``: that kernel, explicitly (splash runs in Pallas' interpret mode off TPUs: tests only); ``reference``: asyncrl's own einsum attention. Decoding one token at a time over the KV cache: the GPU decode kernel (one Pallas kernel per layer, per device on an engine mesh) with ``auto``, ``cudnn`` and ``splash``, the einsum path on the CPU and TPUs; ``xla`` and ``reference`` decode by einsum everywhere (asyncrl/model/attention.py ``attention_kernel``, the one switch)."""
    lora: Optional[LoraConfig] = None
    """Train low-rank adapters on frozen base weights instead of every weight (``{rank, alpha, target_modules, dropout}``); null: off."""

    @field_validator("logprob_chunk_size")
    @classmethod
    def _check_chunk(cls, value: Union[int, str, None]) -> Union[int, str, None]:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"model.logprob_chunk_size: at least 1, auto or null (given {value})")
        return value


class DecodingConfig(Section):
    """How completions are decoded (docs/decoding.md): a strategy, and optionally a trie of the
    token sequences a completion may be. In-process engine only: a remote engine refuses both."""

    strategy: Literal["sample", "greedy", "beam"] = "sample"
    """``sample`` draws from the policy (the only trainable strategy: rollouts must sample); ``greedy`` takes the argmax; ``beam`` keeps the ``beam_width`` best prefixes by summed log-prob and returns the best (eval)."""
    constraint: Optional[str] = None
    """A file of the allowed completions, one sequence of token ids per line (spaces or commas; ``#`` comments); every completion is then one of them: tokens outside its trie are masked at every step and a completion ends at a trie leaf. Log-probs are those of the masked distribution, and the trainer scores under the same mask, so RL stays exact. Null: unconstrained."""
    beam_width: int = Field(default=4, ge=1)
    """``beam``: prefixes kept per step (k); at most ``engine.slots``."""
    length_penalty: float = 1.0
    """``beam``: a finished beam's score is its summed log-prob divided by ``length ** length_penalty`` (0: raw sum, which favours short completions; 1: mean per token)."""


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
    decoding: DecodingConfig = Field(default_factory=DecodingConfig)
    """Decoding of training rollouts: ``strategy`` must be ``sample`` (greedy and beam completions are not samples of the policy); ``constraint`` restricts completions to a trie (docs/decoding.md)."""
    length_bucket: int = Field(default=64, ge=1)
    """Batch length ``L`` is the longest sequence rounded up to a multiple of this (fewer recompilations)."""
    pack: Union[bool, Literal["auto"]] = "auto"
    """Sequence packing in the trainer: each step's rows are packed first-fit-decreasing into as few rows of length ``L`` as hold them, attention and positions kept within each original row (segment ids: cuDNN's packed layout on GPUs, splash's segment ids on TPUs, no dense mask), so padding costs no FLOPs; losses, gradients and every aggregation equal the unpacked step's (float32 rounding), each mini-batch packed from exactly its own rows (docs/performance.md "Sequence packing"). RL and SFT, with micro- and mini-batches and LoRA (with LoRA dropout the dropped positions are another draw), multi-process data splits (each process packs its own rows), the critic of ``algo.estimator: gae`` (GAE per segment) and reward-model scoring (sequences packed into each scoring batch). A packed row is scored whole (the lm-head window of unpacked batches is off). The packed row count is rounded up to 1/8 of the unpacked rows, so a run compiles at most 8 packed steps per batch shape. ``auto``: on where it pays, with micro-batches by a token budget (``optim.micro_batches: auto`` or ``optim.micro_batch_tokens``, which pack) and where the length cap is long (at least ``PACK_AUTO_MIN_LENGTH`` tokens: long generation budgets have long-tailed lengths), off for short runs, where each packed shape is one more compile for little padding (docs/performance.md "Sequence packing": the rule and its measurement)."""
    pack_max_segments: int = Field(default=16, ge=1)
    """The most sequences one packed row holds: the static bound on segments per row that cuDNN's packed layout needs (its softmax statistics are float32 ``[rows x (bound + 1), heads, L]``); the packer opens a new row rather than exceed it."""
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
    """Dataset/task: a built-in (``copy``, ``reverse``, ``add``, ``gsm8k``, ``jsonl``, ``hf``), an import path, or ``{target, kwargs}`` (e.g. ``{target: jsonl, kwargs: {path: data.jsonl, eval_size: 64}}``). ``gsm8k`` (``openai/gsm8k``) and ``hf`` (``{target: hf, kwargs: {name: org/dataset}}``) come by name from the Hugging Face hub through ``datasets``, downloaded once and cached where ``datasets`` caches; a local copy ``$ASYNCRL_DATA_DIR/<name>/<split>.jsonl`` (``gsm8k/train.jsonl``, ``gsm8k/test.jsonl``) is read instead when present, and ``path`` names a local file. Offline with neither, the run stops with the command that fetches it."""
    max_prompt_tokens: int = Field(default=256, ge=1)
    """A prompt longer than this (in tokens, chat template included) is skipped and counted (``dropped:prompt_too_long``)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the tokenizer's chat template wherever a prompt is rendered (rollouts, eval, SFT, the start-up length check), e.g. ``{enable_thinking: false}`` for Qwen3."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_not_reserved(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(
                f"{', '.join(reserved)} cannot be set here: asyncrl passes the conversation and renders "
                "prompts with add_generation_prompt=True, tokenize=True itself; pass only the template's own variables"
            )
        return kwargs


RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "add_generation_prompt", "tokenize", "return_dict"})


class RewardSpec(Section):
    """One reward function ``fn(prompt: str, completion: str, **sample_fields) -> float`` and its weight."""

    fn: ComponentSpec
    """The function: a registered reward alias, ``pkg.module:function``, or ``{target, kwargs}``."""
    weight: float = 1.0
    """The reward is the weighted sum of the functions' raw scores."""
    name: Optional[str] = None
    """Key of its raw score in ``reward_components``; defaults to the alias or function name."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments bound to the function (as ``fn: {target, kwargs}`` does), e.g. ``{path: DIR}`` for ``fn: reward_model``."""

    @model_validator(mode="after")
    def _kwargs_given_once(self) -> "RewardSpec":
        if self.kwargs and isinstance(self.fn, ComponentRef):
            both = sorted(set(self.kwargs) & set(self.fn.kwargs))
            if both:
                raise ValueError(f"kwargs {both} are given both in fn.kwargs and in kwargs; give each once")
        return self

    def component(self) -> ComponentSpec:
        """``fn`` with ``kwargs`` bound: what the registry resolves."""
        if not self.kwargs:
            return self.fn
        if isinstance(self.fn, ComponentRef):
            return ComponentRef(target=self.fn.target, kwargs={**self.fn.kwargs, **self.kwargs})
        return ComponentRef(target=self.fn, kwargs=dict(self.kwargs))


class AlgoConfig(Section):
    """The RL objective: advantages, the clipped policy loss, KL, entropy and aggregation (``docs/algorithms.md``)."""

    estimator: ComponentSpec = "grpo"
    """Advantage estimator: ``grpo``, ``dr_grpo``, ``rloo``, ``batch``, or an import path; kwargs such as ``{eps: 1e-4}``; ``gae``: per-token GAE from a learned value model (needs the ``critic`` section; Schulman et al. 2016)."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """With ``estimator: gae``: the discount gamma between consecutive trained tokens (1: undiscounted, the usual choice for LMs)."""
    lam: float = Field(default=0.95, ge=0, le=1)
    """With ``estimator: gae``: GAE's lambda (1: Monte-Carlo returns minus V, high variance; 0: one-step TD, biased by V). 0.95 as InstructGPT/OpenRLHF."""
    reward_kl_coef: float = Field(default=0.0, ge=0)
    """With ``estimator: gae``: beta of the per-token KL penalty in the reward, r_t -= beta (log pi_old - log pi_ref) on every trained token (Ouyang et al. 2022); 0 is off. Loads the reference model like ``kl_coef``."""
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
    log_entropy: bool = False
    """Log ``train/entropy`` (token-mean entropy of the policy on trained tokens) even when ``entropy_coef`` is 0: one more pass over every trained token's full-vocabulary distribution per training forward (with ``entropy_coef`` > 0 it is computed, and logged, anyway)."""
    router_aux_loss_coef: float = Field(default=0.0, ge=0)
    """Mixture-of-experts models: weight of the router's load-balancing loss (Switch Transformer's, as transformers' ``load_balancing_loss_func``) added to the policy loss and logged as ``loss/router_aux``; 0 leaves the loss unchanged (the routing statistics are logged either way)."""
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
    decoding: DecodingConfig = Field(default_factory=lambda: DecodingConfig(strategy="greedy"))
    """Decoding of the eval completions scored for reward/accuracy: ``greedy`` (default) or ``beam`` (the best of ``beam_width`` beams); the pass@k samples always sample. ``constraint``: a trie for eval alone (an unconstrained policy evaluated under one); with ``rollout.decoding.constraint`` set, eval uses that and this stays null."""


class RemoteEngineConfig(Section):
    """Rollouts on inference servers speaking SGLang's native HTTP API (SGLang, SGLang-Jax, ``asyncrl serve``); see docs/remote.md."""

    urls: list[str] = Field(min_length=1)
    """Base URLs of the servers, e.g. ``[http://10.0.0.5:30000, http://10.0.0.6:30000]``; every one must read ``weights_dir``."""
    api_key_env: Optional[str] = "ASYNCRL_API_KEY"
    """Environment variable holding the servers' API key (sent as ``Authorization: Bearer``); unset or empty: no key."""
    weights_dir: Optional[str] = None
    """Where published weights are written (``v{N}`` sharded HF safetensors directories, every process writing its share); null: ``<run.output_dir>/weights``. Must be readable by the servers at the same path, and with several processes one directory for all of them (a shared file system; on one host ``/dev/shm/...`` skips the disk)."""
    keep_weights: int = Field(default=2, ge=1)
    """Weight versions kept on disk (older ones are removed after each publish)."""
    publish_adapters: bool = False
    """With ``model.lora``: publish the frozen base once, then only the LoRA adapters (PEFT format, megabytes) through the servers' ``/load_lora_adapter``, each request naming its adapter (docs/remote.md). SGLang must run with ``--enable-lora --max-lora-rank R --lora-target-modules ...``; ``asyncrl serve`` needs nothing. Needs ``model.lora``; one-process runs only (refused with ``mesh.distributed.enabled``); off: every publish writes the merged model."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of the published weights (``config.json``'s ``dtype`` says it): the servers' serving dtype. bfloat16 halves a float32 trainer's publish; the servers then generate with the trainer's weights rounded to bfloat16 (the rollouts' log-probs are the servers', so the loss sees that rounding as off-policy drift)."""
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


class PrefixCacheConfig(Section):
    """Prefix reuse in the in-process engine and ``asyncrl serve`` (docs/agents.md "Prefix reuse"): the KV pages of finished samples stay in the engine's prefix tree until the pool needs them, and a request whose prompt begins with pages the tree holds shares them by reference and computes only the rest."""

    enabled: bool = True
    """Reuse kept prefixes (from one whole page on, or a whole context); false: every request prefills its whole prompt (bit for bit the engine without reuse)."""
    across_versions: bool = False
    """Also reuse KV computed with older weights (after a publish); the tokens a request then generates carry the oldest version among the KV they attend to, so staleness accounting stays exact. False: a publish makes every kept prefix stale, as SGLang's cache flush at a weight update does. Needs ``rollout.max_staleness`` >= 1 (a reusing sample is older than the weights it is generated at). Refused with ``engine.remote`` (the servers keep their own cache, SGLang's flushed at each weight update, and a server's tokens must carry a version it served since the request was sent)."""
    extend_buckets: list[int] = Field(default_factory=lambda: [32, 128])
    """Token counts the prefill of tokens after what a sequence's pages hold is compiled for (the rest of a prompt after its reused prefix, a long context's later chunks), besides ``engine.prefill_buckets``; such a chunk uses the smallest that holds it. Used with reuse off too (long contexts). Any order; each at most ``engine.kv_capacity`` (the default's larger entries are left out)."""

    @field_validator("extend_buckets")
    @classmethod
    def _check_buckets(cls, value: list[int]) -> list[int]:
        if not value or min(value) < 1:
            raise ValueError(f"engine.prefix_cache.extend_buckets: at least one bucket, all >= 1 (given {value})")
        return value


class EngineConfig(Section):
    """The JAX inference engine: batch slots, KV cache, and the shapes it compiles for."""

    slots: Union[int, Literal["auto"]] = 16
    """The most sequences decoded together (rows of the decode batch); a request's ``n`` samples need ``n`` free rows. ``auto``: as many as the device's memory holds after the trainer at the plan's mean length (``asyncrl plan`` states it), at least ``rollout.group_size``, at most ``rollout.max_concurrent x rollout.group_size``, a multiple of 8 from 8 up, sized when the run starts and logged (``asyncrl plan --device-memory`` shows the figure)."""
    kv_capacity: int = Field(default=512, ge=2)
    """The longest context one sequence may reach: prompt + ``max_new_tokens`` of every request must fit. A sequence holds pages for its own tokens only, so this bounds one sequence, not the memory."""
    page_size: Union[int, Literal["auto"]] = "auto"
    """Tokens per KV page (a sequence holds whole pages; pages are shared by reference). Must divide ``kv_capacity``. ``auto``: 16 on the CPU and GPUs, 64 on TPUs, halved until it divides ``kv_capacity``."""
    kv_pages: Union[int, Literal["auto"]] = "auto"
    """Pages in each engine replica's KV pool. When running sequences need more, the most recently admitted one is preempted (its pages released, its tokens kept) and resumed later with the same tokens. At least one sequence's longest context (``kv_capacity / page_size``). ``auto``: in a run, what the device's memory holds after the trainer and the rest of the engine (``asyncrl plan``'s accounting), at most ``slots x kv_capacity / page_size`` per replica (every row at its longest context); an engine made alone: that most."""
    decode_chunk: int = Field(default=8, ge=1)
    """Most tokens decoded per compiled call (a call ends early once every slot is done, or a slot finished and the next waiting request fits); finished slots are refilled and published weights installed between calls."""
    prefill_buckets: list[int] = Field(default_factory=lambda: [16, 32, 64, 128, 256, 512])
    """Token counts prefill is compiled for (one program each); a prompt uses the smallest that holds it, and a longer one is prefilled in chunks of the largest (any prompt up to ``kv_capacity - 1`` tokens)."""
    max_stop_ids: int = Field(default=8, ge=1)
    """Most stop token ids one request may give (the width of the compiled stop-id table)."""
    request_timeout_s: Optional[float] = Field(default=None, gt=0)
    """Default timeout of a request without its own ``timeout_s``; unfinished samples come back ``aborted``. Null: none."""
    tensor_parallel: Union[int, Literal["auto"]] = "auto"
    """Devices each engine replica splits the model over (attention and KV heads, MLP width, vocabulary); the engine's devices (``placement.engine``, by default the trainer's) form ``devices / tensor_parallel`` replicas, each decoding its share of the slots. Must divide the model's KV heads and the engine's devices. ``auto``: of the degrees whose least engine fits beside the trainer in the device's memory (with headroom), the one whose replicas decode the most sequences together once slots and KV pages are sized in what it leaves (the smallest among equals; ``asyncrl plan`` shows the choice), chosen when the run starts and logged, refused before step 1 when none fits; a number that does not fit is refused the same way, with the degrees that do (docs/scaling.md "The engine's mesh")."""
    sampler: Literal["auto", "inverse_cdf", "gumbel"] = "auto"
    """How a slot's token is drawn from ``softmax(logits / T)``: ``inverse_cdf`` (one uniform per slot; fastest on XLA:CPU), ``gumbel`` (Gumbel-max: one fused pass over the vocabulary, for GPUs), ``auto``: ``inverse_cdf`` on the CPU, ``gumbel`` on accelerators. Both draw from the same distribution and report the same log-probs, but a seed's tokens depend on the sampler."""
    attention_buckets: int = Field(default=1, ge=1)
    """Size classes of a decode chunk on the CPU: of the pages it attends over (per row, or every busy row's as one list) and of the rows it runs, each the largest halved ``attention_buckets - 1`` times (multiples of 16); each chunk takes the smallest classes that hold its busy rows and their contexts, one compiled decode program per combination. 1: always every row over its whole ``kv_capacity``."""
    decode_inner_steps: Union[int, Literal["auto"]] = "auto"
    """Decode steps per iteration of a chunk's device loop (unrolled in the compiled program): the chunk's early exit (a slot finished and a refill fits) is tested once every this many steps, so a finished slot idles at most this many steps minus one before it can be refilled, and the program is about this many times larger to compile. On a GPU the host reads the loop's exit test, so it is in the loop once per this many tokens. ``auto``: 8 on GPUs, 1 on the CPU and TPUs (their loops run without the host)."""
    prefix_cache: PrefixCacheConfig = Field(default_factory=PrefixCacheConfig)
    """Reuse of kept prompt prefixes (KV computed once for a group's trajectories, an episode's turns and an agent's calls)."""
    remote: Optional[RemoteEngineConfig] = None
    """Generate on inference servers instead of in-process (the fields above then apply to ``asyncrl serve`` only); null: the in-process JAX engine."""

    @field_validator("slots", "tensor_parallel", "decode_inner_steps", "page_size", "kv_pages")
    @classmethod
    def _check_count_or_auto(cls, value: Union[int, str], info: ValidationInfo) -> Union[int, str]:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"engine.{info.field_name}: at least 1, or auto (given {value})")
        return value

    @model_validator(mode="after")
    def _check_buckets(self) -> "EngineConfig":
        if not self.prefill_buckets or min(self.prefill_buckets) < 1:
            raise ValueError(f"engine.prefill_buckets: need at least one bucket, all >= 1 (given {self.prefill_buckets})")
        if max(self.prefill_buckets) > self.kv_capacity:
            raise ValueError(
                f"engine.prefill_buckets: {max(self.prefill_buckets)} exceeds engine.kv_capacity ({self.kv_capacity})"
            )
        if isinstance(self.page_size, int) and self.kv_capacity % self.page_size:
            raise ValueError(f"engine.page_size: {self.page_size} does not divide engine.kv_capacity ({self.kv_capacity}); "
                             "a sequence holds whole pages up to its longest context")
        if isinstance(self.page_size, int) and isinstance(self.kv_pages, int) and self.kv_pages * self.page_size < self.kv_capacity:
            raise ValueError(f"engine.kv_pages: {self.kv_pages} pages of {self.page_size} tokens hold less than one sequence's "
                             f"longest context (engine.kv_capacity = {self.kv_capacity}); give at least "
                             f"{self.kv_capacity // self.page_size}")
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
    no_decay: tuple[str, ...] = ("embed", "norm", "bias")
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
    micro_batches: Union[int, Literal["auto"]] = 1
    """Gradient-accumulation chunks per optimizer update: each mini-batch is split into this many micro-batches (memory, not math: the update is the same). ``auto``: micro-batches by a token budget taken from memory: each holds at most ``micro_batch_tokens`` tokens per device, the largest budget (whole rows of the length cap, at most 32,768 tokens or one row) whose plan fits the device's memory beside the engine (``asyncrl plan``'s formulas; chosen when the trainer is built and logged, ``asyncrl plan --target`` chooses it for the target), packed (``rollout.pack``), so the number of micro-batches follows each step's lengths, as verl's dynamic batch size does."""
    micro_batch_tokens: Optional[int] = Field(default=None, ge=1)
    """A token budget per micro-batch and device instead of a count: each step's rows are packed (``rollout.pack``) into rows of the batch's length ``L``, ``micro_batch_tokens // L`` of them per device in each micro-batch, and a mini-batch takes as many micro-batches as its packed rows need (rounded up so that a run compiles at most 8 counts per length). At least the longest row (the length cap rounded up to ``rollout.length_bucket``); with ``micro_batches: auto`` the run's choice is this field. Null: ``micro_batches`` micro-batches."""
    max_consecutive_nonfinite: int = Field(default=5, ge=1)
    """This many optimizer updates in a row with a non-finite loss or gradient (each skipped) stop training with an error."""

    @field_validator("micro_batches")
    @classmethod
    def _check_micro_batches(cls, value: Union[int, str]) -> Union[int, str]:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"optim.micro_batches: at least 1, or auto (given {value})")
        return value

    @property
    def by_tokens(self) -> bool:
        """Micro-batches by a token budget (``micro_batches: auto`` or ``micro_batch_tokens``), not by count."""
        return self.micro_batches == "auto" or self.micro_batch_tokens is not None

    @property
    def micro_batch_count(self) -> int:
        """The fixed micro-batches per mini-batch: ``micro_batches``, or 1 by token budget (each step's
        count then follows its packing)."""
        return 1 if self.by_tokens or not isinstance(self.micro_batches, int) else self.micro_batches


class CriticConfig(Section):
    """The value model of ``algo.estimator: gae``: the policy's architecture with a scalar value head (``docs/algorithms.md``).

    It lives on the trainer's mesh, is trained once per optimizer update of the policy (same
    mini- and micro-batches) with its own optimizer, and is checkpointed with the trainer."""

    path: Optional[str] = None
    """Local Hugging Face directory of the critic's decoder: a causal LM of the policy's vocabulary (value head zero-initialised) or an exported ``hf_critic/`` (its head kept); null: a copy of the policy's initial weights."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """The critic's optimizer and schedule (same fields as ``optim``; ``micro_batches`` is the policy's, this one is not read). Critics usually take a larger ``lr`` than the policy."""
    lora: Optional[LoraConfig] = None
    """Train low-rank adapters on the frozen critic decoder (the value head is trained whole); null: every weight."""
    value_clip: Optional[float] = Field(default=0.2, gt=0)
    """c of the clipped value loss: V is kept within V_old +- c (PPO2 / OpenAI baselines); null: unclipped squared error."""
    loss_coef: float = Field(default=1.0, gt=0)
    """Multiplies the value loss before its gradient (the critic has its own optimizer, so with Adam this mostly matters for gradient clipping)."""


class SFTConfig(Section):
    """Supervised fine-tuning (a stage of ``type: sft``): prompt + reference response, cross-entropy on the response."""

    batch_size: int = Field(default=32, ge=1)
    """Examples (rows) per SFT step, padded up to the trainer's row multiple; one optimizer update each."""


class DistributedConfig(Section):
    """Multi-process (multi-host) SPMD training on JAX's own distributed runtime."""

    enabled: bool = False
    """Call ``jax.distributed.initialize`` before anything else touches JAX; every process runs the same program. Also on when ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` are all set (null fields below are then read from them; ``asyncrl launch`` sets them); ``asyncrl train`` decides this first thing (docs/scaling.md)."""
    coordinator_address: Optional[str] = None
    """``host:port`` of process 0's coordinator; null: JAX's detection (``JAX_COORDINATOR_ADDRESS``, SLURM, Open MPI, Kubernetes, ...)."""
    num_processes: Optional[int] = Field(default=None, ge=1)
    """Number of processes; null: JAX's cluster detection."""
    process_id: Optional[int] = Field(default=None, ge=0)
    """This process's index in ``[0, num_processes)``; null: JAX's cluster detection."""
    initialization_timeout_s: int = Field(default=300, ge=1)
    """How long each process waits at start for all ``num_processes`` to reach the coordinator; then it exits (69) with an error naming this field."""
    heartbeat_timeout_s: int = Field(default=60, ge=1)
    """A process silent this long (crashed, killed, host down) ends every other process with an error naming it (exit 69); a process that fails with an error ends the others within about a second (exit 70). JAX's own heartbeat timeout is set longer, as a backstop."""
    shutdown_timeout_s: int = Field(default=300, ge=1)
    """At a normal end, how long a finished process waits for the others to finish too (JAX's shutdown barrier; e.g. process 0 writing the final export)."""


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


DEVICE_RANGE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*:\s*(\d+(?:\.\d*)?|\.\d+)\s*$")
"""``start:stop`` of :class:`PlacementConfig`: two whole device indices, or two fractions (a ``.`` in both)."""


def parse_device_range(text: str) -> tuple[float, float, bool]:
    """``(start, stop, fractional)`` of a device range such as ``"4:8"`` or ``"0.5:1.0"``;
    a bad form raises ``ValueError`` (the caller names the field). Bounds are resolved against the device
    count at start (:func:`asyncrl.cluster.placement.resolve_placement`)."""
    match = DEVICE_RANGE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a device range; write 'start:stop' with device indices "
                         "(e.g. '4:8', stop exclusive) or fractions of the devices (e.g. '0.5:1.0')")
    a, b = match.groups()
    fractional = "." in a or "." in b
    if fractional != ("." in a and "." in b):
        raise ValueError(f"{text!r} mixes an index and a fraction; write both as indices ('4:8') "
                         "or both as fractions ('0.5:1.0')")
    start, stop = float(a), float(b)
    if fractional and not 0.0 <= start < stop <= 1.0:
        raise ValueError(f"{text!r}: fractions need 0 <= start < stop <= 1")
    if not start < stop:
        raise ValueError(f"{text!r} is empty; stop must be greater than start (stop is exclusive)")
    return start, stop, fractional


class PlacementConfig(Section):
    """Which devices train and which generate (docs/scaling.md "Placement").

    A range is ``"start:stop"`` over ``jax.devices()`` in (process, id) order, stop exclusive:
    device indices (``"0:4"``) or, with a ``.`` in both bounds, fractions of the device count
    (``"0.5:1.0"``: the second half; each bound must land on a whole device). Disjoint ranges
    split the devices between trainer and engine; an engine range inside the trainer's shares
    those devices with it; a partial overlap is an error. With several processes a range is
    over each process's own devices (``jax.local_devices()``), the same on every host: every
    process runs an engine of its own on its part of ``engine``.
    """

    trainer: Optional[str] = None
    """The trainer mesh's devices (``mesh.data`` x ``fsdp`` x ``tensor`` must fit them; several processes: this range of every host's devices); null: all devices."""
    engine: Optional[str] = None
    """The in-process engine's devices (several processes: this range of each host's devices, one engine per process); null: colocated with the trainer (each process's share of the trainer's devices)."""

    @field_validator("trainer", "engine")
    @classmethod
    def _check_range(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            parse_device_range(value)
        return value


class CheckpointConfig(Section):
    """Checkpoints under ``<run.output_dir>/checkpoints/step_<k>/`` and resuming from them (``docs/checkpoints.md``)."""

    every_steps: int = Field(default=50, ge=0)
    """Write a checkpoint every this many trainer steps, after the last step, and on SIGINT/SIGTERM; 0: only after the last step and on a signal."""
    keep: Optional[int] = Field(default=3, ge=1)
    """Keep the newest this many complete checkpoints (older ones are deleted once the new one is in place); null keeps all."""
    resume: Literal["never", "auto"] = "never"
    """``auto`` (or ``asyncrl train --resume``): continue from the newest complete checkpoint in ``run.output_dir``, or start fresh if there is none; ``never``: always start fresh."""
    asynchronous: bool = True
    """Finish each checkpoint write in the background while the next steps train (at most one in flight; the run's end, SIGINT/SIGTERM and a stage's end wait for it); false: the step waits for the whole write."""
    barrier_timeout_s: float = Field(default=600.0, gt=0)
    """Multi-process runs: how long a process waits for the other processes' part of a checkpoint (their shards written and hashed, the directory renamed into place) before the run fails."""


class WandbConfig(Section):
    """The Weights & Biases run of ``logging.trackers: [wandb]`` (``pip install 'asyncrl[wandb]'``)."""

    project: str = "asyncrl"
    """W&B project the run is logged to."""
    entity: Optional[str] = None
    """W&B team or user; null: the logged-in user's default entity."""
    group: Optional[str] = None
    """W&B group (runs of one experiment shown together); null: none."""
    tags: list[str] = Field(default_factory=list)
    """Tags of the run; the stage being trained is added as ``stage:<name>``."""
    mode: Optional[Literal["online", "offline", "disabled"]] = None
    """``offline`` keeps the run under ``<run.output_dir>/wandb/`` (upload later with ``wandb sync``); null: ``$WANDB_MODE``, else online."""


class MlflowConfig(Section):
    """The MLflow run of ``logging.trackers: [mlflow]`` (``pip install 'asyncrl[mlflow]'``)."""

    tracking_uri: Optional[str] = None
    """Tracking server or store (``http://host:5000``, ``sqlite:///mlflow.db``); null: ``$MLFLOW_TRACKING_URI``, else a local store ``sqlite:///<run.output_dir>/mlflow.db`` with artifacts under ``<run.output_dir>/mlartifacts/``. With a URI, artifacts (trajectory tables, ``config.json``) go where its experiment says: a server's artifact root, or MLflow's default ``./mlruns`` for an experiment a database store creates."""
    experiment: str = "asyncrl"
    """Experiment the run belongs to (created if missing)."""


class LoggingConfig(Section):
    """What the run reports and how."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Python logging level of asyncrl's own loggers."""
    dump_every_steps: int = Field(default=10, ge=0)
    """Append a few of the step's trajectories (prompt, completion, reward components, versions) to ``trajectories.jsonl`` every this many steps; 0 is off."""
    dump_groups: int = Field(default=2, ge=1)
    """Groups written per trajectory dump."""
    console_metrics: list[str] = Field(default_factory=list)
    """Metrics shown on the console line after reward, eval, lag and tok/s, by name (e.g. ``[engine/prefix_hit_rate, episode/tool_calls]``), each labelled by its last path part; a name absent from a step's row shows its last value."""
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default=["tensorboard"])
    """Where each step's metric row goes besides ``metrics.jsonl`` (always written): ``tensorboard`` (event files under ``tensorboard/``), ``wandb`` (Weights & Biases, ``pip install 'asyncrl[wandb]'``), ``mlflow`` (``pip install 'asyncrl[mlflow]'``). W&B and MLflow also get the resolved config and provenance, the stage as a tag and the dumped trajectories as a table; they log from a background thread (a failing tracker warns once and the run goes on) and ``--resume`` continues their run (README, "Outputs")."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Settings of the W&B tracker."""
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    """Settings of the MLflow tracker."""
    tracker_queue_size: int = Field(default=1000, ge=1)
    """Rows (and trajectory tables) waiting for W&B/MLflow at most; beyond it a row is dropped with a warning rather than slow a step."""
    tracker_flush_timeout_s: float = Field(default=10.0, gt=0)
    """At the end of a run (and after SIGINT/SIGTERM) how long to wait for W&B/MLflow to send what is queued before giving up with a warning."""

    @field_validator("trackers")
    @classmethod
    def _no_repeated_tracker(cls, trackers: list[str]) -> list[str]:
        repeated = sorted({t for t in trackers if trackers.count(t) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed more than once")
        return trackers
