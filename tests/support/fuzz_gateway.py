"""The input fuzzers' gateway (hypothesis, deterministic): the whole gateway, tokens route and
P/D, on either request path, on a loopback fake upstream that answers any accepted request
well, and what holds for every answer whatever the input
(tests/sim/gateway/adversarial/test_fuzz_*.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hypothesis import HealthCheck, settings

from pdserve.gateway.app import Gateway
from pdserve.gateway.settings import GatewaySettings
from tests.support.gateway_fakes import config
from tests.support.loopback_upstream import LoopbackUpstream
from tests.support.outcomes import TALLY, Outcome, Verdict, exchange, judge_json
from tests.support.served_gateway import ServedGateway

CAP = 4096  # --max-tokens-cap
HANG = 10.0  # seconds: only a hang detector
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
FUZZ = settings(
    derandomize=True,  # the same examples every run
    database=None,  # nothing written into the repository
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# ---- the fake upstream: a well-formed answer for any accepted request ----------------------------


def _choices(n: Any) -> range:
    return range(min(n, 3) if isinstance(n, int) and n > 0 else 1)


def render(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "token_ids": [1, 2, 3, 4],
        "sampling_params": {"max_tokens": 8, "n": body.get("n") or 1},
        "stream": bool(body.get("stream")),
        "stream_options": body.get("stream_options"),
    }


def prefill(body: dict[str, Any]) -> dict[str, Any]:
    kv = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1]}
    return {"choices": [{"index": 0, "token_ids": [9], "finish_reason": "length"}],
            "kv_transfer_params": kv}  # fmt: skip


def decode(body: dict[str, Any]) -> dict[str, Any]:
    n = body["sampling_params"].get("n")
    return {
        "choices": [{"index": i, "token_ids": [9], "finish_reason": "stop"} for i in _choices(n)],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    }


def derender(body: dict[str, Any]) -> dict[str, Any]:
    chat = "chat_request" in body
    if body["stream"]:
        [choice] = body["generate_chunk"]["choices"]
        part: dict[str, Any] = {"delta": {"content": "x"}} if chat else {"text": "x"}
        return {"chunk": {"choices": [{"index": choice["index"], **part,
                                       "finish_reason": choice["finish_reason"]}]},
                "stream_state": None}  # fmt: skip
    whole: dict[str, Any] = {"message": {"role": "assistant", "content": "ok"}} if chat else {}
    choices = [
        {"index": c["index"], **(whole or {"text": "ok"}), "finish_reason": c["finish_reason"]}
        for answer in ([body["generate_response"]] if chat else body["generate_responses"])
        for c in answer["choices"]
    ]
    return {"object": "chat.completion" if chat else "text_completion", "choices": choices}


def decode_stream(body: dict[str, Any]) -> list[bytes]:
    n = body["sampling_params"].get("n")
    lines = []
    for i in _choices(n):
        for finish in (None, "stop"):
            event = {"choices": [{"index": i, "token_ids": [9], "finish_reason": finish}]}
            lines.append(f"data: {json.dumps(event)}\n".encode())
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    return [*lines, f"data: {json.dumps({'choices': [], 'usage': usage})}\n".encode(),
            b"data: [DONE]\n"]  # fmt: skip


class Served(ServedGateway):
    """The whole gateway (tokens route, P/D) on the loopback fake upstream, on `request_path`
    (served_gateway.REQUEST_PATHS)."""

    def __init__(self, request_path: str) -> None:
        upstream = LoopbackUpstream(
            {"render": render, "prefill": prefill, "decode": decode, "derender": derender},
            stream_lines=decode_stream,
        )

        def gateway(urls: Mapping[str, str]) -> Gateway:
            settings = GatewaySettings(
                load_scrape_seconds=None, max_tokens_cap=CAP, endpoint_wait_seconds=0
            )
            return Gateway(config("tokens", "Disaggregated", urls=urls), settings)

        super().__init__(gateway, upstream, request_path, auto_decompress=False)
        self.leaks = tuple(upstream.urls.values())

    def post(
        self, path: str, data: bytes, headers: dict[str, str], method: str = "POST"
    ) -> Verdict:
        self.upstream.calls.clear()
        url = self.url(path)

        async def send() -> Verdict:
            if method == "POST":
                return await exchange(
                    self.session, url, data, headers, chat=path == CHAT, deadline=HANG,
                    leaks=self.leaks,
                )  # fmt: skip
            async with self.session.request(method, url, data=data, headers=headers) as answer:
                payload = await answer.read()
                return judge_json(
                    answer.status,
                    answer.content_type,
                    payload,
                    chat=True,
                    leaks=self.leaks,
                    sent=data,
                )

        return self.run(send())


def check(served: Served, case_class: str, verdict: Verdict) -> Verdict:
    """What holds for every request, whatever its input: a clear answer, no 5xx, and a body
    refused before any upstream call (an answered one went upstream). Tallied per request
    path."""
    TALLY.add(f"fuzz: {case_class} ({served.path})", verdict)
    assert verdict.acceptable, verdict
    assert verdict.status is not None
    assert verdict.status < 500, verdict
    if verdict.outcome is Outcome.CLEAR_ERROR:
        assert 400 <= verdict.status < 500, verdict
        assert served.upstream.calls == [], verdict  # refused before render or any engine
    else:
        assert served.upstream.stages()[:1] == ["render"], verdict
    return verdict
