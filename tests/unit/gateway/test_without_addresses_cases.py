"""The Python gateway's side of operator/pdserve/dataplane/testdata/without_addresses.json: the
data plane answers engine failures itself (dataplane/failures.go withoutAddresses), in the same
words, so both sides' tests read the one list of cases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.gateway.errors import without_addresses

CASES = (
    Path(__file__).resolve().parents[3]
    / "operator/pdserve/dataplane/testdata/without_addresses.json"
)


def cases() -> list[Any]:
    loaded: list[dict[str, str]] = json.loads(CASES.read_text())
    return [pytest.param(c["message"], c["client"], id=c["message"][:40]) for c in loaded]


@pytest.mark.parametrize(("message", "client"), cases())
def test_a_failure_reaches_the_client_without_the_clusters_addresses(
    message: str, client: str
) -> None:
    assert without_addresses(message) == client
