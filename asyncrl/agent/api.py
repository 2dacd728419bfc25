"""The OpenAI-compatible API over any :class:`~asyncrl.engine.protocol.InferenceEngine`.

Routes (under a base URL ending in ``/v1``): ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models``. :class:`OpenAIEndpoint` turns a request body into
one :class:`~asyncrl.engine.protocol.GenerationRequest` and the engine's samples into the
answer's JSON; the in-process transports (:mod:`asyncrl.agent.client`), the episode gateway and
``asyncrl serve`` all go through it, so they agree.

Sampling parameters: ``temperature`` and ``top_p`` (as the engine's), ``max_tokens`` /
``max_completion_tokens`` (capped by the server's limits), ``stop`` (strings; the engine stops
on their token ids and the text is cut at the first one), ``n``, ``seed`` (replaces the call
number in the random key: two calls with one seed and one prompt draw the same tokens),
``tools`` / ``tool_choice`` (``auto`` or ``none``), ``logprobs``. ``frequency_penalty`` /
``presence_penalty`` of 0, ``logit_bias`` empty, ``response_format`` ``text``, ``stream`` false
and metadata fields (``user``, ``store``, ``metadata``, ``parallel_tool_calls``, ...) are
accepted. Anything else is a 400 naming the parameter; ``stream: true`` is refused (400).
When training (``required_temperature`` set), a ``temperature`` other than
``rollout.temperature`` is refused too: its log-probs could not be trained.

The ``model`` field is echoed, never checked: agents written for another model's name run as is.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import secrets
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from asyncrl.agent.recording import CompletionRecord, EpisodeRecorder
from asyncrl.agent.tools import ToolFormat, detect_tool_format, parse_tool_calls
from asyncrl.engine.protocol import GenerationRequest, GenerationResponse
from asyncrl.rollout.workflow import token_ids

KEY_STRIDE = 128
"""Random-key indices reserved per run: run ``r``'s samples use ``r * KEY_STRIDE + i``, so ``n`` is at most this."""

_IGNORED = {"model", "messages", "prompt", "user", "store", "metadata", "parallel_tool_calls", "service_tier",
            "stream_options", "prompt_cache_key", "safety_identifier"}
_HANDLED = {"temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "n", "seed", "tools", "tool_choice",
            "logprobs", "stream", "frequency_penalty", "presence_penalty", "logit_bias", "response_format",
            "chat_template_kwargs", "top_logprobs"}
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "aborted": "length"}


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape, naming the parameter at fault."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        self.status, self.message, self.param, self.code = status, message, param, code
        super().__init__(message)

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclasses.dataclass(frozen=True)
class Limits:
    """Server-side sampling settings and bounds."""

    max_new_tokens: int = 256
    """Default and cap of ``max_tokens`` (``rollout.max_new_tokens`` when training)."""
    max_total_tokens: Optional[int] = None
    """Prompt + completion at most this (when training: ``Config.context_limit``); None: unbounded."""
    total_field: str = "max_total_tokens"
    """The setting ``max_total_tokens`` comes from, named when a prompt leaves no room under it."""
    max_prompt_tokens: Optional[int] = None
    """Longest prompt taken; None: only ``max_total_tokens`` bounds it."""
    default_temperature: float = 1.0
    """``temperature`` when the request gives none."""
    required_temperature: Optional[float] = None
    """When training: the only temperature accepted (``rollout.temperature``)."""
    stop_token_ids: Optional[tuple[int, ...]] = None
    """The engine's stop ids; None: the model's EOS ids."""


