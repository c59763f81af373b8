"""The engine contract suites' fixture: simulated engines on their configs' loopback ports, torn
down after each test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import httpx
import pytest

from pdserve.sim.engine_config import EngineConfig
from pdserve.sim.engine_server import EngineServer
from tests.support.serving import serving_engine
from tests.support.sim_engine import Engines


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    """start(config) -> (server, client) on the config's own loopback port."""
    async with AsyncExitStack() as stack:

        async def start(config: EngineConfig) -> tuple[EngineServer, httpx.AsyncClient]:
            server, url = await stack.enter_async_context(serving_engine(config))
            client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
            return server, client

        yield start
