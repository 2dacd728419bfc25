"""The state behind ``asyncrl serve``'s routes (:mod:`asyncrl.serve`): the engine, its weights
labels and adapters, the pause gate, and what each SGLang route does with them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from pydantic import ValidationError

from asyncrl.engine import sglang_protocol as sp
from asyncrl.engine.protocol import GenerationRequest, GenerationResponse
from asyncrl.errors import AsyncRLError, EngineRequestError


class HTTPError(Exception):
    """An answer other than 200: ``status`` and a one-line ``message``."""

    def __init__(self, status: int, message: str):
        self.status = status
        self.message = message
        super().__init__(message)


def validation_message(err: ValidationError, what: str) -> str:
    """One line naming every bad field of a request body."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(body)"
        msg = "field not supported by asyncrl serve" if e["type"] == "extra_forbidden" else e["msg"]
        parts.append(f"{loc}: {msg}")
    return f"{what}: " + "; ".join(parts)


class ServeState:
    """The engine, its weights labels, and the pause gate shared by the handlers.

    The JaxEngine counts its own versions (``engine.version``, +1 per update); ``labels`` maps each
    to the ``weight_version`` string it was loaded as, so a restarted server can load trainer
    version ``N`` directly.
    """

    def __init__(self, engine: Any, model_cfg: Any, model_path: str, *, weights_root: Optional[Path],
                 api_key: Optional[str], weight_version: str = "0", tokenizer: Any = None,
                 openai_limits: Optional[Any] = None):
        self.engine = engine
        self.openai: Any = None
        """The OpenAI-compatible routes' endpoint (:mod:`asyncrl.agent.api`); None without a tokenizer."""
        if tokenizer is not None:
            from asyncrl.agent.api import Limits, OpenAIEndpoint

            self.openai = OpenAIEndpoint(tokenizer, Path(model_path).name or model_path, limits=openai_limits or Limits())
        self.model_cfg = model_cfg
        self.model_path = model_path
        self.weights_root = weights_root.resolve() if weights_root is not None else None
        self.api_key = api_key
        self.labels: dict[int, str] = {engine.version: weight_version}
        self.held_digests: dict[str, str] = {}
        """sha256 of each HF tensor of the base weights, from the index of the publish they came from
        (empty at start: the model directory's tensors carry none)."""
        self.base: Optional[dict] = None
        """The base params adapters apply to (None: the engine's served params, no adapter active)."""
        self.adapters: dict[str, int] = {}
        """lora_name -> the engine version that serves it merged into the base."""
        self.active_adapter: Optional[str] = None
        self.load_figures = {"serve/tensors_read": 0.0, "serve/bytes_read": 0.0, "serve/tensors_kept": 0.0}
        """Of the last ``/update_weights_from_disk`` (``/get_server_info``)."""
        self._layout: Optional[dict] = None
        self.paused = False
        # Replaced on the server's loop by loop_objects() (asyncio primitives bind to one loop).
        self.resumed = asyncio.Event()
        self.update_lock = asyncio.Lock()
        self.sample_ids = itertools.count(1 << 40)  # keys of requests that bring none
        self.rids = itertools.count()

    def loop_objects(self) -> None:
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.update_lock = asyncio.Lock()

    @property
    def label(self) -> str:
        return self.labels[self.engine.version]

    # ------------------------------------------------------------------ generate

    def build_requests(self, body: sp.GenerateReqInput) -> list[tuple[Optional[GenerationRequest], int]]:
        """One entry per output item: ``(request or None for max_new_tokens == 0, samples)``; items of
        one prompt that differ only in their key index become one request with ``n`` samples."""
        prompts = body.prompts()
        params = body.sampling_params
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise HTTPError(400, f"/generate: {len(params)} sampling_params for {len(prompts)} prompts")
        else:
            params = [params] * len(prompts)
        items: list[Optional[GenerationRequest]] = []
        for prompt, sampling in zip(prompts, params):
            for i in range(sampling.n):
                items.append(self.one_request(prompt, sampling, i))
        merged: list[tuple[Optional[GenerationRequest], int]] = []
        for req in items:
            prev, count = merged[-1] if merged else (None, 0)
            if req is not None and prev is not None:
                follows = dataclasses.replace(req, n=prev.n, index_in_group=prev.index_in_group) == prev
                if follows and req.index_in_group == prev.index_in_group + prev.n and prev.n < self.engine.slots:
                    merged[-1] = (dataclasses.replace(prev, n=prev.n + 1), count + 1)
                    continue
            merged.append((req, 1))
        return merged

    def one_request(self, prompt: list[int], sampling: sp.SamplingParams, i: int) -> Optional[GenerationRequest]:
        if sampling.max_new_tokens == 0:
            return None
        if not prompt:
            raise HTTPError(400, "/generate: input_ids is empty: a prompt needs at least one token")
        key = (sampling.custom_params or {}).get("asyncrl_key")
        if key is None:
            sample_id, index, turn = next(self.sample_ids), 0, 0
        elif isinstance(key, list) and len(key) == 3 and all(isinstance(k, int) and k >= 0 for k in key):
            sample_id, index, turn = key
        else:
            raise HTTPError(400, f"/generate: sampling_params.custom_params.asyncrl_key must be [sample_id, key_index, turn] of non-negative ints (given {key!r})")
        greedy = sampling.temperature == 0
        stop = [] if sampling.ignore_eos else sorted(set(self.engine.default_stop_ids) | set(sampling.stop_token_ids or ()))
        try:
            return GenerationRequest(
                prompt_ids=list(prompt), n=1, temperature=1.0 if greedy else sampling.temperature,
                top_k=max(sampling.top_k, 0), top_p=sampling.top_p, greedy=greedy,
                max_new_tokens=sampling.max_new_tokens, min_new_tokens=min(sampling.min_new_tokens, sampling.max_new_tokens),
                stop_token_ids=stop, sample_id=sample_id, index_in_group=index + i, turn=turn,
            )
        except ValueError as err:
            raise HTTPError(400, f"/generate: {err}") from None

    def item(self, response: Optional[GenerationResponse], prompt_len: int, with_logprobs: bool, cached: int = 0) -> dict:
        """One answer item; ``cached``: the prompt tokens the engine did not compute for it
        (``meta_info.cached_tokens``, as SGLang reports its radix cache's)."""
        rid = f"asyncrl-{next(self.rids)}"
        if response is None:
            tokens, logprobs, label = [], [], self.label
            finish = sp.FinishReason(type="length", length=0)
        else:
            tokens = [int(t) for t in response.output_ids]
            logprobs = [float(x) for x in response.logprobs]
            versions = set(int(v) for v in response.versions)
            if len(versions) > 1:
                raise HTTPError(500, f"/generate: internal error: one answer's tokens span weight versions {sorted(versions)}")
            label = self.labels[versions.pop()] if versions else self.label
            reason = response.stop_reason
            if reason == "aborted":
                finish = sp.FinishReason(type="abort", message="aborted by /pause_generation, an update or a timeout")
            elif reason == "length":
                finish = sp.FinishReason(type="length", length=len(tokens))
            else:
                finish = sp.FinishReason(type="stop", matched=tokens[-1])
        meta = sp.MetaInfo(
            id=rid, finish_reason=finish, prompt_tokens=prompt_len, completion_tokens=len(tokens), cached_tokens=cached,
            weight_version=label,
            output_token_logprobs=[(lp, t, None) for lp, t in zip(logprobs, tokens)] if with_logprobs else None,
        )
        return sp.GenerateItem(text="", output_ids=tokens, meta_info=meta).model_dump(exclude_none=True)

    async def generate(self, body: sp.GenerateReqInput) -> Any:
        requests = self.build_requests(body)
        while self.paused:  # held while paused, like SGLang; then run on the new weights
            await self.resumed.wait()
        # No await between the pause check and the submits: a pause cannot slip in between.
        adapter = self.adapter_of(body)
        if adapter != self.active_adapter:  # not what the engine serves: cut at once, resubmitted under the active one
            return self.replaced(body, requests, adapter)
        try:
            futures = [None if r is None else asyncio.wrap_future(self.engine.submit(r)) for r, _ in requests]
        except EngineRequestError as err:
            raise HTTPError(400, f"/generate: {err}") from None
        with_logprobs = body.return_logprob if isinstance(body.return_logprob, bool) else any(body.return_logprob)
        out = []
        for (req, count), fut in zip(requests, futures):
            responses = [None] * count if fut is None else await fut
            prompt_len = len(req.prompt_ids) if req is not None else 0
            for response in responses:
                cached = response.cached_tokens if response is not None and response.cached_tokens is not None else 0
                out.append(self.item(response, prompt_len, with_logprobs, cached))
        return out if body.is_batch or len(out) != 1 else out[0]

    # ------------------------------------------------------------------ control

    def replaced(self, body: sp.GenerateReqInput, requests: list, adapter: Optional[str]) -> Any:
        """Every item of a request naming a replaced adapter (or none while one is applied): no
        tokens, finish type ``abort``."""
        out = []
        for req, count in requests:
            for _ in range(count):
                meta = sp.MetaInfo(id=f"asyncrl-{next(self.rids)}", prompt_tokens=len(req.prompt_ids) if req is not None else 0,
                                   completion_tokens=0, weight_version=self.label, output_token_logprobs=[],
                                   finish_reason=sp.FinishReason(type="abort", message=f"adapter {adapter!r} was replaced by "
                                                                 f"{self.active_adapter!r}: resubmit under it"))
                out.append(sp.GenerateItem(text="", output_ids=[], meta_info=meta).model_dump(exclude_none=True))
        return out if body.is_batch or len(out) != 1 else out[0]

    async def pause(self) -> None:
        self.paused = True
        self.resumed.clear()
        await asyncio.to_thread(self.engine.abort_all)

    def resume(self) -> None:
        self.paused = False
        self.resumed.set()

    def check_path(self, model_path: str, what: str = "/update_weights_from_disk") -> Path:
        if self.weights_root is None:
            raise HTTPError(403, f"{what}: this server was started without --weights-root, so it loads no weights")
        path = Path(model_path).resolve()
        if path != self.weights_root and self.weights_root not in path.parents:
            raise HTTPError(403, f"{what}: {model_path} is outside the weights root {self.weights_root} (--weights-root)")
        return path

    @contextlib.asynccontextmanager
    async def paused_generation(self, keep_pause: bool = False) -> AsyncIterator[None]:
        """Generation paused while a weight change runs (under ``update_lock``), resumed after
        unless it was paused already or ``keep_pause``."""
        was_paused = self.paused
        if not was_paused:
            await self.pause()
        try:
            yield
        finally:
            if not was_paused and not keep_pause:
                self.resume()

    async def update(self, body: sp.UpdateWeightFromDiskReqInput) -> dict:
        path = self.check_path(body.model_path)
        async with self.update_lock, self.paused_generation(keep_pause=body.keep_pause):
            try:
                await asyncio.to_thread(self.load_and_install, path, body.weight_version)
            except (OSError, ValueError, AsyncRLError) as err:
                return {"success": False, "message": f"failed to load {path}: {err}", "num_paused_requests": 0}
        return sp.UpdateWeightFromDiskReqOutput(success=True, message=f"loaded {path} as weight_version {self.label}").model_dump()

    @property
    def layout(self) -> dict:
        """:func:`~asyncrl.model.hf.param_layout` of the served model (traced once, on first use)."""
        if self._layout is None:
            from asyncrl.model.hf import param_layout

            self._layout = param_layout(self.model_cfg)
        return self._layout

    def base_params(self) -> dict:
        return self.base if self.base is not None else self.engine.served_params

    def load_and_install(self, path: Path, label: Optional[str]) -> None:
        """Install the weights of ``path`` as the next engine version, reading only the tensors
        whose published hash differs from the one this server holds (module docstring)."""
        from asyncrl.engine.publish import TENSOR_HASHES
        from asyncrl.model.hf import SAFETENSORS_INDEX, params_from_hf, read_safetensors, read_safetensors_index

        digests: dict[str, str] = {}
        names: list[str] = []
        index = path / SAFETENSORS_INDEX
        if index.is_file():
            raw = read_safetensors_index(index)
            names = list(raw["weight_map"])
            try:
                digests = dict(raw.get("metadata", {}).get(TENSOR_HASHES) or {})
            except (AttributeError, TypeError, ValueError) as err:
                raise ValueError(f"{index}: not a valid safetensors index ({err})") from None
        keep = self._kept_leaves(digests)
        tensors = read_safetensors(path, only=None if not keep else [n for n in names if n not in keep])
        params = params_from_hf(self.model_cfg, tensors, str(path), keep=keep)
        version = self.engine.version + 1
        self.labels[version] = label if label is not None else self.label
        # Nothing here may hold the old weights while the engine installs the new ones (it drops
        # its own copy first): one serving copy at the update's peak. A loaded adapter's base goes
        # too (adapters are of one base); kept tensors are shared by both versions.
        self.base, self.adapters, self.active_adapter = None, {}, None
        self.engine.update_weights(params, version)
        self.held_digests = digests
        self.load_figures = {"serve/tensors_read": float(len(tensors)), "serve/tensors_kept": float(len(keep)),
                             "serve/bytes_read": float(sum(int(t.nbytes) for t in tensors.values()))}

    def _kept_leaves(self, digests: dict[str, str]) -> dict[str, Any]:
        """The served base's tensors whose published hash is the one this server holds, by HF name
        (the only references to the old weights that outlive this call are these shared leaves)."""
        held = self.base_params()
        keep: dict[str, Any] = {}
        for keys, (hf_name, _, _) in self.layout.items():
            if hf_name in digests and self.held_digests.get(hf_name) == digests[hf_name]:
                leaf: Any = held
                for k in keys:
                    leaf = leaf[k]
                keep[hf_name] = leaf
        return keep

    # ------------------------------------------------------------------ LoRA adapters

    async def load_adapter(self, body: sp.LoadLoRAAdapterReqInput) -> dict:
        path = self.check_path(body.lora_path, "/load_lora_adapter")
        async with self.update_lock, self.paused_generation():
            try:
                await asyncio.to_thread(self.apply_adapter, body.lora_name, path)
            except (OSError, ValueError, AsyncRLError) as err:
                return sp.LoRAUpdateOutput(success=False, error_message=f"failed to load adapter {body.lora_name!r} from "
                                           f"{path}: {err}").model_dump(exclude_none=True)
        return sp.LoRAUpdateOutput(success=True, loaded_adapters=dict.fromkeys(self.adapters, "")).model_dump(exclude_none=True)

    def apply_adapter(self, name: str, path: Path) -> None:
        """Check the PEFT adapter at ``path`` against the model and serve ``base + adapter``."""
        from asyncrl.model.hf import read_safetensors_file
        from asyncrl.model.lora import PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE, adapters_from_peft, merge_lora

        if name in self.adapters:
            raise ValueError(f"lora_name {name!r} is already loaded (unload it first, or load under a new name)")
        config_file, weights_file = path / PEFT_CONFIG_FILE, path / PEFT_WEIGHTS_FILE
        for file in (config_file, weights_file):
            if not file.is_file():
                raise ValueError(f"{file} does not exist (a PEFT adapter directory holds {PEFT_CONFIG_FILE} and {PEFT_WEIGHTS_FILE})")
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{config_file}: not JSON ({err})") from None
        tensors = read_safetensors_file(weights_file)
        adapters, scale = adapters_from_peft(tensors, config, self.layout, weights_file.name)
        base = self.base_params()
        merged = merge_lora(base, adapters, scale)
        version = self.engine.version + 1
        self.labels[version] = self.label  # an adapter does not change the base's weight_version (as in SGLang)
        self.engine.update_weights(merged, version)
        self.base = base
        self.adapters[name] = version
        self.active_adapter = name
        self.load_figures = {"serve/tensors_read": float(len(tensors)), "serve/tensors_kept": 0.0,
                             "serve/bytes_read": float(sum(int(t.nbytes) for t in tensors.values()))}

    async def unload_adapter(self, body: sp.UnloadLoRAAdapterReqInput) -> dict:
        if body.lora_name not in self.adapters:
            raise HTTPError(400, f"/unload_lora_adapter: lora_name {body.lora_name!r} is not loaded "
                                 f"(loaded: {', '.join(self.adapters) or 'none'})")
        async with self.update_lock:
            if body.lora_name == self.active_adapter:  # back to the base weights, as SGLang serves requests without one
                async with self.paused_generation():
                    version = self.engine.version + 1
                    self.labels[version] = self.label
                    await asyncio.to_thread(self.engine.update_weights, self.base_params(), version)
                    self.base, self.active_adapter = None, None
            del self.adapters[body.lora_name]
        return sp.LoRAUpdateOutput(success=True, loaded_adapters=dict.fromkeys(self.adapters, "")).model_dump(exclude_none=True)

    def adapter_of(self, body: sp.GenerateReqInput) -> Optional[str]:
        """The one adapter a ``/generate`` body names (None: none); 400 for several or an unknown one."""
        names = body.lora_path if isinstance(body.lora_path, list) else [body.lora_path]
        if len(set(names)) > 1:
            raise HTTPError(400, f"/generate: lora_path names {sorted(set(map(str, names)))}: asyncrl serve applies one adapter "
                                 "at a time, so one request names one")
        name = names[0] if names else None
        if name is not None and name not in self.adapters:
            raise HTTPError(400, f"/generate: lora_path {name!r} is not a loaded adapter (loaded: "
                                 f"{', '.join(self.adapters) or 'none'}; POST /load_lora_adapter first)")
        return name


# --------------------------------------------------------------------------- the app
