"""The FastAPI app: built from an EngineClient, a tokenizer and the serving options."""

from __future__ import annotations

import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from dsv4serve import __version__
from dsv4serve.api import chat_routes, completion_routes
from dsv4serve.api.anthropic import routes as anthropic_routes
from dsv4serve.api.errors import APIError, bad_request, error_response, error_response_for, install_error_handlers
from dsv4serve.api.limits import BodyLimitMiddleware
from dsv4serve.api.metrics import Metrics
from dsv4serve.api.openapi import install_openapi
from dsv4serve.api.protocol import DetokenizeRequest, TokenizeRequest
from dsv4serve.api.responses import routes as responses_routes
from dsv4serve.api.sampling import check_model
from dsv4serve.api.state import AppState, ServeOptions, get_state, read_request
from dsv4serve.api.tokenizer import TextTokenizer
from dsv4serve.chat import ChatFormatError, render_prompt

PROTECTED_EXACT = ("/tokenize", "/detokenize")


class ApiKeyMiddleware:
    """The key on /v1/*, /tokenize and /detokenize, as `Authorization: Bearer K` or (Anthropic's SDK and
    Claude Code) `x-api-key: K` (pure ASGI: streams pass through untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._bearer = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _protected(scope["path"]):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        bearer_ok = secrets.compare_digest(headers.get(b"authorization", b""), self._bearer)
        if bearer_ok or secrets.compare_digest(headers.get(b"x-api-key", b""), self._key):
            return await self.app(scope, receive, send)
        response = error_response_for(
            scope["path"],
            401,
            "invalid or missing API key (Authorization: Bearer ... or x-api-key: ...)",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


def _protected(path: str) -> bool:
    return path.startswith("/v1/") or path == "/v1" or path in PROTECTED_EXACT


def _model_card(state: AppState) -> dict:
    ready = state.engine.ready_info
    return {
        "id": state.options.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "dsv4serve",
        "root": state.options.served_model_name,
        "parent": None,
        "max_model_len": ready.max_model_len if ready else None,
        "permission": [],
    }


def _add_info_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request):
        if get_state(request).engine.healthy:
            return {"status": "ok"}
        return error_response(503, "the model worker is not ready (loading or restarting)")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [_model_card(get_state(request))]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        state = get_state(request)
        check_model(model_id, state.options.served_model_name)
        return _model_card(state)


def _tokenize(state: AppState, req: TokenizeRequest) -> list[int]:
    """/tokenize's token ids (run on the text pool, off the event loop)."""
    if req.prompt is not None:
        add_special = req.add_special_tokens if req.add_special_tokens is not None else True
        return state.tokenizer.encode(req.prompt, add_special_tokens=add_special)
    assert req.messages is not None  # the route let through exactly one of prompt and messages
    kwargs = req.chat_template_kwargs or {}
    try:
        text = render_prompt(
            req.messages,
            req.tools,
            thinking=kwargs.get("thinking", state.options.default_thinking),
            reasoning_effort=kwargs.get("reasoning_effort"),
            add_generation_prompt=req.add_generation_prompt is not False,
        )
    except (ChatFormatError, TypeError, ValueError) as exc:
        raise bad_request(str(exc), "messages") from exc
    return state.tokenizer.encode(text)


def _add_token_routes(app: FastAPI) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request):
        state, req = await read_request(request, TokenizeRequest)
        check_model(req.model, state.options.served_model_name)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        tokens = await state.off_loop(_tokenize, state, req)
        ready = state.engine.ready_info
        return {
            "count": len(tokens),
            "max_model_len": ready.max_model_len if ready else None,
            "tokens": tokens,
            "token_strs": None,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request):
        state, req = await read_request(request, DetokenizeRequest)
        check_model(req.model, state.options.served_model_name)
        vocab = state.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def create_app(engine, tokenizer: TextTokenizer, options: ServeOptions) -> FastAPI:
    app = FastAPI(title="dsv4serve", version=__version__, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app)
    state = AppState(engine, tokenizer, options, Metrics(engine))
    state.created = int(time.time())
    app.state.dsv4 = state
    install_error_handlers(app)
    _add_info_routes(app)
    _add_token_routes(app)
    app.include_router(chat_routes.router)
    app.include_router(completion_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    if options.max_request_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, max_bytes=options.max_request_bytes)
    if options.api_key:  # added last: outermost, so a request without the key is refused before its body is read
        app.add_middleware(ApiKeyMiddleware, api_key=options.api_key)
    return app


__all__ = ["create_app", "ServeOptions", "APIError"]
