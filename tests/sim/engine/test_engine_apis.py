"""The three vLLM servers the simulated engine stands in for, as vLLM 0.32 serves them: the
endpoints each registers (`--tokens-only`, `--enable-scale-out`, plain `vllm serve`), how the
generate API names its requests and what aborts them, and what an engine without a tokenizer
refuses while one with a tokenizer serves it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from pdserve.sim.cli import engine_config as config_of_args
from pdserve.sim.cli import engine_parser
from pdserve.sim.engine_tokens import STOP_NEEDS_DETOKENIZER, STRUCTURED_NEEDS_TOKENIZER
from pdserve.vllm.protocol import ABORT_PATH, GENERATE_PATH, abort_body, generate_request_id
from tests.support.sim_engine import TOKENIZER, Engines, engine_config, generate_body

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


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"stop": ["\n"]}, STOP_NEEDS_DETOKENIZER),
        ({"stop": [""]}, STOP_NEEDS_DETOKENIZER),
        ({"structured_outputs": {"json": {"type": "object"}}}, STRUCTURED_NEEDS_TOKENIZER),
        ({"structured_outputs": {"json_object": True}}, STRUCTURED_NEEDS_TOKENIZER),
    ],
)
async def test_a_tokens_only_engine_refuses_what_needs_a_tokenizer_in_vllms_words(
    engines: Engines, params: dict[str, Any], message: str
) -> None:
    _, tokens_only = await engines(engine_config(api="tokens"))
    _, scale_out = await engines(engine_config(api="scale_out"))
    body = generate_body(sampling_params={"max_tokens": 20, "seed": 7, **params})
    refused = await tokens_only.post(GENERATE_PATH, json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == message
    assert (await scale_out.post(GENERATE_PATH, json=body)).status_code == 200


async def test_no_stop_strings_or_constraint_is_no_refusal(engines: Engines) -> None:
    _, client = await engines(engine_config(api="tokens"))
    body = generate_body(sampling_params={"max_tokens": 5, "stop": [], "structured_outputs": None})
    assert (await client.post(GENERATE_PATH, json=body)).status_code == 200


async def test_an_engine_with_a_tokenizer_stops_at_a_stop_string(engines: Engines) -> None:
    _, client = await engines(engine_config(api="scale_out"))
    natural = await _answer(client, {"max_tokens": 200, "seed": 7})
    assert natural["finish_reason"] == "stop"
    ids = natural["token_ids"]
    # A stop string in the middle of the answer: where it first appears in the text.
    stop = TOKENIZER.decode(ids[len(ids) // 2 : len(ids) // 2 + 1]).strip()
    cut = next(
        n for n in range(1, len(ids) + 1)
        if stop in TOKENIZER.decode(ids[:n], skip_special_tokens=True)
    )  # fmt: skip
    stopped = await _answer(client, {"max_tokens": 200, "seed": 7, "stop": [stop]})
    assert (stopped["token_ids"], stopped["finish_reason"]) == (ids[:cut], "stop")
    # Not before min_tokens: a stop string completed earlier does not end the answer.
    later = await _answer(
        client, {"max_tokens": 200, "seed": 7, "stop": [stop], "min_tokens": cut + 1}
    )
    assert len(later["token_ids"]) > cut


async def _answer(client: httpx.AsyncClient, params: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(GENERATE_PATH, json=generate_body(sampling_params=params))
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice
