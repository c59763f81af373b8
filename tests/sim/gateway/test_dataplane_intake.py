"""What the data plane cannot prove valid with its cheap checks, or read as the engines would,
is put to the Python gateway's intake, and then served or refused by the data plane itself:
nothing is handed over. The answers are the ones the Python gateway gives on its own path."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import pytest

from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import MODEL, Stack, engine, ep, routing

BASE = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
UNPROVEN = {
    # Valid, but past the data plane's cheap checks: a named tool choice, a logit bias.
    "named tool_choice": {
        **BASE,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    },
    "logit_bias": {**BASE, "logit_bias": {"11": 2}},
}


async def openai_pd(stack: Stack, request_path: str, **settings: Any) -> httpx.AsyncClient:
    urls = {
        role: await stack.engine(role, engine(role, api="openai")) for role in ("prefill", "decode")
    }
    config = routing("openai", render=False, endpoints={r: [ep(u)] for r, u in urls.items()})
    return await stack.gateway(config, data_plane=request_path == "dataplane", **settings)


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_unproven_bodies_are_served_and_refused_as_the_python_gateway_would(
    stack: Stack, request_path: str
) -> None:
    client = await openai_pd(stack, request_path, max_tokens_cap=16)
    answers = {}
    for name, body in UNPROVEN.items():
        answers[name] = await client.post("/v1/chat/completions", json=body)
    # A member given twice (the last one counts, as the engines read it).
    twice = json.dumps(BASE)[:-1] + ', "max_tokens": 5}'
    answers["twice"] = await client.post(
        "/v1/chat/completions", content=twice, headers={"Content-Type": "application/json"}
    )
    # No model: the served one is meant.
    answers["no model"] = await client.post(
        "/v1/chat/completions", json={k: v for k, v in BASE.items() if k != "model"}
    )
    answers["gzip"] = await client.post(
        "/v1/chat/completions",
        content=gzip.compress(json.dumps(BASE).encode()),
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    for name, answer in answers.items():
        assert answer.status_code == 200, (name, answer.text)
    assert answers["twice"].json()["usage"]["completion_tokens"] <= 5
    # Refused in the intake's words: a parameter out of range, a limit over the cap.
    refused = await client.post("/v1/chat/completions", json={**BASE, "temperature": -1})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "temperature"
    over = await client.post(
        "/v1/chat/completions", json={**BASE, "max_tokens": 99, "logit_bias": {"1": 1}}
    )
    assert over.status_code == 400
    assert over.json()["error"]["param"] == "max_tokens"
    # The intake is the data plane's alone: a client asking for it finds no such path.
    probed = await client.post("/_pdserve/dataplane/intake/v1/chat/completions", json=BASE)
    assert probed.status_code == 404
    if request_path == "dataplane":
        stats = await stack.data_plane_stats()
        assert stats["fallbacks"] == {}, stats
        assert stats["intake"] == 7
        assert stats["routes"]["pd"] == 5
