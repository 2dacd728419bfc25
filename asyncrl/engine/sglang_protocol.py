"""The subset of SGLang's native HTTP API that asyncrl speaks, as pydantic models.

Written from SGLang's own documentation (sgl-project/sglang: ``docs/basic_usage/sampling_params.md``
for ``/generate`` and its ``sampling_params``; ``docs/advanced_features/sglang_for_rl.md`` for
``/pause_generation``, ``/continue_generation`` and ``/update_weights_from_disk``) and the request
dataclasses of ``python/sglang/srt/managers/io_struct.py`` (``GenerateReqInput``,
``PauseGenerationReqInput``, ``UpdateWeightFromDiskReqInput``, ``AbortReq``). Both directions are
validated: :class:`~asyncrl.engine.remote.RemoteEngine` builds its requests from these models and
parses every answer with them; ``asyncrl serve`` parses requests with them and builds its answers
from them. Requests forbid unknown fields (``asyncrl serve`` supports a subset and says which field
it does not know, rather than ignoring it); responses allow extra fields, since SGLang adds
metadata from version to version.

Endpoints (all JSON; SGLang answers 200 on success, 400 on a refused request):

====================================  =======================================  ==============================
endpoint                              request                                  response
====================================  =======================================  ==============================
``POST /generate``                    :class:`GenerateReqInput`                :class:`GenerateItem` or a list
``POST /pause_generation``            :class:`PauseGenerationReqInput`         anything (SGLang: empty)
``POST /continue_generation``         :class:`ContinueGenerationReqInput`      anything
``POST /update_weights_from_disk``    :class:`UpdateWeightFromDiskReqInput`    :class:`UpdateWeightFromDiskReqOutput`
``POST /load_lora_adapter``           :class:`LoadLoRAAdapterReqInput`         :class:`LoRAUpdateOutput`
``POST /unload_lora_adapter``         :class:`UnloadLoRAAdapterReqInput`       :class:`LoRAUpdateOutput`
``POST /abort_request``               :class:`AbortReq`                        anything
``POST /flush_cache``                 (none)                                   anything
``GET /health``                       (none)                                   200 when serving
``GET /get_model_info``               (none)                                   :class:`ModelInfo`
====================================  =======================================  ==============================

Conventions that matter for RL (from the same documents):

* ``input_ids`` in, ``output_ids`` out: nothing is re-tokenised. A list of lists is a batch and
  the answer is then a list, one item per prompt.
* ``temperature = 0`` is greedy; ``top_k = -1`` and ``top_p = 1`` are off.
* ``stop_token_ids`` add to the model's EOS ids (they do not replace them).
* ``meta_info.output_token_logprobs`` is a list of ``[logprob, token_id, text_or_null]``. SGLang's
  log-probs are taken after the temperature (``log softmax(logits / T)``) unless the server runs
  with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (then before it); asyncrl needs the former.
* ``meta_info.finish_reason`` is ``{"type": "stop", "matched": id_or_str}``,
  ``{"type": "length", "length": n}`` or ``{"type": "abort", "message": ...}`` (a request cut by
  ``/pause_generation`` in mode ``abort`` comes back with the tokens it had and type ``abort``).
* LoRA (SGLang's ``docs/advanced_features/lora.md``, "Dynamic LoRA loading", and ``io_struct.py``'s
  ``LoadLoRAAdapterReqInput {lora_name, lora_path, pinned, lora_id}``,
  ``UnloadLoRAAdapterReqInput {lora_name, lora_id}``, answered by ``LoRAUpdateResult {success,
  error_message, loaded_adapters}``): the server must run with ``--enable-lora`` (and
  ``--max-lora-rank``, ``--lora-target-modules`` when no adapter is given at start); ``lora_path``
  is a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``, tensors named
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``); a ``/generate`` request runs
  under the adapter its ``lora_path`` field names (one name, or one per prompt; the *name* given at
  load). Loading an adapter does not change ``weight_version``.
* ``weight_version`` is a string label the server reports in ``meta_info`` and ``/get_model_info``;
  asyncrl uses ``str(N)`` for trainer version ``N``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

PauseMode = Literal["abort", "retract", "in_place"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class SamplingParams(_Request):
    """``sampling_params`` of ``/generate`` (SGLang ``SamplingParams``; the fields asyncrl uses)."""

    max_new_tokens: int = Field(default=128, ge=0)
    """Most tokens generated (SGLang default 128)."""
    min_new_tokens: int = Field(default=0, ge=0)
    """Stop ids are not honoured before this many tokens."""
    temperature: float = Field(default=1.0, ge=0)
    """0 is greedy."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus mass; 1 is off."""
    top_k: int = -1
    """-1 is off."""
    stop_token_ids: Optional[list[int]] = None
    """Token ids that end a sample, in addition to the model's EOS ids."""
    n: int = Field(default=1, ge=1)
    """Samples per prompt."""
    ignore_eos: bool = False
    """Do not stop at EOS (nor at ``stop_token_ids``)."""
    no_stop_trim: bool = False
    """Keep the stop token in the text (output ids always keep it)."""
    skip_special_tokens: bool = True
    """Detokenisation only."""
    custom_params: Optional[dict[str, Any]] = None
    """Free-form per-request parameters. asyncrl puts its sample key here
    (``{"asyncrl_key": [sample_id, key_index, turn]}``); ``asyncrl serve`` seeds the sample with it."""


