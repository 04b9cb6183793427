"""--max-request-bytes, enforced while the body streams in (pure ASGI, before anything is buffered).

A body whose Content-Length is over the limit is refused before a byte of it is read; a body without
one (chunked) is counted as it arrives and refused the moment it passes the limit, so a client can
never make the server hold, parse or tokenize more than the limit. The 413 comes in the envelope of
the API the path belongs to (Anthropic's under /v1/messages, OpenAI's elsewhere).
"""

from __future__ import annotations

from dsv4serve.api.errors import APIError, error_response_for

STATUS = 413


def too_large(limit_bytes: int, declared_bytes: int | None = None) -> str:
    size = f"has {declared_bytes} bytes" if declared_bytes is not None else f"passed {limit_bytes} bytes"
    return f"the request body {size}; this server accepts at most {limit_bytes} (--max-request-bytes)"


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response_for(scope["path"], STATUS, too_large(self.max_bytes, int(declared)))
            return await response(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # raised inside request.body(): the APIError handler answers
                    raise APIError(STATUS, too_large(self.max_bytes))
            return message

        await self.app(scope, counted, send)
