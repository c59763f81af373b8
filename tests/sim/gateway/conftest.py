"""The gateway suites' fixture: a stack of simulators and gateways on loopback, torn down after
each test. A test that does not choose its request path (no `request_path` parameter) runs on
both: its `stack` puts every gateway it starts behind the data plane, or not, by REQUEST_PATHS."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import Stack


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "stack" not in metafunc.fixturenames or "request_path" in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if "stack" in (names.split(",") if isinstance(names, str) else names):
            return  # its path pinned (sim_gateway.python_gateways_only)
    metafunc.parametrize("stack", REQUEST_PATHS, indirect=True)


@pytest.fixture
async def stack(request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    path = getattr(request, "param", "python")  # a test that chose its path says so itself
    async with AsyncExitStack() as exits:
        yield Stack(exits, data_plane=path == "dataplane")
