"""engine_connections.py leans on aiohttp's private parts: this fails loudly when they change,
before a gateway reads an engine's unasked-for bytes as a client's answer again."""

from __future__ import annotations

import inspect

import aiohttp
from aiohttp.client_proto import ResponseHandler

from pdserve.gateway.engine_connections import EngineConnector


async def test_the_connector_builds_connections_that_refuse_unasked_bytes() -> None:
    connector = EngineConnector(limit=0)
    try:
        protocol = connector._factory()
        assert isinstance(protocol, ResponseHandler)
        assert type(protocol).__name__ == "_AnswersOnlyWhenAsked"
    finally:
        await connector.close()


def test_aiohttp_still_has_the_hooks_the_connector_overrides() -> None:
    release = inspect.signature(aiohttp.BaseConnector._release)
    assert list(release.parameters) == ["self", "key", "protocol", "should_close"]
    assert "set_response_params" in vars(ResponseHandler)
    assert "data_received" in vars(ResponseHandler)
