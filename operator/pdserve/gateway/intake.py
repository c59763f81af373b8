"""Request intake: the API key, the body's size, arrival time and shape, the headers passed
upstream."""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from aiohttp import web

from pdserve.gateway.errors import GatewayError
from pdserve.gateway.openai_schema import InvalidRequest, validate_request
from pdserve.gateway.settings import GatewaySettings


class Intake:
    def __init__(self, model: str, settings: GatewaySettings) -> None:
        self.model, self.settings = model, settings

    def authorize(self, request: web.Request) -> None:
        keys = self.settings.api_keys
        if not keys:
            return
        header = request.headers.get("Authorization", "")
        token = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        # Compare against every key so the time taken says nothing about which one is close.
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(token.encode(), key.encode())
        if not matched:
            raise GatewayError(401, "missing or invalid API key: send Authorization: Bearer <key>")

    async def receive(self, request: web.Request) -> None:
        """Receive the whole body (aiohttp keeps it for read_body) within the body timeout and
        the size cap, before the request takes an in-flight slot: a client that sends its body
        slowly holds no slot, and gets 408."""
        timeout = self.settings.body_timeout
        try:
            async with asyncio.timeout(timeout):
                await request.read()
        except TimeoutError:
            raise GatewayError(
                408, f"the request body did not arrive within {timeout:g} s", kind="RequestTimeout"
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(
                413,
                f"request body exceeds {self.settings.max_body_bytes} bytes",
                kind="RequestTooLarge",
            ) from None
        except web.RequestPayloadError:
            # aiohttp could not decode it (a gzip or deflate body that is not): the client's
            # mistake, not the gateway's failure.
            encoding = request.headers.get("Content-Encoding", "none")
            message = f"request body could not be read as sent (Content-Encoding: {encoding})"
            raise GatewayError(400, message) from None

    async def read_body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except json.JSONDecodeError as error:
            raise GatewayError(400, f"request body is not valid JSON: {error}") from None
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(
                413,
                f"request body exceeds {self.settings.max_body_bytes} bytes",
                kind="RequestTooLarge",
            ) from None
        except UnicodeDecodeError as error:
            message = f"request body is not valid {error.encoding}: {error.reason}"
            raise GatewayError(400, message) from None
        except LookupError:
            message = f"request body's charset {request.charset!r} is unknown; send UTF-8"
            raise GatewayError(400, message) from None
        except RecursionError:
            raise GatewayError(400, "request body is nested too deeply") from None
        except ValueError:  # Python's limit on an integer's digits (4300)
            raise GatewayError(400, "request body has a number too long to read") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "request body must be a JSON object")
        return body

    def check_body(self, body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
        """The body read, checked against the served model, the OpenAI schema and the
        max-tokens cap; the same dict goes upstream (the cap's default filled in)."""
        model = body.get("model")
        if model is not None and model != self.model:
            raise GatewayError(404, f"The model `{model}` does not exist.", param="model")
        body["model"] = self.model
        try:
            validate_request(body, chat=chat)
        except InvalidRequest as error:
            raise GatewayError(400, error.message, param=error.param) from None
        cap = self.settings.max_tokens_cap
        if cap is not None:
            for field in ("max_tokens", "max_completion_tokens"):
                if (body.get(field) or 0) > cap:
                    raise GatewayError(400, f"{field} may be at most {cap}", param=field)
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                body["max_tokens"] = cap
        return body

    def upstream_headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        """The request id, and the client's own credentials when the gateway checks none."""
        headers = {"X-Request-Id": request_id}
        if "Authorization" in request.headers and not self.settings.api_keys:
            headers["Authorization"] = request.headers["Authorization"]
        return headers
