"""The three vLLM servers the simulated engine stands in for, as vLLM 0.32 serves them: the
endpoints each registers (`--tokens-only`, `--enable-scale-out`, plain `vllm serve`), how the
generate API names its requests and what aborts them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.sim.cli import engine_config as config_of_args
from pdserve.sim.cli import engine_parser
from pdserve.vllm.protocol import ABORT_PATH, GENERATE_PATH, abort_body, generate_request_id
from tests.support.sim_engine import Engines, engine_config, generate_body

CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def test_the_generate_api_names_a_request_generate_tokens_and_its_id() -> None:
    assert generate_request_id("pdserve-1f") == "generate-tokens-pdserve-1f"
    assert abort_body("pdserve-1f") == {"request_ids": ["generate-tokens-pdserve-1f"]}


@pytest.mark.parametrize(
    ("flags", "api"),
    [
        (["--tokens-only"], "tokens"),
        (["--enable-scale-out"], "scale_out"),
        ([], "openai"),
        (["--tokens-only", "--enable-scale-out"], "tokens"),
        (["--tokens-only", "--api", "openai"], "openai"),  # the simulator's own flag wins
    ],
)
def test_vllms_flags_choose_the_api(flags: list[str], api: str) -> None:
    assert config_of_args(engine_parser().parse_args(["m", *flags])).api == api


@pytest.mark.parametrize(
    ("api", "served"),
    [
        ("tokens", {GENERATE_PATH, ABORT_PATH, "/abort_requests"}),
        ("scale_out", {GENERATE_PATH, ABORT_PATH, "/v1/chat/completions"}),
        ("openai", {"/v1/chat/completions"}),  # plain `vllm serve`: no abort endpoint at all
    ],
)
async def test_each_api_registers_what_vllm_registers(
    engines: Engines, api: str, served: set[str]
) -> None:
    _, client = await engines(engine_config(api=api))
    bodies: dict[str, Any] = {
        GENERATE_PATH: generate_body(sampling_params={"max_tokens": 2}),
        ABORT_PATH: abort_body("nothing"),
        "/abort_requests": abort_body("nothing"),
        "/v1/chat/completions": CHAT,
    }
    found = set()
    for path, body in bodies.items():
        response = await client.post(path, json=body)
        assert response.status_code in (200, 404), (path, response.text)
        if response.status_code == 200:
            found.add(path)
    assert found == served


async def test_the_header_names_the_request_before_the_body(engines: Engines) -> None:
    _, client = await engines(engine_config())
    by_body = await client.post(GENERATE_PATH, json=generate_body(request_id="body-id"))
    assert by_body.json()["request_id"] == "generate-tokens-body-id"
    by_header = await client.post(
        GENERATE_PATH, json=generate_body(request_id="body-id"), headers={"X-Request-Id": "hdr"}
    )
    assert by_header.json()["request_id"] == "generate-tokens-hdr"


@pytest.mark.parametrize("api", ["tokens", "scale_out"])
async def test_only_the_engines_name_aborts_a_stream_which_then_ends_with_abort(
    engines: Engines, api: str
) -> None:
    server, client = await engines(engine_config(api=api))
    body = generate_body(stream=True, sampling_params={"max_tokens": 1500, "ignore_eos": True})
    headers = {"X-Request-Id": "pdserve-7"}
    async with client.stream("POST", GENERATE_PATH, json=body, headers=headers) as response:
        lines = response.aiter_lines()
        first = [line async for line in _data(lines, 3)]
        # The bare id (what pdserve used to send) names nothing on the engine.
        assert (
            await client.post(ABORT_PATH, json={"request_ids": ["pdserve-7"]})
        ).status_code == 200
        assert [s.request_id for s in server.core.running] == ["generate-tokens-pdserve-7"]
        assert (await client.post(ABORT_PATH, json=abort_body("pdserve-7"))).status_code == 200
        assert not server.core.running  # at once: the abort is synchronous in the engine
        rest = [line async for line in _data(lines)]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort"
    assert len(first) + len(rest) < 1500


async def test_aborting_a_request_aborts_every_choice_of_it(engines: Engines) -> None:
    server, client = await engines(engine_config())
    body = generate_body(
        stream=True, sampling_params={"max_tokens": 1500, "ignore_eos": True, "n": 3}
    )
    async with client.stream("POST", GENERATE_PATH, json=body) as response:
        lines = response.aiter_lines()
        _ = [line async for line in _data(lines, 3)]
        assert len(server.core.running) == 3
        await client.post(ABORT_PATH, json=abort_body("req-1"))
        assert not server.core.running
        rest = [line async for line in _data(lines)]
    finishes = [
        json.loads(line.removeprefix("data: "))["choices"][0]["finish_reason"] for line in rest[:-1]
    ]
    assert finishes.count("abort") == 3


async def _data(lines: Any, count: int | None = None) -> Any:
    """The `data:` lines of a stream: `count` of them, or all that are left."""
    taken = 0
    async for line in lines:
        if line.startswith("data: "):
            yield line
            taken += 1
            if count is not None and taken == count:
                return
