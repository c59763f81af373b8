"""How the gateway picks an engine: load scraped from the engines' metrics, prefix cache and
conversation affinity, and streams counted on their engine as soon as they open."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import LONG, PLAIN, Stack, engine, ep, finished, routing, sse_events


async def test_engine_load_is_scraped_from_their_metrics(stack: Stack) -> None:
    render = await stack.render()
    decode = await stack.engine("both", engine("both"))
    await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(render)], "decode": [ep(decode)]}),
        load_scrape_seconds=0.05,
    )
    stack.engines["both"].core.waiting.append(object())  # type: ignore[arg-type]
    [endpoint] = stack.gateway_server.endpoints.pools["decode"]

    async def scraped() -> None:
        while endpoint.waiting != 1:  # noqa: ASYNC110 - the scraper task updates it
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(scraped(), timeout=5)
    finally:
        stack.engines["both"].core.waiting.clear()


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_repeated_prefixes_and_conversations_stay_on_one_engine(
    stack: Stack, request_path: str
) -> None:
    render = await stack.render()
    urls = {name: await stack.engine(name, engine("both")) for name in ("first", "second")}
    client = await stack.gateway(
        routing(
            prefill=False,
            endpoints={"render": [ep(render)], "decode": [ep(urls["first"]), ep(urls["second"])]},
        ),
        data_plane=request_path == "dataplane",
        load_scrape_seconds=None,
    )
    endpoints = {e.url: e for e in stack.gateway_server.endpoints.pools["decode"]}

    async def busy(name: str) -> None:
        # Busier than the other engine, within the slack: plain load-based picking would move.
        endpoints[urls[name]].running = 2
        await stack.push_table()

    def engine_that_grew(before: dict[str, int]) -> list[str]:
        return [n for n in urls if stack.engines[n].core.prefix_queries > before[n]]

    def queries() -> dict[str, int]:
        return {n: stack.engines[n].core.prefix_queries for n in urls}

    before = queries()
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    [holder] = engine_that_grew(before)
    await busy(holder)
    before = queries()
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    assert engine_that_grew(before) == [holder]  # its prefix cache beat the lighter engine
    assert stack.engines[holder].core.prefix_hits > 0

    for endpoint in endpoints.values():
        endpoint.running = 0
    await stack.push_table()
    before = queries()
    body = {**PLAIN, "messages": [{"role": "user", "content": "hello"}], "conversation_id": "c-7"}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    [home] = engine_that_grew(before)
    await busy(home)
    for turn in ("tell me more", "and then"):
        before = queries()
        body = {**PLAIN, "messages": [{"role": "user", "content": turn}], "conversation_id": "c-7"}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        assert engine_that_grew(before) == [home]  # the conversation stays put
    if request_path == "dataplane":
        stats = await stack.data_plane_stats()
        assert stats["fallbacks"] == {}  # the data plane picked every engine itself


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_a_conversation_keeps_its_prefill_and_decode_engines_on_the_openai_route(
    stack: Stack, request_path: str
) -> None:
    """Without render servers there are no token ids to hash: the conversation alone (its id
    in the body or in X-Conversation-Id) keeps each hop on the engine it used last, though
    that engine is busier than another."""
    names = ("prefill-1", "prefill-2", "decode-1", "decode-2")
    urls = {n: await stack.engine(n, engine(n.split("-")[0], api="openai")) for n in names}
    pools = {role: [ep(urls[f"{role}-{i}"]) for i in (1, 2)] for role in ("prefill", "decode")}
    client = await stack.gateway(
        routing("openai", render=False, endpoints=pools),
        data_plane=request_path == "dataplane",
        load_scrape_seconds=None,
    )
    by_url = {e.url: e for pool in stack.gateway_server.endpoints.pools.values() for e in pool}

    def served() -> dict[str, float]:
        return {n: finished(stack.engines[n]) for n in names}

    def grew(before: dict[str, float]) -> list[str]:
        return sorted(n for n, count in served().items() if count > before[n])

    before = served()
    first = {**PLAIN, "messages": [{"role": "user", "content": "hello"}], "conversation_id": "c-9"}
    assert (await client.post("/v1/chat/completions", json=first)).status_code == 200
    home = grew(before)
    assert len(home) == 2, home  # one prefill, one decode
    for name in home:
        by_url[urls[name]].running = 2  # busier, within the slack
    await stack.push_table()
    for turn, ask in (("more", {"conversation_id": "c-9"}), ("again", {})):
        before = served()
        body = {**PLAIN, "messages": [{"role": "user", "content": turn}], **ask}
        headers = {} if ask else {"X-Conversation-Id": "c-9"}
        answer = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert answer.status_code == 200
        assert grew(before) == home  # both hops stay put
    before = served()
    other = {**PLAIN, "messages": [{"role": "user", "content": "hi"}], "conversation_id": "c-10"}
    assert (await client.post("/v1/chat/completions", json=other)).status_code == 200
    assert set(grew(before)).isdisjoint(home)  # a new conversation goes by load
    if request_path == "dataplane":
        stats = await stack.data_plane_stats()
        assert stats["fallbacks"] == {}


async def test_openai_streams_count_on_their_engine_at_once(stack: Stack) -> None:
    """Two streams sent before any metrics scrape land on different engines: the gateway
    counts a stream (and its prompt still to prefill) on its engine when it opens it."""
    urls = [await stack.engine(n, engine("both", api="openai")) for n in ("first", "second")]
    client = await stack.gateway(
        routing("openai", render=False, prefill=False,
                endpoints={"decode": [ep(u) for u in urls]}),
        load_scrape_seconds=None,
    )  # fmt: skip
    streams = [asyncio.create_task(sse_events(client, LONG)) for _ in range(2)]
    for events in await asyncio.gather(*streams):
        assert events[-1] == "[DONE]"
    assert [finished(stack.engines[n]) for n in ("first", "second")] == [1, 1]
    pool = stack.gateway_server.endpoints.pools["decode"]
    assert [(e.inflight, e.prefill_backlog) for e in pool] == [(0, 0), (0, 0)]
