"""The simulated engine runs its node's data-parallel ranks behind one HTTP server, as vLLM 0.32
does: the X-data-parallel-rank header pins a rank (its own prefix cache and metrics), out of
range is vLLM's 400, without it the least loaded rank serves; /metrics labels every series
engine="<global rank>"; --nnodes/--node-rank give the node's ranks; each rank hands off KV under
its own engine id, and a pull or an abort reaches the rank that holds the request."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devtools.localplane import free_port
from pdserve.sim.cli import engine_config as config_of_args
from pdserve.sim.cli import engine_parser
from pdserve.sim.engine_config import EngineConfig
from pdserve.sim.engine_core import SchedulerConfig
from pdserve.vllm.protocol import ABORT_PATH, GENERATE_PATH, abort_body, prefill_handoff_params
from tests.support.sim_engine import PROMPT, Engines, engine_config, generate_body

SUCCESS = "vllm:request_success_total"
KV_USAGE = "vllm:kv_cache_usage_perc"


def two_ranks(role: str = "both", **overrides: Any) -> EngineConfig:
    return engine_config(role, data_parallel_size=2, data_parallel_size_local=2, **overrides)


def slow(config: EngineConfig) -> EngineConfig:
    """Real-time steps (20 ms): a long answer stays running while the test looks."""
    config.scheduler = SchedulerConfig(time_scale=1.0)
    return config


def pinned(rank: int | str) -> dict[str, str]:
    return {"X-data-parallel-rank": str(rank)}


async def by_engine(client: httpx.AsyncClient, sample: str) -> dict[str, float]:
    """A sample's value per engine label on /metrics (summed over its other labels)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        for s in family.samples:
            if s.name == sample:
                values[s.labels["engine"]] = values.get(s.labels["engine"], 0.0) + s.value
    return values


async def test_the_header_pins_a_rank_with_its_own_prefix_cache(engines: Engines) -> None:
    _, client = await engines(two_ranks())
    for _ in range(2):
        response = await client.post(GENERATE_PATH, json=generate_body(), headers=pinned(1))
        assert response.status_code == 200
    assert await by_engine(client, SUCCESS) == {"1": 2.0}
    hits = await by_engine(client, "vllm:prefix_cache_hits_total")
    assert hits["1"] > 0  # the second request found the first's blocks on rank 1
    assert hits["0"] == 0
    assert (await by_engine(client, "vllm:prompt_tokens_total"))["0"] == 0

    # The other rank has a cache of its own: the same prompt there is computed again.
    await client.post(GENERATE_PATH, json=generate_body(), headers=pinned(0))
    assert (await by_engine(client, "vllm:prefix_cache_hits_total"))["0"] == 0
    assert (await by_engine(client, "vllm:prompt_tokens_total"))["0"] == len(PROMPT)


CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
COMPLETION = {"model": "qwen", "prompt": "hi", "max_tokens": 5}
ROUTES = [(GENERATE_PATH, generate_body()), ("/v1/chat/completions", CHAT),
          ("/v1/completions", COMPLETION)]  # fmt: skip


@pytest.mark.parametrize(("path", "body"), ROUTES)
@pytest.mark.parametrize("rank", ["2", "-1"])
async def test_a_rank_out_of_range_is_vllms_400(
    engines: Engines, path: str, body: dict[str, Any], rank: str
) -> None:
    _, client = await engines(two_ranks(api="scale_out"))
    response = await client.post(path, json=body, headers=pinned(rank))
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": f"data_parallel_rank {rank} is out of range [0, 2).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    assert await by_engine(client, SUCCESS) == {}  # no rank saw it


@pytest.mark.parametrize(("path", "body"), ROUTES)
async def test_the_header_pins_a_rank_on_every_route(
    engines: Engines, path: str, body: dict[str, Any]
) -> None:
    _, client = await engines(two_ranks(api="scale_out"))
    assert (await client.post(path, json=body, headers=pinned(1))).status_code == 200
    assert await by_engine(client, SUCCESS) == {"1": 1.0}


async def test_a_header_that_is_no_integer_is_ignored_as_vllm_ignores_it(
    engines: Engines,
) -> None:
    _, client = await engines(two_ranks())
    response = await client.post(GENERATE_PATH, json=generate_body(), headers=pinned("one"))
    assert response.status_code == 200


