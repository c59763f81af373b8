"""Admission of long prefills: short prompts overtaking queued documents, aging, room on another
prefill replica, and gateway replicas admitting through one leader (holds, a leader that
cannot grant, a follower refusing)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest
from aiohttp import web

from tests.support.served_gateway import REQUEST_PATHS
from tests.support.serving import serving
from tests.support.sim_gateway import (
    LONG,
    PEER_KEY,
    PLAIN,
    Stack,
    engine,
    ep,
    finished,
    gateway_replicas,
    local_listener,
    pd_stack,
    python_gateways_only,
    routing,
    until,
)


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_short_prompts_overtake_queued_documents_and_aging_bounds_their_wait(
    stack: Stack, request_path: str
) -> None:
    from pdserve.gateway.fairqueue import FairQueueSettings

    client = await pd_stack(
        stack,
        fair_queue=FairQueueSettings(
            long_prompt_tokens=500, max_long_per_replica=1, max_wait_seconds=0.5
        ),
        data_plane=request_path == "dataplane",
    )
    prefill_port = stack.engines["prefill"].config.port
    async with httpx.AsyncClient() as admin:
        await admin.post(f"http://127.0.0.1:{prefill_port}/sim/faults", json={"hang": 1})
    stuck = asyncio.create_task(client.post("/v1/chat/completions", json=LONG, timeout=30))
    await stack.admission_until(lambda queue: queue.long_in_flight == 1)  # it holds the slot
    queued = asyncio.create_task(client.post("/v1/chat/completions", json=LONG))
    await stack.admission_until(lambda queue: queue.queued == 1)
    assert (await client.get("/metrics")).text.count("pdserve_gateway_prefill_queue_long 1.0") == 1
    chat = await client.post("/v1/chat/completions", json=PLAIN)  # a chat does not wait
    assert chat.status_code == 200
    assert not queued.done()
    assert (await queued).status_code == 200  # admitted by aging although the slot stays busy
    assert (await stack.admission()).aged == 1
    stuck.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await stuck


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_a_long_prefill_goes_to_a_replica_with_room_even_against_affinity(
    stack: Stack, request_path: str
) -> None:
    """Limit 1 per prefill replica: a conversation's documents prefer the replica that served
    it, but while one of them prefills there the next goes to the other replica."""
    from pdserve.gateway.fairqueue import FairQueueSettings

    render = await stack.render()
    prefills = [await stack.engine(name, engine("prefill")) for name in ("p0", "p1")]
    decode = await stack.engine("decode", engine("decode"))
    endpoints = {"render": [ep(render)], "prefill": [ep(u) for u in prefills],
                 "decode": [ep(decode)]}  # fmt: skip
    fair = FairQueueSettings(long_prompt_tokens=500, max_long_per_replica=1, max_wait_seconds=30)
    client = await stack.gateway(
        routing(endpoints=endpoints), fair_queue=fair, data_plane=request_path == "dataplane"
    )
    turn = {**LONG, "conversation_id": "c-1"}
    assert (await client.post("/v1/chat/completions", json=turn)).status_code == 200
    served = [name for name in ("p0", "p1") if stack.engines[name].core.prefix_queries]
    assert len(served) == 1  # the conversation's replica
    async with httpx.AsyncClient() as admin:
        for url in prefills:
            await admin.post(f"{url}/sim/faults", json={"hang": 2})
    documents = [
        asyncio.create_task(client.post("/v1/chat/completions", json=turn)) for _ in range(2)
    ]

    def hung() -> dict[str, int]:
        return {name: 2 - stack.engines[name].faults.hang for name in ("p0", "p1")}

    await until(lambda: sum(hung().values()) == 2)
    assert hung() == {"p0": 1, "p1": 1}  # not both on the conversation's replica
    for task in documents:
        task.cancel()
    await asyncio.gather(*documents, return_exceptions=True)


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_a_long_prompt_moves_to_another_prefill_replica_when_its_own_fails(
    stack: Stack, request_path: str
) -> None:
    """The replica a document was granted answers 5xx: its slot goes back and the next replica
    with room prefills it, rather than falling back to local prefill on decode."""
    from pdserve.gateway.fairqueue import FairQueueSettings

    render = await stack.render()
    prefills = [await stack.engine(name, engine("prefill")) for name in ("p0", "p1")]
    decode = await stack.engine("decode", engine("decode"))
    endpoints = {"render": [ep(render)], "prefill": [ep(u) for u in prefills],
                 "decode": [ep(decode)]}  # fmt: skip
    fair = FairQueueSettings(long_prompt_tokens=500, max_long_per_replica=1)
    client = await stack.gateway(routing(endpoints=endpoints), fair_queue=fair,
                                 load_scrape_seconds=None,
                                 data_plane=request_path == "dataplane")  # fmt: skip
    stack.gateway_server.endpoints.pools["prefill"][1].running = 1  # p0 is the first choice
    await stack.push_table()
    async with httpx.AsyncClient() as admin:
        await admin.post(f"{prefills[0]}/sim/faults", json={"http_5xx": 1})
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    assert [finished(stack.engines[n]) for n in ("p0", "p1")] == [0, 1]
    await stack.fold_stats()
    metrics = (await client.get("/metrics")).text
    assert "prefill_failed" not in metrics
    assert 'pdserve_gateway_retries_total{reason="upstream_error",stage="prefill"} 1.0' in metrics
    assert (await stack.admission()).replicas == {}


@python_gateways_only
async def test_gateway_replicas_admit_long_prefills_through_one_leader_exactly(
    stack: Stack,
) -> None:
    """Limit 1 over one prefill replica: documents sent to both replicas in the same instant
    reach the engine one at a time (each replica deciding alone admits one each: 2 at once).
    The leader queues everyone's in arrival order; a follower's client leaving frees its slot
    on the leader for the next document, whichever replica it came through."""
    replicas = await gateway_replicas(stack, hang=10)
    leader = replicas.gateways[replicas.leader]
    # The follower's document first: its slot is held on the leader.
    first = asyncio.create_task(
        replicas.clients[replicas.follower].post("/v1/chat/completions", json=LONG)
    )
    await until(lambda: replicas.reached_prefill(10) == 1)
    # The follower reports the slot it holds through the leader (counted if the leader dies).
    held = (await replicas.clients[replicas.follower].get("/admission")).json()["heldAt"]
    assert held == {replicas.urls[replicas.leader]: dict(leader.admission.in_flight)}
    assert sum(leader.admission.in_flight.values()) == 1
    burst = [
        asyncio.create_task(client.post("/v1/chat/completions", json=LONG))
        for client in replicas.clients * 2
    ]

    def accounted() -> int:
        return sum(len(g.admission.queue) for g in replicas.gateways) + replicas.reached_prefill(10)

    await until(lambda: accounted() == 5)  # all five documents queued or at the engine
    assert replicas.reached_prefill(10) == 1
    assert (leader.admission.long_in_flight, len(leader.admission.queue)) == (1, 4)
    assert (await replicas.clients[replicas.follower].get("/status")).json()["admission"] == {
        "leader": replicas.urls[replicas.leader],
        "peers": [replicas.urls[replicas.leader]],
    }
    assert replicas.gateways[replicas.follower].admission.long_in_flight == 0  # it decides nothing
    state = (await replicas.clients[replicas.follower].get("/metrics")).text
    assert "pdserve_gateway_admission_leader_errors 0.0" in state

    first.cancel()  # its client leaves: the follower closes its hold, the leader passes it on
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await first
    await until(lambda: len(leader.admission.queue) == 3)
    assert leader.admission.long_in_flight == 1
    assert replicas.reached_prefill(10) == 2
    assert leader.admission.aged == 0  # passed on by the release, not by aging
    for task in burst:
        task.cancel()
    await asyncio.gather(*burst, return_exceptions=True)
    await until(lambda: leader.admission.long_in_flight == 0 and not leader.admission.queue)


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_a_malformed_hold_request_is_refused_naming_the_field(
    stack: Stack, request_path: str
) -> None:
    client = await pd_stack(stack, peer_keys=(PEER_KEY,), data_plane=request_path == "dataplane")
    peer = {"Authorization": f"Bearer {PEER_KEY}"}
    bodies: list[Any] = [{}, {"replicas": "http://p0"}, {"replicas": []}, {"replicas": [3]}, [1]]
    for body in bodies:
        answer = await client.post("/admission/hold", json=body, headers=peer)
        assert answer.status_code == 400, body
        assert answer.json()["error"]["param"] == "replicas"
    assert (await stack.admission()).long_in_flight == 0


@python_gateways_only
@pytest.mark.parametrize("leader", ["without /admission/hold", "stuck"])
async def test_a_replica_that_cannot_ask_the_leader_admits_on_its_own(
    stack: Stack, leader: str
) -> None:
    """A peer that sorts lowest, so it leads, but cannot grant: an older replica without
    /admission/hold, or a stuck one that accepts the hold and never answers (no grant within
    twice the aging bound). The replicas admit on their own, counting what each other holds,
    and say so in a metric; no request is lost."""
    stand_in = web.Application()

    async def admission(_: web.Request) -> web.Response:
        return web.json_response({"longInFlight": 0, "queued": 0})

    async def stuck(_: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    stand_in.router.add_get("/admission", admission)
    if leader == "stuck":
        stand_in.router.add_post("/admission/hold", stuck)
    # A port with many free ports' URLs sorting after it.
    sock, lowest = local_listener(below="http://127.0.0.1:6")
    await stack.exits.enter_async_context(serving(stand_in, sock=sock))
    replicas = await gateway_replicas(stack, hang=0, extra_peers=(lowest,), max_wait=0.2)
    await until(lambda: all(g.peers.leader() == lowest for g in replicas.gateways))
    answers = await asyncio.gather(
        *(client.post("/v1/chat/completions", json=LONG) for client in replicas.clients)
    )
    assert [a.status_code for a in answers] == [200, 200]
    assert [g.peers.leader_errors for g in replicas.gateways] == [1, 1]
    state = (await replicas.clients[0].get("/metrics")).text
    assert "pdserve_gateway_admission_leader_errors 1.0" in state


@python_gateways_only
async def test_only_the_leader_grants_holds(stack: Stack) -> None:
    """A follower refuses holds: two queues at once would break the limit."""
    replicas = await gateway_replicas(stack, hang=0)
    follower = replicas.clients[replicas.follower]
    body = {"replicas": ["http://p0"]}
    peer = {"Authorization": f"Bearer {PEER_KEY}"}
    refused = await follower.post("/admission/hold", json=body, headers=peer)
    assert refused.status_code == 409
    assert replicas.urls[replicas.leader] in refused.json()["error"]["message"]


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_with_api_keys_a_hold_needs_one(stack: Stack, request_path: str) -> None:
    """A slot held blocks every replica's documents: with API keys set, holding one takes a
    key; closing the hold releases the slot."""
    body = {"replicas": ["http://p0"]}
    keyed = await pd_stack(stack, api_keys=("secret",), data_plane=request_path == "dataplane")
    assert (await keyed.post("/admission/hold", json=body)).status_code == 401
    auth = {"Authorization": "Bearer secret"}
    async with keyed.stream("POST", "/admission/hold", json=body, headers=auth) as granted:
        assert granted.status_code == 200
        assert await granted.aiter_lines().__anext__() == "granted http://p0"
        assert (await stack.admission()).replicas == {"http://p0": 1}
    await stack.admission_until(lambda queue: not queue.replicas)  # closed: released
