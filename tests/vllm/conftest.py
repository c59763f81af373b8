"""Real vLLM (its CPU build, built by devtools/vllm_cpu.py) serving the tiny model built by
devtools/tiny_model.py: one render server and one aggregated engine for the whole package (the
engine is also the reference: what vLLM itself answers), gateways in-process over them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from devtools.tiny_model import ensure_tiny_model
from devtools.vllm_cpu import ensure_vllm_cpu
from tests.support.markers import mark_package
from tests.support.real_vllm import VllmProcesses, VllmServer


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_package(items, __file__, pytest.mark.vllm)


@pytest.fixture(scope="package")
def vllm_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcesses]:
    env = ensure_vllm_cpu()
    procs = VllmProcesses(env, ensure_tiny_model(env), tmp_path_factory.mktemp("vllm-logs"))
    try:
        procs.render()
        procs.engine("engine")
        procs.wait_ready()
        yield procs
    finally:
        procs.stop()


@pytest.fixture(scope="package")
def render(vllm_processes: VllmProcesses) -> VllmServer:
    return vllm_processes.servers["render"]


@pytest.fixture(scope="package")
def engine(vllm_processes: VllmProcesses) -> VllmServer:
    """`vllm serve --enable-scale-out`: the tokens API for the gateway, the OpenAI API as the
    reference."""
    return vllm_processes.servers["engine"]


@pytest.fixture
async def reference(engine: VllmServer) -> AsyncIterator[object]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{engine.url}/v1", api_key="none", max_retries=0) as client:
        yield client
