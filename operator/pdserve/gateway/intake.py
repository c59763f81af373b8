"""Request intake: the API key (and the peers' key), the body's size, arrival time, encoding
(content_encoding.py) and shape (and whether the engines can serve it), the headers passed
upstream.

Who may call what, when keys are set (`authorize`, run by `middleware` before every handler):
`/health` and `/ready` (probes) and `/metrics` (Prometheus, as vLLM's own: counts and latencies
by route, stage, reason and pod name, never a request's content or an address) are open;
`/v1/*`, and any path not named here, needs an API key; `/status` and `GET /admission` take an
API key or the peer key (the gateway replicas). `POST /admission/hold` holds a prefill slot for a
peer, so it takes the peer key (or an API key) whether or not clients need a key: with neither
configured nobody may call it. Without API keys `/status` and `GET /admission` stay open, peer
key or not: they only read. A request with more than one Authorization header is refused:
which one a check reads and which one an engine would read is anyone's guess."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.gateway.content_encoding import decoded
from pdserve.gateway.errors import (
    GatewayError,
    error_response,
    gateway_owned_refused,
    over_cap,
    tokenizer_needed,
    too_large,
)
from pdserve.gateway.exchange import gateway_request_id
from pdserve.gateway.openai_schema import (
    InvalidRequest,
    gateway_owned,
    needs_tokenizer,
    validate_request,
)
from pdserve.gateway.server import body_will_not_come
from pdserve.gateway.settings import GatewaySettings
from pdserve.wirejson import JSONDecodeError, loads

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Probes and the metrics scrape: they must work without a key (the kubelet, Prometheus, the
operator's transport monitor), and say nothing a key protects."""
PEER_PATHS = frozenset({"/status", "/admission", "/admission/hold"})
"""Operational and peer endpoints: an API key or the peer key."""
HOLD_PATH = "/admission/hold"
"""The peer endpoint that takes something (a prefill slot): never open."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _digest(secret: bytes) -> bytes:
    # Compared as fixed-length digests: the time taken says nothing about a key's length.
    return hashlib.sha256(secret).digest()


def bearer_token(request: web.Request) -> bytes | None:
    """The Authorization header's Bearer token as sent (bytes: a header that is not UTF-8
    still compares, and never matches), None without one."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    # aiohttp decodes header bytes with surrogateescape: this gives the original bytes back.
    return token.strip().encode("utf-8", "surrogateescape")


def framing_fault(request: web.Request) -> str | None:
    """What aiohttp's parser lets through that the data plane refuses (dataplane/framing.go, in
    the same words): a version that is not HTTP/1.0 or 1.1 (answered as if it were), a
    Transfer-Encoding other than chunked (`gzip, chunked` read as chunked, the gzip ignored),
    and chunked framing in HTTP/1.0, which has none."""
    if request.version not in (aiohttp.HttpVersion10, aiohttp.HttpVersion11):
        return "Invalid HTTP version: send HTTP/1.1"
    coding = request.headers.get("Transfer-Encoding")
    if coding is None:
        return None
    if request.version != aiohttp.HttpVersion11:
        return "Transfer-Encoding in an HTTP/1.0 request; send Content-Length"
    if coding.strip().lower() != "chunked":
        return "Request has invalid `Transfer-Encoding`"
    return None


