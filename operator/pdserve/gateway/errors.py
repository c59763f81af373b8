"""How a request fails: OpenAI-style errors for the client, retryable upstream failures, and
the one mapping of whatever a request raised to the error its client gets."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from pdserve.gateway.endpoints import NoEndpoints
from pdserve.wirejson import dumps, loads_trusted


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
            413: "RequestTooLarge",
            415: "UnsupportedMediaType",
            429: "RateLimitError",
            431: "RequestHeaderFieldsTooLarge",
            500: "InternalServerError",
            503: "ServiceUnavailableError",
            504: "TimeoutError",
        }.get(status, "APIError")


def too_large(limit: int) -> GatewayError:
    """A body over `--max-body-bytes` (declared, or as it arrived)."""
    return GatewayError(413, f"request body exceeds {limit} bytes", kind="RequestTooLarge")


def over_cap(field: str, cap: int) -> GatewayError:
    """A completion limit over `--max-tokens-cap`. Refusals both request paths answer before any
    engine call are worded here and in dataplane/refusals.go, held together by
    dataplane/testdata/refusals.json."""
    return GatewayError(400, f"{field} may be at most {cap}", param=field)


def gateway_owned_refused(param: str) -> GatewayError:
    """A client setting what only the gateway may send an engine (openai_schema.gateway_owned)."""
    return GatewayError(
        400,
        f"{param} is the gateway's to set (it hands KV between the engines itself): remove it "
        "from the request",
        param=param,
    )


def tokenizer_needed(param: str, task: str, instead: str) -> GatewayError:
    """A parameter the model's `--tokens-only` engines would refuse after a render (and maybe a
    prefill) was spent on it, in words about their own flags: said before, with what the client
    can do (openai_schema.needs_tokenizer gives the parameter, the task and the alternative)."""
    return GatewayError(
        400,
        f"{param} is not available on this model: its engines run --tokens-only "
        f"(spec.render.engineApi: TokensOnly), which cannot {task}; {instead}, or set "
        "spec.render.engineApi: ScaleOut",
        param=param,
    )


def stream_logprobs_refused(param: str) -> GatewayError:
    """A stream behind render servers that asks for log probabilities: a streamed choice is
    derendered from its token ids alone, so the engine's log probabilities would be dropped;
    refused rather than omitted."""
    return GatewayError(
        400,
        f"{param} is not available with stream: true on this model (its render servers "
        "derender streamed tokens without their log probabilities); send stream: false to get "
        "them",
        param=param,
    )


class UpstreamFailed(Exception):
    """A hop failed in a way another replica (or local prefill) may fix."""

    def __init__(
        self, stage: str, message: str, status: int | None = None, *, timed_out: bool = False
    ) -> None:
        super().__init__(message)
        self.stage, self.status, self.timed_out = stage, status, timed_out


class LeaseExpiring(UpstreamFailed):
    """Prefill's KV lease would run out before a decode sent now could pull it: decode
    prefills locally instead."""


def json_response(
    body: Any, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    """web.json_response with the wire codec (pdserve.wirejson)."""
    return web.Response(
        body=dumps(body), status=status, headers=headers, content_type="application/json"
    )


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(error: GatewayError) -> web.Response:
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    body = error_body(error.status, error.message, error.kind, error.param)
    return json_response(body, status=error.status, headers=headers)


def upstream_message(payload: bytes) -> str:
    """The error message inside an upstream error body (vLLM's or ours). Never the body's own
    bytes: an engine, or what stands in front of it, that answers an error with something else
    may be echoing another request's answer, and the client would read it."""
    try:
        body = loads_trusted(payload)
    except ValueError:
        return f"an error answer that is not JSON ({len(payload)} bytes)"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return str(body["message"])
    return "an error answer without a message"


def out_of_time(
    stage: str, url: str, error: BaseException, waited: float, connect_timeout: float
) -> str:
    """A call that ran out of time, named by what never came: the connection (within the
    connect timeout) or the answer (within `waited`, the call's own bound). Shared cases:
    dataplane/testdata/out_of_time.json."""
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return f"{stage} at {url}: could not connect within {connect_timeout:g} s"
    return f"{stage} at {url}: no answer within {waited:g} s"


def upstream_failure(error: BaseException) -> str:
    """What broke an upstream call, for the client: the failure's kind, and its reason where
    that is the gateway's own words. aiohttp's words for an answer it could not parse draw the
    peer's bytes under a caret: those stay in the log."""
    name = type(error).__name__
    if isinstance(error, aiohttp.ClientConnectorError):
        return f"{name}: {error.os_error.strerror or 'cannot connect'}"
    if isinstance(error, (aiohttp.ClientPayloadError, aiohttp.ClientResponseError)):
        return f"{name}: the answer's HTTP framing is malformed"
    return name


# Engine, render and peer addresses (URLs, IPs, "host <name>:<port>") in an upstream failure's
# text are the cluster's business, not the client's: the log line has them.
_ADDRESS = re.compile(
    r"\b[a-z][a-z0-9+.-]*://[^\s,;'\"()\[\]]+?(?=:?(?:\s|$)|[,;'\"()\[\]])"
    r"|(?<=host )[^\s,;'\"()\[\]]+"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"
)


def without_addresses(message: str) -> str:
    return _ADDRESS.sub("a replica", message)


def client_error(error: Exception, request_id: str | None = None) -> GatewayError:
    """What the client is told about a request that raised `error`: a GatewayError as it is
    (a 5xx without upstream addresses), no usable endpoints as 503, an upstream that failed
    as 502 (504: timed out), and
    anything unexpected as a 500 that gives nothing away (the caller logs the stack)."""
    if isinstance(error, GatewayError):
        if error.status < 500:
            return error
        message = without_addresses(error.message)
        return GatewayError(error.status, message, param=error.param, kind=error.kind)
    if isinstance(error, NoEndpoints):
        return GatewayError(503, str(error))
    if isinstance(error, UpstreamFailed):
        status = 504 if error.timed_out else 502
        return GatewayError(status, without_addresses(str(error)), kind="UpstreamError")
    if isinstance(error, TimeoutError):
        return GatewayError(504, "an upstream call timed out", kind="UpstreamError")
    if isinstance(error, aiohttp.ClientError):
        message = f"an upstream call failed ({type(error).__name__})"
        return GatewayError(502, message, kind="UpstreamError")
    where = f" (request id {request_id})" if request_id else ""
    return GatewayError(500, f"the gateway failed to serve the request{where}")


def framing_error(error: HttpProcessingError, line_limit: int) -> GatewayError:
    """What the client is told about a request aiohttp's HTTP parser refused (its head, or a
    body's chunked framing): a line over `line_limit` bytes as 431, anything else as 400 with
    the first line of aiohttp's reason, which names the fault (the rest draws the client's
    bytes under a caret)."""
    if isinstance(error, LineTooLong):
        return GatewayError(
            431,
            f"a request header (or the request line) is longer than {line_limit} bytes, the "
            "most the gateway reads; send shorter headers",
        )
    reason = (error.message.strip().splitlines() or ["malformed request"])[0].rstrip(": ")
    if "Content-Length" in reason and "Transfer-Encoding" in reason:
        # aiohttp's C parser and its Python one word this refusal differently.
        message = (
            "the request has both Content-Length and Transfer-Encoding headers; send one: "
            "Content-Length for a body of known size, or Transfer-Encoding: chunked"
        )
    else:
        message = f"the request is not valid HTTP/1.1: {reason[:200]}"
    return GatewayError(400, message)


def client_went_away(error: Exception) -> bool:
    """The client's connection reset (not an upstream's, which aiohttp's client errors are):
    there is no one left to answer."""
    return isinstance(error, ConnectionResetError) and not isinstance(error, aiohttp.ClientError)


def http_error_response(error: web.HTTPException) -> web.Response:
    """aiohttp's own 4xx/5xx (unknown path, wrong method...) in the OpenAI shape."""
    headers = {"Allow": error.headers["Allow"]} if "Allow" in error.headers else None
    kind = GatewayError(error.status, error.reason).kind
    body = error_body(error.status, error.reason, kind)
    return json_response(body, status=error.status, headers=headers)
