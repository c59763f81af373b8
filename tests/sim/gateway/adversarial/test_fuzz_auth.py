"""Fuzzing who may call what (hypothesis, deterministic), with an API key and a peer key set:
random Authorization headers (schemes, near-miss keys, whitespace, undecodable bytes) on every
endpoint, against the whole gateway on the loopback fake upstream, on both request paths.

Only the exact key the endpoint takes opens it; anything else is an OpenAI-shaped JSON 401 that
reaches no upstream; never a 5xx. The probes and /metrics are open whatever is sent."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.gateway.app import Gateway
from pdserve.gateway.settings import GatewaySettings
from tests.support.gateway_fakes import MODEL, config
from tests.support.loopback_upstream import LoopbackUpstream
from tests.support.outcomes import TALLY, Outcome, Verdict
from tests.support.served_gateway import REQUEST_PATHS, ServedGateway

API_KEY, PEER_KEY = "client-key-0123", "peer-key-4567"
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# path -> (method, the keys that open it; None: open to anyone)
ENDPOINTS: dict[str, tuple[str, frozenset[str] | None]] = {
    "/health": ("GET", None),
    "/ready": ("GET", None),
    "/metrics": ("GET", None),
    "/v1/models": ("GET", frozenset({API_KEY})),
    "/v1/chat/completions": ("POST", frozenset({API_KEY})),
    "/status": ("GET", frozenset({API_KEY, PEER_KEY})),
    "/admission": ("GET", frozenset({API_KEY, PEER_KEY})),
}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Served(ServedGateway):
    """The whole gateway with both keys set, on `request_path`, on the loopback fake upstream."""

    def __init__(self, request_path: str) -> None:
        answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                               "finish_reason": "stop"}]}  # fmt: skip

        def gateway(urls: Mapping[str, str]) -> Gateway:
            settings = GatewaySettings(
                load_scrape_seconds=None, endpoint_wait_seconds=0,
                api_keys=(API_KEY,), peer_keys=(PEER_KEY,),
            )  # fmt: skip
            return Gateway(config("openai", "Aggregated", urls=urls), settings)

        super().__init__(gateway, LoopbackUpstream({"decode": lambda _: answer}), request_path)

    def call(self, path: str, authorization: bytes | None) -> tuple[int, str, bytes]:
        self.upstream.calls.clear()
        method, _ = ENDPOINTS[path]
        # Raw header bytes: aiohttp would refuse to send some of them as str.
        headers = (
            {} if authorization is None else {"Authorization": authorization.decode("latin-1")}
        )

        async def send() -> tuple[int, str, bytes]:
            body = json.dumps(CHAT).encode() if method == "POST" else None
            async with self.session.request(
                method, self.url(path), data=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=10),
            ) as answer:  # fmt: skip
                return answer.status, answer.content_type, await answer.read()

        return self.run(send())


@pytest.fixture(scope="module", params=REQUEST_PATHS)
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    served = Served(str(request.param))
    try:
        yield served
    finally:
        served.close()


def near_misses(key: str) -> st.SearchStrategy[str]:
    return st.sampled_from([key[:-1], key + "x", key.upper(), f" {key} x", key[1:], ""])


tokens = st.one_of(
    st.sampled_from([API_KEY, PEER_KEY]),
    near_misses(API_KEY),
    near_misses(PEER_KEY),
    # No control characters: the client refuses to send them (header injection).
    st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=40),
)
schemes = st.sampled_from(["Bearer", "bearer", "BEARER", "Basic", "Token", ""])
printable = st.builds(lambda s, t, sep: f"{s}{sep}{t}".encode(), schemes, tokens,
                      st.sampled_from([" ", "  ", "\t", ""]))  # fmt: skip
raw = st.binary(max_size=40).filter(lambda b: all(32 <= c != 127 for c in b))
authorization = st.none() | printable | raw.map(lambda b: b"Bearer " + b)


def expected_open(path: str, header: bytes | None) -> bool:
    _, keys = ENDPOINTS[path]
    if keys is None:
        return True
    if header is None:
        return False
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and token.strip().decode("latin-1") in keys


@FUZZ
@given(path=st.sampled_from(sorted(ENDPOINTS)), header=authorization)
def test_only_the_key_an_endpoint_takes_opens_it(
    served: Served, path: str, header: bytes | None
) -> None:
    status, content_type, payload = served.call(path, header)
    verdict = Verdict(Outcome.ANSWERED if status == 200 else Outcome.CLEAR_ERROR, status)
    TALLY.add(f"fuzz: authorization headers ({served.path})", verdict)
    assert status < 500, (status, payload[:200])
    if expected_open(path, header):
        assert status == 200, (path, header, status, payload[:200])
        return
    assert status == 401, (path, header, status, payload[:200])
    assert content_type == "application/json"
    error: dict[str, Any] = json.loads(payload)["error"]
    assert (error["type"], error["code"]) == ("AuthenticationError", 401)
    assert served.upstream.calls == []  # refused before any upstream
