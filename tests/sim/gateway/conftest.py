"""The gateway suites' fixture: a stack of simulators and gateways on loopback, torn down after
each test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from tests.support.sim_gateway import Stack


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with AsyncExitStack() as exits:
        yield Stack(exits)