class GenerateReqInput(_Request):
    """Body of ``POST /generate`` (SGLang ``GenerateReqInput``; the token-id subset)."""

    input_ids: Union[list[int], list[list[int]]]
    """One prompt, or a batch of prompts (then the answer is a list)."""
    sampling_params: Union[SamplingParams, list[SamplingParams]] = Field(default_factory=SamplingParams)
    """One set for all prompts, or one per prompt."""
    return_logprob: Union[bool, list[bool]] = False
    """Return ``meta_info.output_token_logprobs``."""
    logprob_start_len: int = -1
    """-1: log-probs of output tokens only."""
    return_text_in_logprobs: bool = False
    """Detokenise the tokens in the log-prob triples (asyncrl never asks)."""
    rid: Optional[Union[str, list[str]]] = None
    """Request id(s), for ``/abort_request``."""
    lora_path: Optional[Union[str, list[Optional[str]]]] = None
    """The LoRA adapter to run under (the ``lora_name`` it was loaded as), one for all prompts or one per prompt."""
    stream: Literal[False] = False
    """asyncrl never streams."""

    def prompts(self) -> list[list[int]]:
        """The prompts as a batch."""
        ids = self.input_ids
        return [list(ids)] if not ids or isinstance(ids[0], int) else [list(p) for p in ids]  # type: ignore[arg-type]

    @property
    def is_batch(self) -> bool:
        return bool(self.input_ids) and not isinstance(self.input_ids[0], int)


class FinishReason(_Response):
    """``meta_info.finish_reason``."""

    type: Literal["stop", "length", "abort"]
    matched: Optional[Union[int, str, list[int]]] = None
    """The stop token id (or stop string) that ended the sample."""
    length: Optional[int] = None
    message: Optional[str] = None


class MetaInfo(_Response):
    """``meta_info`` of one ``/generate`` answer item."""

    id: str
    finish_reason: Optional[FinishReason]
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    cached_tokens: int = 0
    weight_version: Optional[str] = None
    """The weights label the server held (asyncrl: ``str(version)``)."""
    output_token_logprobs: Optional[list[tuple[float, int, Optional[str]]]] = None
    """``[logprob, token_id, text]`` per output token, when ``return_logprob``."""


class GenerateItem(_Response):
    """One completed prompt of a ``/generate`` answer."""

    text: str = ""
    output_ids: list[int]
    meta_info: MetaInfo


GenerateResponse: TypeAdapter[Union[GenerateItem, list[GenerateItem]]] = TypeAdapter(Union[GenerateItem, list[GenerateItem]])
"""A ``/generate`` answer: one item, or a list for a batch (or ``n > 1``)."""


class PauseGenerationReqInput(_Request):
    """Body of ``POST /pause_generation``: ``abort`` returns in-flight requests at once with their
    partial output; ``retract`` and ``in_place`` keep them on the server to continue later."""

    mode: PauseMode = "abort"


class ContinueGenerationReqInput(_Request):
    """Body of ``POST /continue_generation`` (no fields)."""


class UpdateWeightFromDiskReqInput(_Request):
    """Body of ``POST /update_weights_from_disk`` (all fields of SGLang's RL doc)."""

    model_path: str
    """Directory with the new weights (an HF safetensors directory)."""
    load_format: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    """The label the server reports afterwards."""
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


class UpdateWeightFromDiskReqOutput(_Response):
    """Answer of ``/update_weights_from_disk``."""

    success: bool
    message: str = ""
    num_paused_requests: int = 0


class LoadLoRAAdapterReqInput(_Request):
    """Body of ``POST /load_lora_adapter``."""

    lora_name: str = Field(min_length=1)
    """The name ``/generate`` requests give as ``lora_path``."""
    lora_path: str = Field(min_length=1)
    """The PEFT adapter directory."""
    pinned: bool = False
    """SGLang: keep it in GPU memory (asyncrl serve holds one applied adapter anyway)."""


class UnloadLoRAAdapterReqInput(_Request):
    """Body of ``POST /unload_lora_adapter``."""

    lora_name: str = Field(min_length=1)


class LoRAUpdateOutput(_Response):
    """Answer of ``/load_lora_adapter`` and ``/unload_lora_adapter`` (SGLang ``LoRAUpdateResult``)."""

    success: bool
    error_message: Optional[str] = None
    loaded_adapters: Optional[dict[str, Any]] = None
    """``{lora_name: lora_path}`` of the adapters loaded after the call (SGLang)."""


class AbortReq(_Request):
    """Body of ``POST /abort_request``."""

    rid: str = ""
    abort_all: bool = False


class ModelInfo(_Response):
    """Answer of ``GET /get_model_info``."""

    model_path: str
    tokenizer_path: Optional[str] = None
    is_generation: bool = True
    weight_version: Optional[str] = None


def version_label(version: int) -> str:
    """The ``weight_version`` string of trainer version ``version``."""
    return str(int(version))


def parse_version_label(label: Optional[str], where: str) -> int:
    """Trainer version from a server's ``weight_version``; a clear error names ``where``."""
    try:
        return int(str(label))
    except (TypeError, ValueError):
        raise ValueError(
            f"{where}: weight_version {label!r} is not an asyncrl version (an integer string); the server must be "
            "started with --weight-version 0 (SGLang) or by asyncrl serve, and updated only by this trainer"
        ) from None
