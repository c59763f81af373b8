"""The adversarial suite's outcome table, printed at the end of a run that used it, and the
input fuzzers' gateway on each request path (test_fuzz_auth.py serves its own, with keys
set)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _pytest.terminal import TerminalReporter

from tests.support.fuzz_gateway import Served
from tests.support.outcomes import TALLY
from tests.support.served_gateway import REQUEST_PATHS

# Hypothesis keeps caches (the constants it found in the code) in its storage directory, by
# default .hypothesis/ in the repository: keep them out of it (the fuzz tests set database=None).
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", str(Path(tempfile.gettempdir()) / "pdserve-hypothesis")
)


def pytest_terminal_summary(terminalreporter: TerminalReporter) -> None:
    if TALLY.counts:
        terminalreporter.write_sep("=", "gateway adversarial outcomes")
        terminalreporter.write_line(TALLY.table())


@pytest.fixture(params=REQUEST_PATHS)
def request_path(request: pytest.FixtureRequest) -> str:
    """Parametrises a test by request path; `Stack.gateway(..., data_plane=request_path ==
    "dataplane")` (or `behind_data_plane(request_path)`) puts the gateway on it."""
    return str(request.param)


def behind_data_plane(request_path: str) -> bool:
    return request_path == "dataplane"


@pytest.fixture(scope="module", params=REQUEST_PATHS)
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    """The whole gateway on the loopback fake upstream, one per request path for all of a
    module's examples: each fuzz test runs on both paths."""
    gateway = Served(str(request.param))
    try:
        yield gateway
    finally:
        gateway.close()
