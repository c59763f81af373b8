"""The request log's entry as both writers write it (the keys pinned by the data plane's
testdata/request_log_keys.json), and its writes: whole lines, none past PIPE_BUF unless one line
is longer, so that the data plane's lines in the same file never land inside one."""

from __future__ import annotations

import json
import select

from aiohttp.test_utils import make_mocked_request

from pdserve.gateway.dataplane import SOURCE
from pdserve.gateway.endpoints import Selection
from pdserve.gateway.exchange import Exchange
from pdserve.gateway.request_log import atomic_writes

KEYS = json.loads((SOURCE / "testdata/request_log_keys.json").read_text())["keys"]


def test_the_entry_has_the_keys_the_data_plane_writes_in_its_order() -> None:
    exchange = Exchange(
        request=make_mocked_request("POST", "/v1/chat/completions"),
        body={"model": "m", "messages": [], "max_tokens": 5},
        chat=True,
        request_id="pdserve-1",
        selection=Selection(pools={}, parity_hash="abc"),
        pd=False,
        started=0.0,
        tokens_api=False,
        headers={},
    )
    assert list(exchange.log_entry()) == KEYS


def test_writes_hold_whole_lines_of_at_most_pipe_buf_bytes() -> None:
    lines = [b"x" * 1000 + b"\n"] * 9 + [b"y" * (select.PIPE_BUF + 1) + b"\n", b"z\n"]
    writes = list(atomic_writes(lines))
    assert b"".join(writes) == b"".join(lines)  # nothing lost, nothing reordered
    assert all(w.endswith(b"\n") for w in writes)
    assert [len(w) for w in writes] == [4004, 4004, 1001, select.PIPE_BUF + 2, 2]
