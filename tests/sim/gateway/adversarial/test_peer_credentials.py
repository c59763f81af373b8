"""Credentials an attacker bends, on both request paths: a prefill slot cannot be held without
the peer key even on a gateway whose clients need no key (a held slot delays every replica's
documents), and a request with two Authorization headers is refused whichever of them is right
(a check and an engine could each read a different one)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.sim.gateway.adversarial.conftest import behind_data_plane
from tests.support.outcomes import TALLY, Outcome, Verdict, judge_json
from tests.support.sim_gateway import LONG, PLAIN, Stack, pd_stack

HOLD = {"replicas": ["http://p0"]}
HANG = 10.0


def verdict_of(response: httpx.Response) -> Verdict:
    content_type = response.headers.get("content-type", "").split(";")[0]
    return judge_json(response.status_code, content_type, response.content, chat=True)


def assert_refused(response: httpx.Response, status: int, case: str) -> dict[str, Any]:
    verdict = verdict_of(response)
    TALLY.add(case, verdict)
    assert verdict.outcome is Outcome.CLEAR_ERROR, verdict
    assert verdict.status == status, verdict
    assert verdict.error is not None
    return dict(verdict.error)


async def test_no_prefill_slot_is_held_without_the_peer_key_even_with_no_api_keys(
    stack: Stack, request_path: str
) -> None:
    client = await pd_stack(stack, data_plane=behind_data_plane(request_path))
    for headers in ({}, {"Authorization": "Bearer anything"}):
        error = assert_refused(
            await client.post("/admission/hold", json=HOLD, headers=headers),
            401,
            f"peer hold without the peer key ({request_path})",
        )
        assert error["type"] == "AuthenticationError"
        assert "--peer-key-file" in error["message"]
    assert not stack.gateway_server.admission.in_flight
    # Documents are admitted at once: nothing holds their replica.
    began = time.monotonic()
    answer = await client.post("/v1/chat/completions", json=LONG, timeout=HANG)
    assert answer.status_code == 200, answer.text
    assert time.monotonic() - began < HANG


@pytest.mark.parametrize("keys", ["api keys set", "no keys"])
@pytest.mark.parametrize("order", ["right then wrong", "wrong then right"])
async def test_two_authorization_headers_are_refused(
    stack: Stack, request_path: str, keys: str, order: str
) -> None:
    settings: dict[str, Any] = {"api_keys": ("client-key",)} if keys == "api keys set" else {}
    client = await pd_stack(stack, data_plane=behind_data_plane(request_path), **settings)
    values = ["Bearer client-key", "Bearer wrong-key"]
    if order == "wrong then right":
        values.reverse()
    headers = [("Authorization", value) for value in values]
    for path, body in (("/v1/chat/completions", PLAIN), ("/v1/models", None)):
        request = client.build_request("POST" if body else "GET", path, json=body, headers=headers)
        error = assert_refused(
            await client.send(request), 400, f"two Authorization headers ({request_path})"
        )
        # The same words on both paths (the data plane answers a completion's itself).
        assert error["message"] == "the request has more than one Authorization header; send one"
        assert error["type"] == "BadRequestError"