class Intake:
    def __init__(
        self,
        model: str,
        settings: GatewaySettings,
        *,
        tokens_only_engines: bool = False,
        adapters: Iterable[str] = (),
    ) -> None:
        """`tokens_only_engines`: the model's engines run --tokens-only (GatewayConfig), so
        requests that need a tokenizer on the engine are refused before any work is spent.
        `adapters`: the LoRA adapters a request may name in `model` instead of the model."""
        self.model, self.settings = model, settings
        self.adapters = frozenset(adapters)
        self.tokens_only_engines = tokens_only_engines
        self._api = [_digest(k.encode()) for k in settings.api_keys]
        self._peer = [_digest(k.encode()) for k in settings.peer_keys]

    def authorize(self, request: web.Request, *, peer: bool = False, hold: bool = False) -> None:
        """401 unless the request carries a key it may use: an API key, or with `peer` (the
        operational and admission endpoints) also the peer key. Only a `hold` (a peer's prefill
        slot) is guarded when no API key is configured: by the peer key, and refused without
        one."""
        if len(request.headers.getall("Authorization", ())) > 1:
            raise GatewayError(400, "the request has more than one Authorization header; send one")
        if not (self._api or hold):
            return
        keys = [*self._api, *self._peer] if peer else self._api
        if not keys:
            raise GatewayError(
                401,
                "POST /admission/hold is for this gateway's replicas, which send "
                "Authorization: Bearer <peer key>, and this gateway has no peer key: give "
                "every replica the same --peer-key-file (or PDSERVE_PEER_KEY)",
            )
        token = bearer_token(request)
        digest = _digest(token or b"")
        # Compare against every key so the time taken says nothing about which one is close.
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(digest, key)
        if token is None or not matched:
            raise GatewayError(401, "missing or invalid API key: send Authorization: Bearer <key>")

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every route but the probes behind the keys, before its handler runs (so an
        unauthorized request learns nothing, not even whether the gateway is full)."""
        gateway_request_id(request)  # named from the start: logs, errors, the response header
        if (fault := framing_fault(request)) is not None:
            refused = error_response(
                GatewayError(400, f"the request is not valid HTTP/1.1: {fault}")
            )
            refused.force_close()  # where its body ends is anyone's guess, so is what follows
            return refused
        path = request.path
        if path not in OPEN_PATHS:
            try:
                self.authorize(request, peer=path in PEER_PATHS, hold=path == HOLD_PATH)
            except GatewayError as error:
                return error_response(error)
        return await handler(request)

    async def expect_continue(self, request: web.Request) -> web.StreamResponse | None:
        """aiohttp's handling of `Expect`, decided before the client sends its body: 100
        Continue for `100-continue` only when the body would be read; else the 401 (a key
        missing) or 413 (a declared length over the cap) the request would get after it, so the
        client never sends it, and any other value a 417. In the OpenAI shape: aiohttp's own
        refusals are text/plain, and come before middlewares."""
        expect = request.headers.get("Expect", "")
        if request.version != aiohttp.HttpVersion11 and expect.lower() == "100-continue":
            return None  # HTTP/1.0 has no interim answers: the body comes anyway (RFC 9110)
        try:
            if expect.lower() != "100-continue":
                message = f"unknown Expect: {expect}; only 100-continue is understood"
                raise GatewayError(417, message, kind="ExpectationFailed")
            if request.path not in OPEN_PATHS:
                path = request.path
                self.authorize(request, peer=path in PEER_PATHS, hold=path == HOLD_PATH)
            if (request.content_length or 0) > self.settings.max_body_bytes:
                raise self._too_large()
        except GatewayError as error:
            refused = error_response(error)
            # The body may follow anyway, and cannot be told apart from a next request.
            refused.force_close()
            body_will_not_come(request)
            return refused
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started
        return None

    async def receive(self, request: web.Request) -> bytes:
        """The whole body, received within the body timeout and the size cap before the request
        takes an in-flight slot (a client that sends its body slowly holds no slot, and gets
        408), its Content-Encoding undone."""
        timeout = self.settings.body_timeout
        try:
            async with asyncio.timeout(timeout):
                data = await request.read()
        except TimeoutError:
            raise GatewayError(
                408, f"the request body did not arrive within {timeout:g} s", kind="RequestTimeout"
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large() from None
        except web.RequestPayloadError:
            # Its chunked framing broke after the handler started (before, the HTTP parser
            # refuses it: server.py): the client's mistake, not the gateway's failure.
            message = (
                "request body could not be read as sent: its chunked framing "
                "(Transfer-Encoding: chunked) is broken"
            )
            raise GatewayError(400, message) from None
        encoding = request.headers.get("Content-Encoding", "")
        return decoded(data, encoding, self.settings.max_body_bytes)

    def _too_large(self) -> GatewayError:
        return too_large(self.settings.max_body_bytes)

    def read_body(self, request: web.Request, data: bytes) -> dict[str, Any]:
        """`data`, the body receive() returned, as the JSON object a completion request is."""
        try:
            body = loads(data.decode(request.charset or "utf-8"))
        except JSONDecodeError as error:
            raise GatewayError(400, f"request body is not valid JSON: {error}") from None
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
        """The body read, checked against the served model, the OpenAI schema, what the
        engines can serve and the max-tokens cap; the same dict goes upstream (the cap's
        default filled in)."""
        model = body.get("model")
        if model is None:
            body["model"] = self.model
        elif model != self.model and not (isinstance(model, str) and model in self.adapters):
            raise GatewayError(404, f"The model `{model}` does not exist.", param="model")
        try:
            request = validate_request(body, chat=chat)
        except InvalidRequest as error:
            raise GatewayError(400, error.message, param=error.param) from None
        if (owned := gateway_owned(body)) is not None:
            raise gateway_owned_refused(owned)
        if self.tokens_only_engines and (needed := needs_tokenizer(request)) is not None:
            raise tokenizer_needed(needed.param, needed.task, needed.instead)
        cap = self.settings.max_tokens_cap
        if cap is not None:
            # Only the fields this route's schema reads (validated: positive integers); another
            # one, e.g. max_completion_tokens on /v1/completions, is ignored by vLLM, so it
            # neither counts against the cap nor stands in for max_tokens.
            limits = {
                field: getattr(request, field)
                for field in ("max_tokens", "max_completion_tokens")
                if field in type(request).model_fields
            }
            for field, value in limits.items():
                if (value or 0) > cap:
                    raise over_cap(field, cap)
            if all(value is None for value in limits.values()):
                body["max_tokens"] = cap
        return body

    def upstream_headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        """The request id, and the client's own credentials when the gateway checks none."""
        headers = {"X-Request-Id": request_id}
        if "Authorization" in request.headers and not self.settings.api_keys:
            headers["Authorization"] = request.headers["Authorization"]
        return headers
