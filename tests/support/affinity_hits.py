"""How much of a multi-turn chat workload's prompts the engines' prefix caches serve, behind
each request path: the Python gateway, the compiled data plane, and the data plane picking by
load alone (its routing table without `placement`, as before it had one). Simulated engines
behind a render server (token ids: the prefix index works) on loopback, Aggregated mode.

    python -m tests.support.affinity_hits [--engines 4] [--conversations 24] [--turns 5]

Prints each path's prefix-cache hits over the prompt tokens the engines looked up (the
simulator's vllm:prefix_cache_hits / _queries). Each conversation starts with its own system
prompt, so only the engines that served its earlier turns hold its prefix."""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any
from unittest import mock

from pdserve.gateway import dataplane, fastpath
from tests.support.sim_gateway import PLAIN, Stack, engine, ep, routing

PATHS = ("python", "dataplane", "dataplane-load-alone")
SYSTEM = " ".join(["You answer questions about the weather, briefly and politely."] * 20)


@contextmanager
def load_alone(path: str) -> Iterator[None]:
    """For dataplane-load-alone, routing tables without the placement rule."""
    if path != "dataplane-load-alone":
        yield
        return
    original = fastpath.routing_table

    def without_placement(*args: Any, **kwargs: Any) -> dict[str, Any]:
        table = original(*args, **kwargs)
        table.pop("placement")
        return table

    with mock.patch.object(dataplane, "routing_table", without_placement):
        yield


async def hits(path: str, engines: int, conversations: int, turns: int) -> tuple[int, int]:
    """(prefix-cache hits, prompt tokens looked up) over every engine."""
    async with AsyncExitStack() as exits:
        stack = Stack(exits)
        render = await stack.render()
        urls = [await stack.engine(f"e{i}", engine("both")) for i in range(engines)]
        endpoints = {"render": [ep(render)], "decode": [ep(url) for url in urls]}
        client = await stack.gateway(
            routing(prefill=False, endpoints=endpoints),
            data_plane=path != "python",
            load_scrape_seconds=0.5,
        )
        rng = random.Random(7)
        concurrent = asyncio.Semaphore(6)

        async def conversation(number: int) -> None:
            messages = [{"role": "system", "content": f"Session {number}. {SYSTEM}"}]
            for turn in range(turns):
                question = f"question {turn} " + "x " * rng.randrange(5, 40)
                messages.append({"role": "user", "content": question})
                body = {**PLAIN, "messages": messages, "max_tokens": 30,
                        "conversation_id": f"c-{number}"}  # fmt: skip
                async with concurrent:
                    answer = await client.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
                said = answer.json()["choices"][0]["message"]["content"] or "ok"
                messages.append({"role": "assistant", "content": said})

        await asyncio.gather(*(conversation(n) for n in range(conversations)))
        if path != "python":
            stats = await stack.data_plane_stats()
            assert stats["fallbacks"] == {}, f"the data plane handed requests over: {stats}"
        cores = [server.core for server in stack.engines.values()]
        return sum(c.prefix_hits for c in cores), sum(c.prefix_queries for c in cores)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("paths", nargs="*", metavar="PATH", help=f"of {', '.join(PATHS)} (all)")
    args = parser.parse_args()
    if unknown := set(args.paths) - set(PATHS):
        parser.error(f"PATH: {', '.join(sorted(unknown))} is none of {', '.join(PATHS)}")
    args.paths = args.paths or list(PATHS)
    print(f"{args.conversations} conversations of {args.turns} turns, {args.engines} engines")
    for path in args.paths:
        with load_alone(path):
            hit, looked_up = await hits(path, args.engines, args.conversations, args.turns)
        print(f"{path}: {hit} of {looked_up} prompt tokens from the prefix cache "
              f"({hit / looked_up:.1%})", flush=True)  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
