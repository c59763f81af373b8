"""P/D pairing by KV-transfer compatibility: a request prefilled on a prefill replica is only
ever decoded by a replica with the same KV-compatibility digest (mid engine upgrade, a new
prefill never meets an old decode); a prefill replica no decode can pull from is never used,
and the request prefills locally on decode instead, counted as no_compatible_decode."""

from __future__ import annotations

import json
import random
from typing import Any, cast

from aiohttp.test_utils import make_mocked_request

from pdserve.contract.names import KV_COMPAT_ANNOTATION
from pdserve.gateway.discovery import PodDiscovery
from pdserve.gateway.endpoints import Endpoint, Endpoints
from pdserve.gateway.openai_route import OpenAIRoute
from pdserve.kube.client import Kube
from tests.support.gateway_fakes import Rig, config, fake_gateway, rig

KV = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "e"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
ANSWER = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1},
}
TOKENS_ANSWER = {"choices": [{"index": 0, "token_ids": [9], "finish_reason": "stop"}]}
RENDERED = {"token_ids": list(range(1, 9)), "sampling_params": {"max_tokens": 5}}


def endpoint(url: str, kv_compat: str | None) -> Endpoint:
    return Endpoint(url, "p1", kv_compat=kv_compat)


def scripted(r: Rig) -> None:
    r.upstream.script = {
        "render": lambda _: RENDERED,
        "prefill": lambda _: {"kv_transfer_params": KV},
        "decode": lambda _: ANSWER if isinstance(r.route, OpenAIRoute) else TOKENS_ANSWER,
        "derender": lambda _: ANSWER,
    }


async def serve_shuffled(
    r: Rig, prefill: list[Endpoint], decode: list[Endpoint], requests: int
) -> list[tuple[str, str]]:
    """Serve `requests` requests, the pools in a new order each time (the fake upstream calls
    the first candidate: without pairing, every replica would come first some of the time);
    (prefill URL, decode URL) of each request, or ("", decode URL) for local prefill."""
    shuffle = random.Random(7).shuffle
    pairs: list[tuple[str, str]] = []
    for _ in range(requests):
        shuffle(prefill)
        shuffle(decode)
        r.planner.endpoints.replace("prefill", list(prefill))
        r.planner.endpoints.replace("decode", list(decode))
        r.upstream.calls.clear()
        response = await r.route.serve(r.exchange(CHAT))
        assert response.status == 200
        urls = {c.stage: c.url for c in r.upstream.calls}
        pairs.append((urls.get("prefill", ""), urls["decode"]))
    return pairs


async def test_with_new_and_old_prefill_and_only_old_decode_only_old_prefill_is_used() -> None:
    r = rig("tokens")
    scripted(r)
    prefill = [endpoint("http://p-old", "old"), endpoint("http://p-new", "new")]
    decode = [endpoint("http://d-old", "old")]
    pairs = await serve_shuffled(r, prefill, decode, 30)
    assert set(pairs) == {("http://p-old", "http://d-old")}
    assert r.fallbacks("no_compatible_decode") == 0


async def test_each_request_is_decoded_by_a_replica_of_its_prefills_digest() -> None:
    r = rig("openai")
    scripted(r)
    prefill = [endpoint("http://p-old", "old"), endpoint("http://p-new", "new")]
    decode = [
        endpoint("http://d-old", "old"),
        endpoint("http://d-new", "new"),
        endpoint("http://d-new-2", "new"),
    ]
    digest = {e.url: e.kv_compat for e in prefill + decode}
    pairs = await serve_shuffled(r, prefill, decode, 40)
    assert all(digest[p] == digest[d] for p, d in pairs), pairs
    assert {p for p, _ in pairs} == {"http://p-old", "http://p-new"}  # both pairs did serve


async def test_replicas_without_a_digest_pair_only_with_each_other() -> None:
    r = rig("openai")
    scripted(r)
    prefill = [endpoint("http://p-unknown", None), endpoint("http://p-new", "new")]
    decode = [endpoint("http://d-unknown", None)]
    pairs = await serve_shuffled(r, prefill, decode, 20)
    assert set(pairs) == {("http://p-unknown", "http://d-unknown")}


async def test_a_prefill_no_decode_can_pull_from_is_never_used_and_the_fallback_counted() -> None:
    """Mode Disaggregated too: the request prefills locally rather than failing or pairing
    engines whose KV handshake NIXL would refuse."""
    r = rig("tokens", mode="Disaggregated")
    scripted(r)
    prefill = [endpoint("http://p-new", "new"), endpoint("http://p-newer", "newer")]
    decode = [endpoint("http://d-old", "old"), endpoint("http://d-old-2", "old")]
    pairs = await serve_shuffled(r, prefill, decode, 10)
    assert {p for p, _ in pairs} == {""}  # no prefill call at all
    assert all("kv_transfer_params" not in body for body in r.upstream.sent("decode"))
    assert r.fallbacks("no_compatible_decode") == 10
    assert not r.planner.policy.health.failures  # a rollout, not a failing P/D path


def test_decode_candidates_with_prefills_kv_keep_only_its_digest() -> None:
    decodes = [endpoint("http://a", "x"), endpoint("http://b", "y"), endpoint("http://c", None)]
    assert [e.url for e in Endpoints.kv_compatible(decodes, endpoint("http://p", "y"))] == [
        "http://b"
    ]
    assert [e.url for e in Endpoints.kv_compatible(decodes, endpoint("http://p", None))] == [
        "http://c"
    ]


