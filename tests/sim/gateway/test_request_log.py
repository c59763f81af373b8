"""`--request-log` on both request paths: the data plane writes the entries of the requests it
serves itself (none is handed to the Python gateway for being logged), in the Python gateway's
format and with its values, into the same file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.gateway.dataplane import SOURCE
from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import MODEL, Stack, engine, ep, routing, sse_events, until

KEYS = json.loads((SOURCE / "testdata/request_log_keys.json").read_text())["keys"]
ASKED = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "tell me a story"}],
    "max_tokens": 8,
    "ignore_eos": True,  # the simulated engine answers with exactly 8 tokens
}


def entries(log: Path) -> list[dict[str, Any]]:
    text = log.read_text() if log.exists() else ""
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
@pytest.mark.parametrize("api", ["tokens", "openai"], ids=["render-pd", "openai-pd"])
async def test_each_request_is_logged_with_the_same_values_on_both_paths(
    stack: Stack, tmp_path: Path, request_path: str, api: str
) -> None:
    urls = {
        "prefill": await stack.engine("prefill", engine("prefill", api=api)),
        "decode": await stack.engine("decode", engine("decode", api=api)),
    }
    if api == "tokens":
        urls["render"] = await stack.render()
    config = routing(
        api, render=api == "tokens", endpoints={role: [ep(url)] for role, url in urls.items()}
    )
    log = tmp_path / "requests.jsonl"
    client = await stack.gateway(config, data_plane=request_path == "dataplane", request_log=log)
    answer = await client.post(
        "/v1/chat/completions", json=ASKED, headers={"X-Request-Id": "mine-1"}
    )
    assert answer.status_code == 200, answer.text
    events = await sse_events(client, ASKED)
    refused = await client.post("/v1/chat/completions", json={**ASKED, "model": "nope"})
    assert refused.status_code == 404  # refused before any engine: not logged, as before
    await until(lambda: len(entries(log)) == 2)
    whole, streamed = entries(log)
    assert list(whole) == list(streamed) == KEYS
    usage = answer.json()["usage"]
    render = urls.get("render")
    assert whole | {"sent_at_ms": 0, "first_token_at_ms": 0, "finished_at_ms": 0} == {
        "request_id": answer.headers["X-PDServe-Request-Id"],
        "client_request_id": "mine-1",
        "class": "chat",
        "route": "render_pd" if render else "openai_pd",
        "prompt_tokens": usage["prompt_tokens"],
        "requested_output_tokens": 8,
        "sent_at_ms": 0, "first_token_at_ms": 0, "finished_at_ms": 0,
        "output_tokens": 8,
        "inter_token_ms_p95": None,
        "render_engine": render,
        "prefill_engine": urls["prefill"],
        "decode_engine": urls["decode"],
        "parity_hash": "p1",
        "auto_reason": None,
    }  # fmt: skip
    assert whole["sent_at_ms"] <= whole["first_token_at_ms"] == whole["finished_at_ms"]
    # A stream: behind render servers its prompt and answer are counted in token ids; the
    # OpenAI route passes the engine's events on uncounted.
    counted = usage["prompt_tokens"] if render else None
    assert (streamed["prompt_tokens"], streamed["output_tokens"]) == (
        counted,
        8 if render else None,
    )
    assert streamed["client_request_id"] is None
    assert streamed["decode_engine"] == urls["decode"]
    assert streamed["sent_at_ms"] <= streamed["first_token_at_ms"] <= streamed["finished_at_ms"]
    assert events[-1] == "[DONE]"
    if request_path == "dataplane":
        stats = await stack.data_plane_stats()
        assert stats["fallbacks"] == {}  # the data plane served and logged them