async def test_metrics_have_every_family_for_every_rank(engines: Engines) -> None:
    _, client = await engines(two_ranks())
    for rank in (0, 1):  # a finished request each, so request_success has its series too
        await client.post(GENERATE_PATH, json=generate_body(), headers=pinned(rank))
    families = list(text_string_to_metric_families((await client.get("/metrics")).text))
    engine_families = [f for f in families if f.samples and "engine" in f.samples[0].labels]
    assert len(engine_families) >= 20
    for family in engine_families:
        assert {s.labels["engine"] for s in family.samples} == {"0", "1"}, family.name


async def test_a_single_rank_engine_is_engine_0_with_vllms_engine_id(engines: Engines) -> None:
    config = engine_config("prefill")
    _, client = await engines(config)
    first = await client.post(
        GENERATE_PATH, json=generate_body(kv_transfer_params=prefill_handoff_params())
    )
    assert first.json()["kv_transfer_params"]["remote_engine_id"] == config.engine_id  # no _dp0
    usage = await by_engine(client, KV_USAGE)
    assert set(usage) == {"0"}


def cli_config(*flags: str) -> EngineConfig:
    return config_of_args(engine_parser().parse_args(["qwen", *flags]))


# The operator's multi-node line for worker 1 of a 2-node DP=4 group (builders/vllm_args.py).
NODE_1_OF_2 = ["--tensor-parallel-size", "1", "--data-parallel-size", "4", "--nnodes", "2",
               "--node-rank", "1", "--data-parallel-hybrid-lb", "--data-parallel-address",
               "10.0.0.1", "--data-parallel-rpc-port", "29550"]  # fmt: skip


async def test_node_1_of_2_runs_global_ranks_2_and_3(engines: Engines) -> None:
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "pool"}
    config = cli_config(
        *NODE_1_OF_2, "--enable-scale-out", "--port", str(free_port()),
        "--sim-time-scale", "0.01", "--kv-transfer-config", json.dumps(kv),
    )  # fmt: skip
    assert (config.data_parallel_size, config.data_parallel_size_local) == (4, 2)
    assert config.data_parallel_start_rank == 2
    _, client = await engines(config)
    assert set(await by_engine(client, KV_USAGE)) == {"2", "3"}

    body = generate_body(kv_transfer_params=prefill_handoff_params())
    first = await client.post(GENERATE_PATH, json=body, headers=pinned(0))
    assert first.json()["kv_transfer_params"]["remote_engine_id"] == "pool_dp2"
    assert await by_engine(client, SUCCESS) == {"2": 1.0}
    beyond = await client.post(GENERATE_PATH, json=generate_body(), headers=pinned(2))
    assert beyond.json()["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."


@pytest.mark.parametrize(
    ("flags", "local", "start"),
    [
        ([], 1, 0),
        (["-dp", "4"], 4, 0),  # one node runs every rank
        (["-dp", "4", "-dpl", "2", "-dpr", "2"], 2, 2),
        (["-dp", "4", "-n", "2", "-r", "1", "-dpl", "1"], 1, 2),  # start from --node-rank
        (["-dp", "2", "-tp", "2", "-n", "2", "-r", "1"], 1, 1),  # nodes share the whole world
    ],
)
def test_vllms_local_ranks_from_the_flags(flags: list[str], local: int, start: int) -> None:
    config = cli_config(*flags)
    assert (config.data_parallel_size_local, config.data_parallel_start_rank) == (local, start)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["-dp", "3", "--nnodes", "2"], ["`--nnodes 2`", "`--data-parallel-size`", "(3)"]),
        (["-dp", "4", "-n", "2", "-r", "2"], ["`--node-rank` must be between 0 and 1"]),
        (["-dp", "2", "-dph"], ["`--data-parallel-hybrid-lb` requires"]),
        (["-dp", "2", "-dpl", "4"], ["data_parallel_size_local (4) must be <="]),
    ],
)
def test_flags_vllm_refuses_are_refused(flags: list[str], words: list[str]) -> None:
    with pytest.raises(ValueError, match=re.escape(words[0])) as refused:
        cli_config(*flags)
    for word in words[1:]:
        assert word in str(refused.value)


async def test_without_the_header_the_less_busy_rank_serves(engines: Engines) -> None:
    _, client = await engines(slow(two_ranks()))
    long = generate_body(stream=True, sampling_params={"max_tokens": 20000, "ignore_eos": True})
    async with client.stream("POST", GENERATE_PATH, json=long, headers=pinned(0)) as stream:
        lines = stream.aiter_lines()
        assert (await anext(lines)).startswith("data: {")  # rank 0 is generating
        short = generate_body(request_id="short", sampling_params={"max_tokens": 2})
        assert (await client.post(GENERATE_PATH, json=short)).status_code == 200
        assert await by_engine(client, SUCCESS) == {"1": 1.0}


