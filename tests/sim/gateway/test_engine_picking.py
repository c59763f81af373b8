"""How the gateway picks an engine: load scraped from the engines' metrics, prefix cache and
conversation affinity, and streams counted on their engine as soon as they open."""

from __future__ import annotations

import asyncio

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


async def test_repeated_prefixes_and_conversations_stay_on_one_engine(stack: Stack) -> None:
    render = await stack.render()
    urls = {name: await stack.engine(name, engine("both")) for name in ("first", "second")}
    client = await stack.gateway(
        routing(
            prefill=False,
            endpoints={"render": [ep(render)], "decode": [ep(urls["first"]), ep(urls["second"])]},
        ),
        load_scrape_seconds=None,
    )
    endpoints = {e.url: e for e in stack.gateway_server.endpoints.pools["decode"]}

    def busy(name: str) -> None:
        # Busier than the other engine, within the slack: plain load-based picking would move.
        endpoints[urls[name]].running = 2

    def engine_that_grew(before: dict[str, int]) -> list[str]:
        return [n for n in urls if stack.engines[n].core.prefix_queries > before[n]]

    def queries() -> dict[str, int]:
        return {n: stack.engines[n].core.prefix_queries for n in urls}

    before = queries()
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    [holder] = engine_that_grew(before)
    busy(holder)
    before = queries()
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    assert engine_that_grew(before) == [holder]  # its prefix cache beat the lighter engine
    assert stack.engines[holder].core.prefix_hits > 0

    for endpoint in endpoints.values():
        endpoint.running = 0
    before = queries()
    body = {**PLAIN, "messages": [{"role": "user", "content": "hello"}], "conversation_id": "c-7"}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    [home] = engine_that_grew(before)
    busy(home)
    for turn in ("tell me more", "and then"):
        before = queries()
        body = {**PLAIN, "messages": [{"role": "user", "content": turn}], "conversation_id": "c-7"}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        assert engine_that_grew(before) == [home]  # the conversation stays put


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