@dataclasses.dataclass
class Prepared:
    """A validated API call: the engine request, and how to turn its samples into the answer."""

    request: Optional[GenerationRequest]
    """None for routes that need no engine (``/v1/models``)."""
    finish: Callable[[list[GenerationResponse]], dict[str, Any]]


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise _bad(f"{where}.content[{k}]", f"only text parts are supported (given {kind!r})")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where}.content", f"must be a string or a list of text parts (given {type(content).__name__})")


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages as HF chat templates take them: text content, tool-call arguments
    as objects (what Qwen and Llama templates render), ``None`` fields dropped."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of chat messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(f"{where}.role", "must be system, developer, user, assistant or tool")
        role = "system" if message["role"] == "developer" else message["role"]
        item: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"), where)}
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for k, call in enumerate(message["tool_calls"]):
                function = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                    raise _bad(f"{where}.tool_calls[{k}].function", "needs a name and arguments")
                arguments = function.get("arguments", "{}")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments) if arguments.strip() else {}
                    except json.JSONDecodeError:
                        pass  # rendered as the string it is
                calls.append({"id": call.get("id"), "type": "function",
                              "function": {"name": function["name"], "arguments": arguments}})
            item["tool_calls"] = calls
        if role == "tool":
            if message.get("tool_call_id") is not None:
                item["tool_call_id"] = message["tool_call_id"]
            if message.get("name") is not None:
                item["name"] = message["name"]
        out.append(item)
    return out


