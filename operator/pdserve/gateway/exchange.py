"""One client request on its way through the pools: what it asked, where it ran, its timings.
Routes fill it in; the app logs it when it finishes."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from pdserve.gateway.affinity import conversation_of
from pdserve.gateway.endpoints import Endpoint, Selection
from pdserve.gateway.request_log import p95
from pdserve.wirejson import dumps

if TYPE_CHECKING:
    from pdserve.gateway.streaming import ClientWriter

REQUEST_ID = web.RequestKey("pdserve_request_id", str)
"""The gateway's own id of a request (what the engines are told), once it has one."""
CLIENT_ID_LIMIT = 256


def gateway_request_id(request: web.Request) -> str:
    """The gateway's own id of `request` (given on first use): unique, whatever the client
    sends, so one client's id never names another's work on the engines."""
    if (own := request.get(REQUEST_ID)) is None:
        own = request[REQUEST_ID] = f"pdserve-{os.urandom(16).hex()}"
    return own


def client_request_id(request: web.Request) -> str | None:
    """The client's `X-Request-Id`, for the log and the response header: printable ASCII of at
    most 256 characters, else none (it is never an engine's request id: clients' ids collide)."""
    value = request.headers.get("X-Request-Id")
    if value and len(value) <= CLIENT_ID_LIMIT and value.isascii() and value.isprintable():
        return value
    return None


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every response names the request: the client's `X-Request-Id` back, and the gateway's
    own id (the request log's `request_id`) as `X-PDServe-Request-Id`."""
    if (client := client_request_id(request)) is not None:
        response.headers["X-Request-Id"] = client
    if (own := request.get(REQUEST_ID)) is not None:
        response.headers["X-PDServe-Request-Id"] = own


@dataclass
class Exchange:
    request: web.Request
    body: dict[str, Any]
    chat: bool
    request_id: str
    """The gateway's own, unique per request: what the engines' work (and aborts) go by."""
    selection: Selection
    pd: bool  # the request goes through a prefill replica (Auto mode may still change it)
    started: float
    tokens_api: bool
    headers: dict[str, str]
    """What every upstream call carries (the request id, maybe the client's credentials)."""
    first_token_at: float | None = None
    last_chunk_at: float | None = None
    gaps: list[float] = field(default_factory=list)
    prefill_done_at: float | None = None
    prefilled_on: Endpoint | None = None
    decoded_on: Endpoint | None = None  # the decode replica that answered
    decode_pulled_kv: bool = False
    """The decode request that answered carried prefill's kv_transfer_params (P/D, not a local
    prefill): with bidirectional KV, decode holds its blocks once it finishes (held_kv.py)."""
    held_tokens: list[int] = field(default_factory=list)
    """Per choice that decode finished stopped or length-capped: its prompt + answer tokens,
    what decode then holds when it pulled the KV."""
    local_anywhere: bool = False  # Auto found the P/D path unusable (see policy.Decision)
    auto_reason: str | None = None
    served_by: dict[str, str] = field(default_factory=dict)
    """Stage (prefill, decode) -> the engine that ran it (pod name or URL), for the log."""
    sent_at_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    writer: ClientWriter | None = None
    """The client's stream once its response started: a failure then ends it with an error
    event and [DONE] (app.py)."""
    stream_error: int | None = None
    """The status of the error event a stream ended with (the request failed after its 200)."""
    client_request_id: str | None = None
    """The client's `X-Request-Id`, for the log only."""
    _prompt_estimate: int | None = field(default=None, repr=False)
    block_hashes: tuple[list[int], list[bytes]] | None = field(default=None, repr=False)
    """The token ids placement hashed last, and their block hashes (placement.py)."""

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def conversation(self) -> str | None:
        return conversation_of(
            self.body.get("conversation_id"), self.request.headers.get("X-Conversation-Id")
        )

    @property
    def route(self) -> str:
        if self.tokens_api:
            return "render_pd" if self.pd else "render"
        return "openai_pd" if self.pd else "aggregated"

    def estimated_prompt_tokens(self) -> int:
        """Without a render pool there are no token ids: ~4 characters a token. Encoded once
        per request: a stream asks for it on every event."""
        if self._prompt_estimate is None:
            prompt = self.body.get("messages") or self.body.get("prompt") or ""
            self._prompt_estimate = len(dumps(prompt)) // 4
        return self._prompt_estimate

    def log_entry(self) -> dict[str, Any]:
        """The request log's JSON Lines entry (the chunked-prefill article's fields)."""
        now = time.monotonic()

        def wall_ms(moment: float | None) -> int | None:
            return None if moment is None else self.sent_at_ms + int((moment - self.started) * 1000)

        gap_p95 = p95(self.gaps)
        return {
            "request_id": self.request_id,
            "client_request_id": self.client_request_id,
            "class": self.request.headers.get(
                "X-PDServe-Class", "chat" if self.chat else "completion"
            ),
            "route": self.route,
            "prompt_tokens": self.prompt_tokens,
            "requested_output_tokens": self.body.get(
                "max_completion_tokens", self.body.get("max_tokens")
            ),
            "sent_at_ms": self.sent_at_ms,
            "first_token_at_ms": wall_ms(self.first_token_at or now),
            "finished_at_ms": wall_ms(now),
            "output_tokens": self.output_tokens,
            "inter_token_ms_p95": None if gap_p95 is None else round(gap_p95 * 1000, 2),
            "render_engine": self.served_by.get("render"),
            "prefill_engine": self.served_by.get("prefill"),
            "decode_engine": self.served_by.get("decode"),
            "parity_hash": self.selection.parity_hash,
            "auto_reason": self.auto_reason,
        }
