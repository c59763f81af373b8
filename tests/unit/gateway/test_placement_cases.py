"""The Python gateway's side of operator/pdserve/dataplane/testdata/placement_cases.json:
which engine a request's hop prefers by where its KV probably is (prefix blocks sent before,
the conversation's last engine) and by load. The data plane's test (placement_test.go) reads
the same file, so a request lands on the same engine whichever process picks it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.gateway.affinity import PrefixIndex, block_hashes, conversation_of, scores
from pdserve.gateway.endpoints import Endpoint, Endpoints
from pdserve.gateway.fastpath import PLACEMENT

CASES_FILE = (
    Path(__file__).resolve().parents[3] / "operator/pdserve/dataplane/testdata/placement_cases.json"
)
CASES: dict[str, Any] = json.loads(CASES_FILE.read_text())


def test_the_cases_hold_the_rule_the_data_plane_is_pushed() -> None:
    assert CASES["placement"] == PLACEMENT


@pytest.mark.parametrize("case", CASES["pick"], ids=lambda case: case["name"])
def test_an_engine_is_picked_as_the_shared_case_says(case: dict[str, Any]) -> None:
    pool = [Endpoint(each["key"], running=each["load"]) for each in case["engines"]]
    affinity = scores(case["cachedBlocks"], case["conversationEngine"])
    picked = Endpoints.pick(pool, affinity=affinity)
    assert picked is not None
    assert picked.key == case["pick"]
    assert [e.key for e in Endpoints.rank(pool, affinity)] == case["rank"]


@pytest.mark.parametrize("case", CASES["prefix"], ids=lambda case: case["name"])
def test_cached_blocks_are_counted_as_the_shared_case_says(case: dict[str, Any]) -> None:
    index = PrefixIndex(max_blocks_per_engine=case["maxBlocks"])
    for prompt in case["sent"]:
        index.record("engine", block_hashes(prompt, case["blockSize"]))
    hashes = block_hashes(case["prompt"], case["blockSize"])
    assert index.cached_blocks("engine", hashes) == case["cachedBlocks"]


@pytest.mark.parametrize("case", CASES["load"], ids=lambda case: case["name"])
def test_an_engine_weighs_as_the_shared_case_says(case: dict[str, Any]) -> None:
    """`base` is what this gateway pushes for the scraped view; the data plane adds its own
    requests in flight and prompt tokens not prefilled yet, as this gateway does for its own."""
    scraped = case["scraped"]
    view = dict(waiting=scraped["waiting"], running=scraped["running"], kv_usage=scraped["kvUsage"])
    assert Endpoint("http://a:8000", **view).load() == pytest.approx(case["base"])
    own = Endpoint(
        "http://a:8000", **view, inflight=case["inflight"], prefill_backlog=case["backlog"]
    )
    assert own.load() == pytest.approx(case["load"])


@pytest.mark.parametrize("case", CASES["conversation"], ids=lambda case: case["name"])
def test_a_conversation_is_named_as_the_shared_case_says(case: dict[str, Any]) -> None:
    assert conversation_of(case["conversationId"], case["header"]) == case["conversation"]
