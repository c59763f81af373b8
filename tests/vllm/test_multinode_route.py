"""A prefill replica over two "nodes" on real vLLM: the operator's LeaderWorkerSet pod for a pool
with nodesPerReplica 2 and dataParallelSize 4, run as two `vllm serve` processes on loopback
(worker 0 the leader with ranks 0-1, worker 1 with ranks 2-3, hybrid load balancing: each serves
HTTP for its own ranks), its KV handed over NIXL to a decode engine behind the gateway, which
pins each prefill to one rank of one node. The command lines are the operator's, unchanged
but for what the kubelet expands ($(LWS_WORKER_INDEX), $(LWS_LEADER_ADDRESS)) and the ports one
host needs.

The model is the tiny dense one with spec.model.shape unset (the operator does not judge it; it
refuses nodesPerReplica > 1 only for a model declared dense): vLLM 0.32.0's CPU build cannot run
a MoE model with more than one data-parallel rank (docs/design/multinode.md "What can run on
CPU here"), so expert parallelism and the ranks' MoE collectives are not exercised here."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from devtools.tiny_model import ensure_tiny_model
from devtools.vllm_cpu import ensure_vllm_cpu
from pdserve.api import DisaggregatedModel
from pdserve.builders import build_all
from pdserve.builders.leaderworkerset import pod_template_of
from pdserve.ports import port_block
from pdserve.vllm.metrics import PROMPT_TOKENS, counter_samples, sum_samples
from tests.support.chat_cases import CHAT_CASES, request
from tests.support.operator_commands import (
    LEADER_ADDRESS,
    PORT_FLAG,
    RPC_PORT_FLAG,
    pod_commands,
    routing_config,
)
from tests.support.real_stack import GatewayUnderTest, chat_answer, gateway_over, pretty
from tests.support.real_vllm import (
    VllmProcesses,
    VllmServer,
    engine_counts,
    tiny_cpu_engine,
    tiny_cpu_model,
)

NODES, RANKS = 2, 4
NODE_RANKS = {"prefill-0": ["0", "1"], "prefill-1": ["2", "3"]}


def two_node_model(model: str) -> DisaggregatedModel:
    """Prefill: one replica over two pods of two ranks each (one rank per pod dies in vLLM 0.32's
    hybrid mode); decode: one pod, one rank; KV over NIXL in CPU memory."""
    return tiny_cpu_model("tiny-mn", model, {
        "model": {"maxModelLen": 2048},
        "serving": {"reasoningParser": "qwen3", "toolCallParser": "hermes",
                    "enableAutoToolChoice": True},
        "prefill": {**tiny_cpu_engine(one_process=False), "nodesPerReplica": NODES,
                    "dataParallelSize": RANKS},
        "decode": tiny_cpu_engine(),
        "kvTransfer": {"kvBufferDevice": "cpu"},
        "gateway": {"routing": {"mode": "Disaggregated"}},
    })  # fmt: skip


@dataclass
class Group:
    dm: DisaggregatedModel
    servers: dict[str, VllmServer]
    rpc_port: int

    @property
    def nodes(self) -> list[VllmServer]:
        return [self.servers[name] for name in NODE_RANKS]


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    env = ensure_vllm_cpu()
    model = ensure_tiny_model(env)
    dm = two_node_model(str(model))
    procs = VllmProcesses(env, model, tmp_path_factory.mktemp("vllm-mn-logs"))
    # One group: its pods share the leader's RPC port and one NIXL base (base + global rank).
    rpc_port, side_channel = port_block(1), port_block(RANKS)
    try:
        for name, pod in pod_commands(dm).items():
            if pod.worker is None:
                procs.start_pod(name, pod)
            else:
                procs.start_pod(name, pod, side_channel_port=side_channel, rpc_port=rpc_port)
        procs.wait_ready()
        yield Group(dm, dict(procs.servers), rpc_port)
    finally:
        procs.stop()


@pytest.fixture
async def node0(group: Group) -> AsyncIterator[AsyncOpenAI]:
    """The leader's own OpenAI API: the reference answers (the same engine build and seed)."""
    url = f"{group.servers['prefill-0'].url}/v1"
    async with AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as client:
        yield client


@pytest.fixture
async def route(group: Group) -> AsyncIterator[GatewayUnderTest]:
    async with gateway_over(
        render=group.servers["render"].url, prefill=[n.url for n in group.nodes],
        decode=[group.servers["decode"].url], operator_config=routing_config(group.dm),
        # Five engine processes share two cores here: an API server may not accept a connection
        # within the default 5 s (a fresh-clone run lost a request so, marked the one decode
        # replica down and answered 502). The test is about routing, not this machine's load.
        load_scrape_seconds=None, connect_timeout=30.0,
    ) as gateway:  # fmt: skip
        yield gateway


