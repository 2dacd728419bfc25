"""``asyncrl serve``'s Starlette app (:mod:`asyncrl.serve`): SGLang's routes and the OpenAI-compatible
ones over one :class:`~asyncrl.serve.state.ServeState`, every route authorised and parsed against the
protocol models, errors as one line."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from typing import Any

from pydantic import ValidationError

from asyncrl.engine import sglang_protocol as sp
from asyncrl.errors import EngineRequestError
from asyncrl.serve.state import HTTPError, ServeState, validation_message


def build_app(state: ServeState) -> Any:
    """The Starlette app: every route authorised, parsed against the protocol models, errors as one line."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)

    def authorised(request: Request) -> bool:
        if state.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode())

    async def parse(request: Request, model: Any, what: str) -> Any:
        raw = await request.body()
        try:
            data = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as err:
            raise HTTPError(400, f"{what}: the body is not JSON ({err})") from None
        try:
            return model.model_validate(data)
        except ValidationError as err:
            raise HTTPError(400, validation_message(err, what)) from None

    def endpoint(handler: Any) -> Any:
        async def wrapped(request: Request) -> Response:
            if not authorised(request):
                return error(401, f"{request.url.path}: missing or wrong API key (send Authorization: Bearer KEY)")
            try:
                result = await handler(request)
            except HTTPError as err:
                return error(err.status, err.message)
            if isinstance(result, Response):
                return result
            status = 400 if isinstance(result, dict) and result.get("success") is False else 200
            return JSONResponse(result, status_code=status)

        return wrapped

    routes = [Route(path, endpoint(handler), methods=methods) for path, (handler, methods) in _handlers(state, parse).items()]

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        state.loop_objects()
        yield

    return Starlette(routes=routes, lifespan=lifespan)


def _handlers(state: ServeState, parse: Any) -> dict[str, tuple[Any, list[str]]]:
    """``path -> (handler(request), methods)`` of the SGLang API subset."""
    from starlette.requests import Request
    from starlette.responses import Response

    async def generate(request: Request) -> Any:
        return await state.generate(await parse(request, sp.GenerateReqInput, "/generate"))

    async def pause(request: Request) -> Any:
        body = await parse(request, sp.PauseGenerationReqInput, "/pause_generation")
        if body.mode != "abort":
            raise HTTPError(400, f"/pause_generation: mode {body.mode!r} is not supported by asyncrl serve (only 'abort': "
                                 "the JaxEngine cannot park requests); set engine.remote.pause_mode: abort")
        await state.pause()
        return {"success": True, "message": "paused"}

    async def resume(request: Request) -> Any:
        await parse(request, sp.ContinueGenerationReqInput, "/continue_generation")
        state.resume()
        return {"success": True, "message": "continued"}

    async def update(request: Request) -> Any:
        return await state.update(await parse(request, sp.UpdateWeightFromDiskReqInput, "/update_weights_from_disk"))

    async def load_lora(request: Request) -> Any:
        return await state.load_adapter(await parse(request, sp.LoadLoRAAdapterReqInput, "/load_lora_adapter"))

    async def unload_lora(request: Request) -> Any:
        return await state.unload_adapter(await parse(request, sp.UnloadLoRAAdapterReqInput, "/unload_lora_adapter"))

    async def abort(request: Request) -> Any:
        body = await parse(request, sp.AbortReq, "/abort_request")
        if not body.abort_all:
            raise HTTPError(400, "/abort_request: asyncrl serve aborts all requests only (send abort_all: true)")
        await asyncio.to_thread(state.engine.abort_all)
        return {"success": True}

    async def flush_cache(request: Request) -> Any:
        # Kept prefixes are forgotten before any request that arrives after this answer is admitted.
        state.engine.flush_prefixes()
        return Response("Cache flushed.", media_type="text/plain")

    async def health(request: Request) -> Any:
        if state.engine.crashed is not None:
            raise HTTPError(503, "/health: the engine's thread died")
        return Response(status_code=200)

    async def model_info(request: Request) -> Any:
        return sp.ModelInfo(model_path=state.model_path, tokenizer_path=state.model_path, is_generation=True,
                            weight_version=state.label).model_dump()

    async def server_info(request: Request) -> Any:
        return {"weight_version": state.label, "paused": state.paused, "lora_adapters": sorted(state.adapters),
                "active_lora_adapter": state.active_adapter, **state.load_figures, **state.engine.metrics()}

    async def openai_route(request: Request) -> Any:
        from starlette.responses import JSONResponse

        from asyncrl.agent.api import ApiError

        if state.openai is None:
            raise HTTPError(404, f"{request.url.path}: the model directory has no tokenizer, so asyncrl serve has no OpenAI routes")
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else None
            prepared = state.openai.prepare(request.method, request.url.path[len("/v1"):], body, None)
        except json.JSONDecodeError as err:
            raise HTTPError(400, f"{request.url.path}: the body is not JSON ({err})") from None
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        if prepared.request is None:
            return prepared.finish([])
        while state.paused:  # held while paused, like /generate
            await state.resumed.wait()
        try:
            responses = await asyncio.wrap_future(state.engine.submit(prepared.request))
        except EngineRequestError as err:
            raise HTTPError(400, f"{request.url.path}: {err}") from None
        return prepared.finish(responses)

    return {
        "/v1/chat/completions": (openai_route, ["POST"]),
        "/v1/completions": (openai_route, ["POST"]),
        "/v1/models": (openai_route, ["GET"]),
        "/generate": (generate, ["POST"]),
        "/pause_generation": (pause, ["POST"]),
        "/continue_generation": (resume, ["POST"]),
        "/update_weights_from_disk": (update, ["POST"]),
        "/load_lora_adapter": (load_lora, ["POST"]),
        "/unload_lora_adapter": (unload_lora, ["POST"]),
        "/abort_request": (abort, ["POST"]),
        "/flush_cache": (flush_cache, ["GET", "POST"]),
        "/health": (health, ["GET"]),
        "/get_model_info": (model_info, ["GET"]),
        "/get_server_info": (server_info, ["GET"]),
    }