class OpenAIEndpoint:
    """The OpenAI routes for one tokenizer and chat template.

    Args:
        tokenizer: HF-style (``apply_chat_template``, ``encode``, ``decode``).
        model_name: what ``/v1/models`` lists and answers carry.
        limits: server-side sampling settings (:class:`Limits`).
        tool_format: ``auto`` (from the chat template), ``qwen``, ``llama3_json`` or ``none``.
        template_kwargs: passed to the chat template (``data.chat_template_kwargs``); a request's
            ``chat_template_kwargs`` (vLLM's extension) are added.
    """

    def __init__(self, tokenizer: Any, model_name: str = "asyncrl", *, limits: Limits = Limits(),
                 tool_format: str = "auto", template_kwargs: Optional[Mapping[str, Any]] = None):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        template = getattr(tokenizer, "chat_template", None)
        self.tool_format: ToolFormat = (detect_tool_format(template if isinstance(template, str) else None)
                                        if tool_format == "auto" else tool_format)  # type: ignore[assignment]
        self.template_kwargs = dict(template_kwargs or {})
        self._anonymous = itertools.count(1 << 40)  # random keys of calls outside an episode

    # ------------------------------------------------------------------ routing

    def prepare(self, method: str, path: str, body: Optional[Mapping[str, Any]], recorder: Optional[EpisodeRecorder]) -> Prepared:
        """Validate one call; ``path`` is the part after the base URL's ``/v1`` (``/chat/completions``)."""
        route = "/" + path.strip("/")
        if route == "/models":
            if method != "GET":
                raise ApiError(405, f"{route}: use GET")
            return Prepared(None, lambda _: self.models())
        if route not in ("/chat/completions", "/completions"):
            raise ApiError(404, f"{route}: not an OpenAI route asyncrl serves (/v1/chat/completions, /v1/completions, /v1/models)")
        if method != "POST":
            raise ApiError(405, f"{route}: use POST")
        if not isinstance(body, Mapping):
            raise ApiError(400, f"{route}: the body must be a JSON object")
        unknown = sorted(set(body) - _IGNORED - _HANDLED)
        if unknown:
            raise _bad(unknown[0], f"not supported by asyncrl's OpenAI-compatible API (supported: {', '.join(sorted(_HANDLED))})")
        self._check_neutral(body)
        if route == "/chat/completions":
            return self._prepare_chat(body, recorder)
        return self._prepare_text(body, recorder)

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "asyncrl"}]}

    # ------------------------------------------------------------------ validation

    @staticmethod
    def _check_neutral(body: Mapping[str, Any]) -> None:
        if body.get("stream"):
            raise _bad("stream", "streaming is not supported; call without stream=True (answers come whole)")
        for name in ("frequency_penalty", "presence_penalty"):
            if body.get(name) not in (None, 0, 0.0):
                raise _bad(name, "only 0 is supported (a penalty would change the sampled distribution)")
        if body.get("logit_bias"):
            raise _bad("logit_bias", "not supported (it would change the sampled distribution)")
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
            raise _bad("response_format", "only {'type': 'text'} is supported")
        if body.get("top_logprobs"):
            raise _bad("top_logprobs", "not supported (logprobs=True gives each sampled token's log-prob)")

    def _sampling(self, body: Mapping[str, Any], prompt_ids: list[int], recorder: Optional[EpisodeRecorder]) -> tuple[GenerationRequest, list[str]]:
        limits = self.limits
        n = 1 if body.get("n") is None else body["n"]
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= KEY_STRIDE:
            raise _bad("n", f"must be an integer in [1, {KEY_STRIDE}] (given {n!r})")
        temperature = body.get("temperature")
        if temperature is None:
            temperature = limits.required_temperature if limits.required_temperature is not None else limits.default_temperature
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise _bad("temperature", f"must be a number >= 0 (given {temperature!r})")
        if limits.required_temperature is not None and float(temperature) != limits.required_temperature:
            raise _bad("temperature", f"{temperature} differs from rollout.temperature = {limits.required_temperature}: "
                       "log-probs at another temperature cannot be trained; leave temperature unset")
        top_p = body.get("top_p")
        top_p = 1.0 if top_p is None else top_p
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise _bad("top_p", f"must be in (0, 1] (given {top_p!r})")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
            raise _bad(param, f"must be a positive integer (given {max_tokens!r})")
        max_new = min(max_tokens or limits.max_new_tokens, limits.max_new_tokens)
        if limits.max_prompt_tokens is not None and len(prompt_ids) > limits.max_prompt_tokens:
            raise ApiError(400, f"messages: the prompt has {len(prompt_ids)} tokens, more than the {limits.max_prompt_tokens} "
                           "this server takes", param="messages", code="context_length_exceeded")
        if limits.max_total_tokens is not None:
            room = limits.max_total_tokens - len(prompt_ids)
            if room < 1:
                raise ApiError(400, f"messages: the prompt has {len(prompt_ids)} tokens, leaving no room under the "
                               f"{limits.max_total_tokens}-token context ({limits.total_field})", param="messages",
                               code="context_length_exceeded")
            max_new = min(max_new, room)
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
            raise _bad("stop", "must be a non-empty string or a list of at most 4 of them")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or seed < 0):
            raise _bad("seed", f"must be a non-negative integer (given {seed!r})")
        if recorder is not None:
            call = recorder.next_call()
            sample_id, index = recorder_key(recorder)
        else:
            call, sample_id, index = 0, next(self._anonymous), 0
        request = GenerationRequest(
            prompt_ids=prompt_ids, n=n, temperature=float(temperature) if temperature > 0 else 1.0, greedy=temperature == 0,
            top_p=float(top_p), max_new_tokens=max_new, stop_token_ids=limits.stop_token_ids,
            stop_sequences=tuple(tuple(self._encode(s)) for s in stops), sample_id=sample_id, index_in_group=index,
            turn=seed if seed is not None else call,
        )
        return request, stops

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def _decode(self, ids: Any, stops: Sequence[str]) -> tuple[str, bool]:
        """Text of sampled ids (special tokens dropped), cut before the first stop string; and whether it was cut."""
        text = self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)
        cuts = [text.find(s) for s in stops if s in text]
        return (text[: min(cuts)], True) if cuts else (text, False)

    # ------------------------------------------------------------------ chat

    def render(self, messages: list[dict[str, Any]], tools: Optional[list] = None,
               extra_kwargs: Optional[Mapping[str, Any]] = None) -> list[int]:
        """Prompt ids of ``messages`` (and ``tools``) through the chat template, with the generation prompt."""
        kwargs = {**self.template_kwargs, **dict(extra_kwargs or {})}
        if tools:
            kwargs["tools"] = tools
        return token_ids(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs))

    def _prepare_chat(self, body: Mapping[str, Any], recorder: Optional[EpisodeRecorder]) -> Prepared:
        messages = template_messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) and t.get("type") == "function"
                                                                          and isinstance(t.get("function"), Mapping) for t in tools)):
            raise _bad("tools", "must be a list of {'type': 'function', 'function': {...}}")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise _bad("tool_choice", f"only 'auto' and 'none' are supported (given {choice!r}): the model decides")
        use_tools = bool(tools) and choice != "none"
        if use_tools and self.tool_format == "none":
            raise _bad("tools", "this model's chat template has no tool-call format asyncrl can parse "
                       "(set the tool format, qwen or llama3_json, where the endpoint is built)")
        extra = body.get("chat_template_kwargs")
        if extra is not None and not isinstance(extra, Mapping):
            raise _bad("chat_template_kwargs", "must be an object")
        try:
            prompt_ids = self.render(messages, tools if use_tools else None, extra)
        except Exception as err:  # noqa: BLE001 - a template error is the request's fault
            raise _bad("messages", f"the chat template failed on them: {type(err).__name__}: {err}") from None
        request, stops = self._sampling(body, prompt_ids, recorder)
        want_logprobs = bool(body.get("logprobs"))
        model = str(body.get("model") or self.model_name)

        def finish(responses: list[GenerationResponse]) -> dict[str, Any]:
            completion_id = f"chatcmpl-{secrets.token_hex(12)}"
            choices = []
            completion_tokens = 0
            for i, response in enumerate(responses):
                completion_tokens += len(response.output_ids)
                text, cut = self._decode(response.output_ids, stops)
                message: dict[str, Any] = {"role": "assistant", "content": text}
                finish_reason = "stop" if cut else _FINISH[response.stop_reason]
                if use_tools and finish_reason == "stop":
                    parsed = parse_tool_calls(text, self.tool_format)
                    malformed = parsed is None and self._looks_like_call(text)
                    if parsed is not None:
                        message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.openai_tool_calls()}
                        finish_reason = "tool_calls"
                    if recorder is not None:
                        recorder.count_tool_calls(len(parsed.calls) if parsed else 0, int(malformed))
                choice_out: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish_reason,
                                              "logprobs": self._logprobs(response) if want_logprobs else None}
                choices.append(choice_out)
                self._record(recorder, completion_id, i, request, response)
            return {"id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                    "choices": choices, "usage": _usage(len(prompt_ids), completion_tokens)}

        return Prepared(request, finish)

    def _looks_like_call(self, text: str) -> bool:
        return ("<tool_call>" in text) if self.tool_format == "qwen" else text.lstrip().startswith(("{", "<|python_tag|>"))

    def _logprobs(self, response: GenerationResponse) -> dict[str, Any]:
        content = []
        for token, logprob in zip(response.output_ids, response.logprobs):
            piece = self.tokenizer.decode([int(token)])
            content.append({"token": piece, "logprob": float(logprob), "bytes": list(piece.encode("utf-8")), "top_logprobs": []})
        return {"content": content, "refusal": None}

    @staticmethod
    def _record(recorder: Optional[EpisodeRecorder], completion_id: str, choice: int, request: GenerationRequest,
                response: GenerationResponse) -> None:
        if recorder is not None:
            recorder.add(CompletionRecord(completion_id=completion_id, choice=choice, call=request.turn,
                                          prompt_ids=np.asarray(request.prompt_ids, np.int32), response=response))

    # ------------------------------------------------------------------ text completions

    def _prepare_text(self, body: Mapping[str, Any], recorder: Optional[EpisodeRecorder]) -> Prepared:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            prompt_ids = token_ids(self.tokenizer.encode(prompt))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise _bad("prompt", "must be a non-empty string or a non-empty list of token ids (one prompt per call)")
        request, stops = self._sampling(body, prompt_ids, recorder)
        model = str(body.get("model") or self.model_name)

        def finish(responses: list[GenerationResponse]) -> dict[str, Any]:
            completion_id = f"cmpl-{secrets.token_hex(12)}"
            choices = []
            for i, response in enumerate(responses):
                text, cut = self._decode(response.output_ids, stops)
                choices.append({"index": i, "text": text, "finish_reason": "stop" if cut else _FINISH[response.stop_reason],
                                "logprobs": None})
                self._record(recorder, completion_id, i, request, response)
            used = sum(len(r.output_ids) for r in responses)
            return {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model,
                    "choices": choices, "usage": _usage(len(prompt_ids), used)}

        return Prepared(request, finish)


def recorder_key(recorder: EpisodeRecorder) -> tuple[int, int]:
    """``(sample_id, first key index)`` of a run's requests."""
    return int(recorder.sample_id), recorder.run_index * KEY_STRIDE


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