def per_engine(server: VllmServer, metric: str) -> dict[str, float]:
    """A counter of the server's /metrics by `engine` label (the global data-parallel rank)."""
    names = counter_samples(metric)
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return sum_samples(text, lambda name, labels: labels.get("engine") if name in names else None)


def test_each_node_runs_the_operators_line_as_the_kubelet_expands_it(group: Group) -> None:
    [lws] = [o for o in build_all(group.dm) if o["kind"] == "LeaderWorkerSet"]
    [container] = pod_template_of(lws)["spec"]["containers"]
    for worker, node in enumerate(group.nodes):
        expanded = {"$(LWS_WORKER_INDEX)": str(worker), "$(LWS_LEADER_ADDRESS)": LEADER_ADDRESS}
        args = [expanded.get(arg, arg) for arg in container["args"]]
        # This host's ports: the node's own HTTP port, the group's RPC port.
        args[args.index(PORT_FLAG) + 1] = node.url.rsplit(":", 1)[1]
        args[args.index(RPC_PORT_FLAG) + 1] = str(group.rpc_port)
        logged = node.log.read_text().splitlines()[0]
        assert logged.endswith(" serve " + " ".join(args) + " --host 127.0.0.1"), logged


async def test_each_node_serves_its_own_ranks(group: Group, node0: AsyncOpenAI) -> None:
    body = request(CHAT_CASES["reasoning"])
    wanted = chat_answer(await node0.chat.completions.create(**body))
    for name, node in zip(NODE_RANKS, group.nodes, strict=True):
        url = f"{node.url}/v1"
        async with AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as client:
            assert chat_answer(await client.chat.completions.create(**body)) == wanted, name
        assert sorted(per_engine(node, PROMPT_TOKENS)) == NODE_RANKS[name]


async def test_pd_through_ranks_of_both_nodes_answers_what_node_0_answers(
    group: Group, route: GatewayUnderTest, node0: AsyncOpenAI
) -> None:
    bodies = [request(CHAT_CASES[case]) for case in ("reasoning", "length")]
    expected = [chat_answer(await node0.chat.completions.create(**b)) for b in bodies]
    await handshake_every_rank(group, route)
    for node in group.nodes:
        transfers = engine_counts(group.servers["decode"]).get("kv_transfers", 0.0)
        before = [per_engine(n, PROMPT_TOKENS) for n in group.nodes]
        # The other node's ranks look busy to the gateway: every prefill goes to this node.
        for target in route.gateway.endpoints.pools["prefill"]:
            target.running = 0 if target.url == node.url else 50
        await route.pushed()
        got = await asyncio.gather(*(route.client.chat.completions.create(**b) for b in bodies))
        for answer, wanted in zip([chat_answer(a) for a in got], expected, strict=True):
            assert answer == wanted, f"P/D via {node.name}:\n{pretty(answer)}"
        after = [per_engine(n, PROMPT_TOKENS) for n in group.nodes]
        prefilled = {n.name: grew(b, a) for n, b, a in zip(group.nodes, before, after, strict=True)}
        assert prefilled == {n.name: n is node for n in group.nodes}, (before, after)
        # Decode pulled every prompt's KV over NIXL from the rank that prefilled it.
        kv = engine_counts(group.servers["decode"]).get("kv_transfers", 0.0)
        assert kv >= transfers + len(bodies)


async def handshake_every_rank(group: Group, route: GatewayUnderTest, tries: int = 3) -> None:
    """Decode's first KV pull from each prefill rank: its NIXL handshake, which vLLM 0.32 waits
    5 s for (a fixed ZMQ receive timeout in nixl/base_worker.py); when it runs out the request
    fails (kv_load_failure_policy "fail": an HTTP 500 without words, which the gateway answers
    502). On two cores shared by five engine processes the first one may take longer; the next
    pull handshakes again. So each rank is handshaken before the test measures (a rank that
    never completes one within `tries` fails here, saying so)."""
    decode = group.servers["decode"]
    body = request(CHAT_CASES["length"])
    targets = route.gateway.endpoints.pools["prefill"]
    for chosen in targets:
        for _ in range(tries):
            for target in targets:  # every prefill goes to the chosen rank
                target.running = 0 if target is chosen else 50
            await route.pushed()
            pulled = engine_counts(decode).get("kv_transfers", 0.0)
            with contextlib.suppress(openai.InternalServerError):  # the handshake timed out
                await route.client.chat.completions.create(**body)
            if engine_counts(decode).get("kv_transfers", 0.0) > pulled:
                break
        else:
            raise AssertionError(f"decode never pulled KV from {chosen.key} ({tries} tries)")


def grew(before: Mapping[str, float], after: Mapping[str, float]) -> bool:
    return any(after.get(rank, 0.0) > count for rank, count in before.items())