async def test_idle_ranks_take_turns_as_vllms_balancer_rotates(engines: Engines) -> None:
    _, client = await engines(two_ranks())
    for _ in range(4):
        await client.post(GENERATE_PATH, json=generate_body())
    assert await by_engine(client, SUCCESS) == {"0": 2.0, "1": 2.0}


async def test_kv_from_rank_1_of_a_producer_reaches_rank_0_of_a_consumer(
    engines: Engines,
) -> None:
    producer, prefill = await engines(two_ranks("prefill"))
    _, decode = await engines(two_ranks("decode"))
    _, aggregated = await engines(engine_config())
    handoff = {"kv_transfer_params": prefill_handoff_params(),
               "sampling_params": {"max_tokens": 1, "seed": 7}}  # fmt: skip
    other = await prefill.post(
        GENERATE_PATH, json=generate_body(request_id="other", **handoff), headers=pinned(0)
    )
    first = await prefill.post(GENERATE_PATH, json=generate_body(**handoff), headers=pinned(1))
    params = first.json()["kv_transfer_params"]
    assert params["remote_engine_id"] == f"{producer.config.engine_id}_dp1"
    assert other.json()["kv_transfer_params"]["remote_engine_id"].endswith("_dp0")
    held = await by_engine(prefill, KV_USAGE)
    assert held["0"] > 0
    assert held["1"] > 0

    response = await decode.post(
        GENERATE_PATH, json=generate_body(kv_transfer_params=params), headers=pinned(0)
    )
    assert response.status_code == 200, response.text
    expected = (await aggregated.post(GENERATE_PATH, json=generate_body())).json()
    assert response.json()["choices"] == expected["choices"]
    assert await by_engine(decode, "vllm:nixl_xfer_time_seconds_count") == {"0": 1.0, "1": 0.0}
    assert await by_engine(decode, SUCCESS) == {"0": 1.0}
    after = await by_engine(prefill, KV_USAGE)
    assert after == {"0": held["0"], "1": 0.0}  # rank 1's hold pulled, rank 0's untouched


async def test_a_pull_naming_an_engine_the_server_does_not_run_is_refused(
    engines: Engines,
) -> None:
    _, prefill = await engines(two_ranks("prefill"))
    _, decode = await engines(two_ranks("decode"))
    refused = await prefill.post(
        "/sim/kv/pull", json={"remote_engine_id": "elsewhere_dp0", "remote_request_id": "x"}
    )
    assert refused.status_code == 404
    assert "'elsewhere_dp0'" in refused.json()["error"]["message"]

    handoff = {"kv_transfer_params": prefill_handoff_params(),
               "sampling_params": {"max_tokens": 1, "seed": 7}}  # fmt: skip
    params = (await prefill.post(GENERATE_PATH, json=generate_body(**handoff))).json()
    moved = {**params["kv_transfer_params"], "remote_engine_id": "elsewhere_dp0"}
    response = await decode.post(GENERATE_PATH, json=generate_body(kv_transfer_params=moved))
    assert response.status_code == 500  # kv_load_failure_policy=fail
    assert "no engine 'elsewhere_dp0'" in response.json()["error"]["message"]


async def test_an_abort_reaches_the_rank_that_runs_or_holds_the_request(
    engines: Engines,
) -> None:
    _, client = await engines(slow(two_ranks()))
    handoff = {"kv_transfer_params": {"do_remote_decode": True},
               "sampling_params": {"max_tokens": 1}}  # fmt: skip
    await client.post(GENERATE_PATH, json=generate_body(request_id="held", **handoff),
                      headers=pinned(1))  # fmt: skip
    assert (await by_engine(client, KV_USAGE))["1"] > 0

    long = generate_body(
        request_id="long", stream=True, sampling_params={"max_tokens": 20000, "ignore_eos": True}
    )
    async with client.stream("POST", GENERATE_PATH, json=long, headers=pinned(1)) as stream:
        lines = stream.aiter_lines()
        assert (await anext(lines)).startswith("data: {")
        for request_id in ("long", "held"):
            assert (await client.post(ABORT_PATH, json=abort_body(request_id))).status_code == 200
        events = [json.loads(line[6:]) async for line in lines if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    assert await by_engine(client, KV_USAGE) == {"0": 0.0, "1": 0.0}
