"""Where a failed decode is retried (fake upstream, no sockets): never on the replica that just
failed, and a decode crash is no KV-load fallback."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from pdserve.gateway.errors import GatewayError, UpstreamFailed
from pdserve.gateway.main import add_arguments
from tests.support.gateway_fakes import HANG, rig

KV = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1]}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
ANSWER = {"choices": [{"index": 0, "message": {"content": "hi"}}], "usage": {}}


async def test_a_crashed_decode_is_not_retried_nor_counted_as_a_kv_load_fallback() -> None:
    r = rig("openai")
    r.upstream.script = {
        "prefill": [{"kv_transfer_params": KV}],
        "decode": [UpstreamFailed("decode", "decode at http://decode: HTTP 500: boom"), ANSWER],
    }
    with pytest.raises(GatewayError) as error:
        await r.route.serve(r.exchange(CHAT))
    assert error.value.status == 502
    assert "boom" in error.value.message
    assert [c.url for c in r.upstream.calls if c.stage == "decode"] == ["http://decode"]
    assert r.fallbacks("kv_load_failed") == 0
    assert not r.planner.policy.health.failures  # nor a P/D transport failure for Auto


async def test_a_kv_load_failure_on_the_only_decode_is_still_retried_there_locally() -> None:
    """The engine answered (it could not pull prefill's KV), so with no other replica it serves
    the local-prefill retry."""
    r = rig("openai")
    r.upstream.script = {
        "prefill": [{"kv_transfer_params": KV}],
        "decode": [
            UpstreamFailed("decode", "decode at http://decode: HTTP 500: KV transfer failed"),
            ANSWER,
        ],
    }
    assert (await r.route.serve(r.exchange(CHAT))).status == 200
    assert r.fallbacks("kv_load_failed") == 1


def test_every_wait_has_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--config", "r.json", "--connect-timeout-seconds", "1", "--first-byte-timeout-seconds",
         "2", "--idle-timeout-seconds", "3", "--body-timeout-seconds", "4",
         "--request-timeout-seconds", "5"]
    )  # fmt: skip
    waits = ("connect", "first_byte", "idle", "body", "request")
    assert [getattr(args, f"{w}_timeout") for w in waits] == [1, 2, 3, 4, 5]
    defaults = parser.parse_args(["--config", "r.json"])
    assert [getattr(defaults, f"{w}_timeout") for w in waits] == [5, 120, 60, 30, 600]
    with pytest.raises(SystemExit):
        parser.parse_args(["--config", "r.json", "--idle-timeout-seconds", "0"])


@pytest.mark.parametrize("engine_api", ["tokens", "openai"])
async def test_a_client_leaving_a_non_streamed_request_aborts_the_decode_working_on_it(
    engine_api: str,
) -> None:
    """A tokens engine is told, by its name for the request; an OpenAI engine (no abort
    endpoint) is not posted to: the cancelled call's closed connection aborts it."""
    r = rig(engine_api)
    render = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 5}}
    r.upstream.script = {
        "render": [render], "prefill": [{"kv_transfer_params": KV}], "decode": [HANG],
    }  # fmt: skip
    exchange = r.exchange(CHAT)
    serving = asyncio.create_task(r.route.serve(exchange))
    await asyncio.wait_for(r.upstream.hanging.wait(), timeout=10)  # decode is under way
    serving.cancel()  # what aiohttp does when the client goes away
    with pytest.raises(asyncio.CancelledError):
        await serving
    if engine_api == "tokens":
        assert r.upstream.aborted == [("http://decode", ["generate-tokens-req-1"])]
    else:
        assert r.upstream.aborted == []
