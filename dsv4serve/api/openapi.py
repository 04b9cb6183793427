"""/openapi.json with the request bodies described.

The routes read their JSON bodies themselves (so every malformed input becomes a 400 in the OpenAI
envelope, never FastAPI's 422); FastAPI therefore cannot see the body models. This adds them from
the same pydantic models the routes validate with, so clients and fuzzers see the real schema.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from dsv4serve.api.anthropic.protocol import MessagesRequest
from dsv4serve.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from dsv4serve.api.responses.protocol import ResponsesRequest

BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/v1/completions", "post"): CompletionRequest,
    ("/tokenize", "post"): TokenizeRequest,
    ("/detokenize", "post"): DetokenizeRequest,
    ("/v1/messages", "post"): MessagesRequest,
    ("/v1/messages/count_tokens", "post"): MessagesRequest,
    ("/v1/responses", "post"): ResponsesRequest,
}
REF = "#/components/schemas/{model}"


def build_openapi(app: FastAPI) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    models = sorted(set(BODIES.values()), key=lambda m: m.__name__)
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for (path, method), model in BODIES.items():
        operation = schema["paths"][path][method]
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        }
    return schema


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
