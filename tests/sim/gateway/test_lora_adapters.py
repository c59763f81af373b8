"""LoRA adapters through the gateway, over simulated engines that serve them as `vllm serve
--enable-lora --lora-modules` does (an adapter changes what the model says): a request naming an
adapter is served under it on every route, render -> prefill -> decode -> derender included
(render passes the name on, as `vllm launch render` does with VLLM_SKIP_MODEL_NAME_VALIDATION),
and answers what an aggregated engine with the same adapter answers; a name neither the model
nor an adapter is refused before any engine works; /v1/models lists the adapters."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import pytest

from pdserve.sim.engine_config import EngineConfig
from tests.support.sim_gateway import MODEL, PLAIN, RENDER, Stack, engine, ep, routing, sse_events

ADAPTERS = {"sql": "/adapters/sql", "support": "/adapters/support"}


def with_adapters(config: EngineConfig) -> EngineConfig:
    render = dataclasses.replace(RENDER, adapters=ADAPTERS)
    return dataclasses.replace(config, adapters=ADAPTERS, render=render)


async def over_adapters(stack: Stack, *, render: bool) -> tuple[httpx.AsyncClient, str]:
    """A gateway over a prefill and a decode engine serving ADAPTERS (behind a render server that
    takes any name, or on the OpenAI route), and the URL of an aggregated engine with the same
    adapters, the reference."""
    prefill = await stack.engine("prefill", with_adapters(engine("prefill", api=api(render))))
    decode = await stack.engine("decode", with_adapters(engine("decode", api=api(render))))
    endpoints: dict[str, Any] = {"prefill": [ep(prefill)], "decode": [ep(decode)]}
    if render:
        endpoints["render"] = [ep(await stack.render(dataclasses.replace(RENDER, any_model=True)))]
    config = routing(api(render), render=render, endpoints=endpoints)
    config["adapters"] = list(ADAPTERS)
    reference = await stack.engine("both", with_adapters(engine("both", api="openai")))
    return await stack.gateway(config), reference


def api(render: bool) -> str:
    return "tokens" if render else "openai"


@pytest.mark.parametrize("render", [True, False], ids=["render-route", "openai-route"])
async def test_each_adapter_answers_as_an_aggregated_engine_with_it_and_unlike_the_base(
    stack: Stack, render: bool
) -> None:
    client, reference = await over_adapters(stack, render=render)
    async with httpx.AsyncClient(base_url=reference, timeout=30) as direct:
        answers = {}
        for name in (MODEL, *ADAPTERS):
            body = {**PLAIN, "model": name}
            served = (await client.post("/v1/chat/completions", json=body)).json()
            expected = (await direct.post("/v1/chat/completions", json=body)).json()
            assert served["model"] == name
            assert served["choices"][0]["message"] == expected["choices"][0]["message"], name
            assert served["usage"] == expected["usage"], name
            answers[name] = served["choices"][0]["message"]["content"]
    assert len(set(answers.values())) == len(answers), answers  # each adapter says its own
    assert stack.engines["decode"].core.prefix_queries == 0  # decode pulled prefill's KV
    events = await sse_events(client, {**PLAIN, "model": "sql"})
    assert events[-1] == "[DONE]"
    assert {e["model"] for e in events[:-1]} == {"sql"}
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                       if e["choices"])  # fmt: skip
    assert streamed == answers["sql"]


async def test_a_name_neither_the_model_nor_an_adapter_is_refused_naming_it(stack: Stack) -> None:
    client, _ = await over_adapters(stack, render=True)
    answer = await client.post("/v1/chat/completions", json={**PLAIN, "model": "sql-v2"})
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert (error["param"], error["message"]) == ("model", "The model `sql-v2` does not exist.")
    assert all(not e.core.steps for e in stack.engines.values())  # no engine saw it
    listed = await client.post("/v1/chat/completions", json={**PLAIN, "model": ["sql"]})
    assert (listed.status_code, listed.json()["error"]["param"]) == (404, "model")


async def test_models_lists_the_adapters_with_the_model_as_parent(stack: Stack) -> None:
    client, _ = await over_adapters(stack, render=False)
    listed = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [
        (MODEL, None), ("sql", MODEL), ("support", MODEL),
    ]  # fmt: skip


async def test_an_engine_without_the_adapters_is_kept_out_naming_them(stack: Stack) -> None:
    """Two decode engines of one parity hash, one started without the adapters (a hand-edited
    pod): the replica check routes the two that agree and keeps it out, naming `adapters`."""
    plain = engine("both", api="openai")
    urls = {name: await stack.engine(name, config) for name, config in (
        ("a", with_adapters(plain)), ("b", with_adapters(plain)), ("odd", plain))}  # fmt: skip
    decode = [ep(url) | {"name": name} for name, url in urls.items()]
    config = routing("openai", prefill=False, render=False, endpoints={"decode": decode})
    client = await stack.gateway({**config, "adapters": list(ADAPTERS), "replicaCheck": "Enforce"})
    for _ in range(4):
        answer = await client.post("/v1/chat/completions", json={**PLAIN, "model": "sql"})
        assert answer.status_code == 200, answer.text
    checked = (await client.get("/status")).json()["replicaCheck"]["decode"]
    assert checked["a"] == checked["b"] == {"verdict": "Verified"}
    assert checked["odd"]["verdict"] == "Mismatch"
    assert checked["odd"]["reason"].startswith("adapters differ"), checked["odd"]
