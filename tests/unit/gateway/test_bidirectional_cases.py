"""The Python gateway's side of operator/pdserve/dataplane/testdata/bidirectional_cases.json:
what prefill is pointed at of decode's held KV, whether a conversation's last turn is reused,
and which decode engines a P/D request's hold fits on. The data plane's test
(bidirectional_test.go) reads the same file, so a conversation's KV is kept the same way
whichever process serves its turns."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

from pdserve.gateway.affinity import DecodeKv
from pdserve.gateway.endpoints import Endpoint
from pdserve.gateway.held_kv import DecodeHolds, Hold
from pdserve.vllm.protocol import reuse_decode_kv_params

CASES_FILE = (
    Path(__file__).resolve().parents[3]
    / "operator/pdserve/dataplane/testdata/bidirectional_cases.json"
)
CASES: dict[str, Any] = json.loads(CASES_FILE.read_text())


@pytest.mark.parametrize("case", CASES["reuseBodies"], ids=lambda case: case["name"])
def test_prefill_is_pointed_at_decodes_held_kv_as_the_shared_case_says(
    case: dict[str, Any],
) -> None:
    got = reuse_decode_kv_params(case["held"], case["matched"], case["blockSize"])
    assert got == case["want"]


@pytest.mark.parametrize("case", CASES["reuse"], ids=lambda case: case["name"])
def test_a_turn_is_reused_as_the_shared_case_says(case: dict[str, Any]) -> None:
    now = 1000.0
    store = DecodeKv(ttl=60, clock=lambda: now)
    if (held := case["held"]) is not None:
        store.ttl = 0 if held["expired"] else 60
        store.keep("c-1", {"remote_request_id": "t"}, held["tokens"], request_id="t")
    _, outcome, matched = store.reuse("c-1", case["prompt"], case["minTokens"])
    assert (outcome, matched) == (case["want"]["outcome"], case["want"]["matched"])
    if outcome == "expired":  # forgotten: the next turn finds none
        assert store.reuse("c-1", case["prompt"], case["minTokens"])[1] == "none"


def decode_endpoint(key: str, blocks: int, block_size: int) -> Endpoint:
    url, _, rank = key.partition("#dp")
    endpoint = Endpoint(url, "p1", rank=int(rank) if rank else None)
    endpoint.kv_blocks, endpoint.kv_block_size = blocks, block_size
    return endpoint


@pytest.mark.parametrize("case", CASES["room"], ids=lambda case: case["name"])
def test_a_hold_fits_the_decode_engines_the_shared_case_says(case: dict[str, Any]) -> None:
    holds = DecodeHolds(ttl=60, block_size=case["blockSize"], fraction=case["fraction"])
    for url, blocks in case["held"].items():
        holds.holds[url] = OrderedDict({"held": Hold(blocks, float("inf"))})
    holds.elsewhere = dict(case["elsewhere"])
    holds.reserve("decoding", case["pending"])
    decode = [decode_endpoint(d["key"], d["blocks"], d["blockSize"]) for d in case["decodes"]]
    fits = holds.room(decode, case["tokens"], case["replicas"])
    assert [e.key for e in fits] == case["want"]


def test_a_turn_read_back_is_never_pointed_at_again() -> None:
    """A next prefill that read the turn's KV freed it on decode (affinity.DecodeKv.consumed;
    bidirectional_test.go holds the data plane to the same)."""
    store = DecodeKv(ttl=60)
    store.keep("c-1", {"remote_request_id": "r2"}, [1, 2, 3, 4], request_id="r2")
    store.consumed("c-1", "another")
    assert store.reuse("c-1", [1, 2, 3, 4, 5], 2)[1] == "reused"
    store.consumed("c-1", "r2")
    assert store.reuse("c-1", [1, 2, 3, 4, 5], 2)[1] == "none"