def test_static_endpoints_and_discovered_pods_carry_their_digest() -> None:
    cfg = config()
    body = cfg.model_dump(by_alias=True, exclude_unset=True, mode="json")
    body["endpoints"]["prefill"][0]["kvCompat"] = "abc"
    static = Endpoints(type(cfg).model_validate(body))
    assert [e.kv_compat for e in static.pools["prefill"]] == ["abc"]
    assert [e.kv_compat for e in static.pools["decode"]] == [None]

    def pod(name: str, component: str, annotations: dict[str, str]) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "labels": {"c": component}, "annotations": annotations},
            "status": {"podIP": f"10.0.0.{len(name)}",
                       "conditions": [{"type": "Ready", "status": "True"}]},
        }  # fmt: skip

    pools = {"prefill": {"service": "p", "port": 8000, "selector": {"c": "prefill"}},
             "decode": {"service": "d", "port": 8000, "selector": {"c": "decode"}}}  # fmt: skip
    discovered = type(cfg).model_validate({"model": "m", "pools": pools})
    endpoints = Endpoints(discovered)
    discovery = PodDiscovery(cast(Kube, None), discovered, endpoints)
    discovery.pods = {
        "p": pod("p", "prefill", {KV_COMPAT_ANNOTATION: "new"}),
        "dd": pod("dd", "decode", {}),
    }
    discovery.publish()
    assert [e.kv_compat for e in endpoints.pools["prefill"]] == ["new"]
    assert [e.kv_compat for e in endpoints.pools["decode"]] == [None]
    # A pod rolled to a new build keeps its in-flight count but takes its new digest.
    discovery.pods["dd"] = pod("dd", "decode", {KV_COMPAT_ANNOTATION: "new"})
    discovery.publish()
    assert [e.kv_compat for e in endpoints.pools["decode"]] == ["new"]


async def test_status_shows_each_engines_digest() -> None:
    gateway, _ = fake_gateway("openai")
    gateway.endpoints.replace("prefill", [endpoint("http://p", "new")])
    gateway.endpoints.replace("decode", [endpoint("http://d", "old")])
    response = await gateway.status(make_mocked_request("GET", "/status"))
    assert response.body is not None
    status = json.loads(cast(bytes, response.body))["kvCompat"]
    assert status["prefill"] == {"http://p": "new"}
    assert status["decode"] == {"http://d": "old"}


def bidirectional_rig() -> tuple[Rig, list[int]]:
    """Tokens route with bidirectional KV: decode answers with the KV it holds of the turn."""
    r = rig("tokens", kv_transfer={"bidirectional": True})
    prompt = list(range(1, 65))
    held = {"remote_request_id": "held-1", "remote_num_tokens": 64, "remote_block_ids": [1, 2]}
    r.upstream.script = {
        "render": lambda _: {"token_ids": prompt, "sampling_params": {"max_tokens": 5}},
        "prefill": lambda _: {"kv_transfer_params": KV},
        "decode": lambda _: {**TOKENS_ANSWER, "kv_transfer_params": held},
        "derender": lambda _: ANSWER,
    }
    return r, prompt


async def turn(r: Rig, prefill: list[Endpoint], decode: list[Endpoint]) -> dict[str, Any]:
    """One turn of conversation c-1 (the fake engines answer the first candidate); what the
    prefill replica was sent, with its URL."""
    r.planner.endpoints.replace("prefill", list(prefill))
    r.planner.endpoints.replace("decode", list(decode))
    r.upstream.calls.clear()
    response = await r.route.serve(r.exchange({**CHAT, "conversation_id": "c-1"}))
    assert response.status == 200
    (call,) = [c for c in r.upstream.calls if c.stage == "prefill"]
    return {"url": call.url, **call.body["kv_transfer_params"]}


def reuse_outcomes(r: Rig, outcome: str) -> float:
    return float(r.metrics.bidirectional.labels(outcome)._value.get())


async def test_a_conversations_held_kv_goes_only_to_a_prefill_of_its_decodes_digest() -> None:
    """Mid engine upgrade the next turn's prefill could land on a replica of the other digest,
    which could not pull the KV the last turn left on an old decode: only prefill replicas of
    the holder's digest take that turn."""
    r, _ = bidirectional_rig()
    p_old, p_new = endpoint("http://p-old", "old"), endpoint("http://p-new", "new")
    d_old, d_new = endpoint("http://d-old", "old"), endpoint("http://d-new", "new")
    first = await turn(r, [p_old, p_new], [d_old, d_new])
    assert first["url"] == "http://p-old"  # decoded on d-old, which holds the turn
    # The new prefill comes first now: without the digest it would be handed d-old's KV.
    second = await turn(r, [p_new, p_old], [d_new, d_old])
    assert (second["url"], second.get("remote_request_id")) == ("http://p-old", "held-1")
    assert reuse_outcomes(r, "reused") == 1


async def test_held_kv_no_prefill_can_pull_or_whose_decode_is_gone_is_not_reused() -> None:
    r, _ = bidirectional_rig()
    p_old, p_new = endpoint("http://p-old", "old"), endpoint("http://p-new", "new")
    d_old, d_new = endpoint("http://d-old", "old"), endpoint("http://d-new", "new")
    await turn(r, [p_old], [d_old, d_new])  # held on d-old
    # Every old prefill replaced: the turn prefills from scratch on a new one.
    second = await turn(r, [p_new], [d_new, d_old])
    assert (second["url"], second.get("remote_request_id")) == ("http://p-new", None)
    assert reuse_outcomes(r, "incompatible") == 1
    # That turn was decoded on d-new; d-new then goes away (its pod replaced).
    third = await turn(r, [p_new], [endpoint("http://d-newer", "new")])
    assert third.get("remote_request_id") is None
    assert reuse_outcomes(r, "decode_gone") == 1
