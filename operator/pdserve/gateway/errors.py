"""How a request fails: OpenAI-style errors for the client, retryable upstream failures."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class GatewayError(Exception):
    """Ends the request with an OpenAI-style error."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {
            400: "BadRequestError",
            401: "AuthenticationError",
            404: "NotFoundError",
            429: "RateLimitError",
            503: "ServiceUnavailableError",
        }.get(status, "APIError")


class UpstreamFailed(Exception):
    """A hop failed in a way another replica (or local prefill) may fix."""

    def __init__(self, stage: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.stage, self.status = stage, status


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(error: GatewayError) -> web.Response:
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    body = error_body(error.status, error.message, error.kind, error.param)
    return web.json_response(body, status=error.status, headers=headers)


def upstream_message(payload: bytes) -> str:
    """The error message inside an upstream error body (vLLM's or ours), else the raw text."""
    text = payload.decode(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return text[:500]
