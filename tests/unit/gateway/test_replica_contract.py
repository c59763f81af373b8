"""Judging a group of replicas that should agree: the largest group routes, a tie goes to the
replica answered first, and a disagreeing one is named with every field that differs."""

from __future__ import annotations

from typing import Any

from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.endpoints import Endpoint, Endpoints
from pdserve.gateway.replica_contract import (
    NOT_SERVED,
    ReplicaCheck,
    Verdict,
    differences,
    engine_answers_of,
    event_of,
    judge,
)


def answered(name: str, order: int, **answers: Any) -> ReplicaCheck:
    return ReplicaCheck(Endpoint(f"http://{name}", "p1", name=name), "render",
                        answers=answers, order=order)  # fmt: skip


def test_the_largest_group_routes_and_the_other_is_named_with_what_differs() -> None:
    odd = answered("odd", 0, ids=[1, 2], content="<think>x</think>y", reasoning=None)
    good = [answered(n, i + 1, ids=[1, 2], content="y", reasoning="x") for i, n in enumerate("ab")]
    changed = judge([odd, *good])
    assert {c.endpoint.name for c in changed} == {"odd", "a", "b"}
    assert [c.verdict for c in good] == [Verdict.verified] * 2
    assert odd.verdict is Verdict.mismatch
    assert odd.reason == (
        "content, reasoning differ from 2 other replica(s) of its render group "
        "(content: this replica '<think>x</think>y', they 'y')"
    )
    assert judge([odd, *good]) == []  # nothing changed: nothing reported again


def test_a_tie_goes_to_the_replica_answered_first() -> None:
    serving = answered("serving", 0, ids=[1])
    newcomer = answered("newcomer", 1, ids=[2])
    judge([newcomer, serving])
    assert (serving.verdict, newcomer.verdict) == (Verdict.verified, Verdict.mismatch)


def test_engines_without_version_or_models_routes_compare_as_not_served() -> None:
    assert engine_answers_of("m", None, None) == {
        "vLLM version": NOT_SERVED, "served model": NOT_SERVED,
    }  # fmt: skip
    models = {"data": [{"id": "m", "root": "/models/m", "max_model_len": 4096}]}
    assert engine_answers_of("m", {"version": "0.32.0"}, models) == {
        "vLLM version": "0.32.0",
        "served model": {"root": "/models/m", "max_model_len": 4096},
        "adapters": [],
    }
    assert engine_answers_of("other", {"version": "0.32.0"}, models)["served model"] == (
        "other is not among its models"
    )


def test_engines_holding_other_lora_adapters_are_not_paired() -> None:
    """An engine missing an adapter (or holding it at another path) would run one request
    under different weights on prefill and decode: it differs from its group."""
    base = {"id": "m", "root": "/models/m", "max_model_len": 4096}
    sql = {"id": "sql", "root": "/pdserve/adapters/sql", "parent": "m", "max_model_len": None}
    both = engine_answers_of("m", {"version": "0.32.0"}, {"data": [base, sql]})
    assert both["adapters"] == [("sql", "/pdserve/adapters/sql")]
    without = engine_answers_of("m", {"version": "0.32.0"}, {"data": [base]})
    moved = {**sql, "root": "/elsewhere/sql"}
    elsewhere = engine_answers_of("m", {"version": "0.32.0"}, {"data": [base, moved]})
    assert differences(without, both) == ["adapters"]
    assert differences(elsewhere, both) == ["adapters"]


def test_the_events_a_verdict_change_posts_on_the_pod() -> None:
    odd = answered("odd", 0, ids=[1])
    odd.verdict, odd.reason = Verdict.mismatch, "derender reasoning differs"
    assert event_of(odd, "gw-1") == (
        "Warning", "ReplicaContractMismatch",
        "kept out of routing by gateway gw-1: derender reasoning differs",
    )  # fmt: skip
    odd.previous, odd.verdict = Verdict.mismatch, Verdict.verified
    assert event_of(odd, "gw-1") == (
        "Normal", "ReplicaContractVerified", "agrees with its group now: routed by gateway gw-1"
    )  # fmt: skip
    first = answered("first", 1, ids=[1])
    first.verdict = Verdict.verified
    assert event_of(first, "gw-1") is None  # a replica verified on arrival: no event


async def test_a_new_pod_on_a_released_pod_ip_is_checked_anew() -> None:
    config = GatewayConfig.model_validate(
        {"model": "m", "pools": {"decode": {"service": "x", "port": 8000}}}
    )
    endpoints = Endpoints(config)
    endpoints.replace("decode", [Endpoint("http://10.0.0.5:8000", "p1", name="decode-0")])
    first = endpoints.pools["decode"][0]
    endpoints.replace("decode", [Endpoint("http://10.0.0.5:8000", "p1", name="decode-0")])
    assert endpoints.pools["decode"][0] is first  # the same pod: its state is kept
    endpoints.replace("decode", [Endpoint("http://10.0.0.5:8000", "p1", name="decode-1")])
    assert endpoints.pools["decode"][0] is not first
