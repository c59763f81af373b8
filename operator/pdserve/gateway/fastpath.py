"""The routing table the compiled data plane (gateway/dataplane, Go) serves from: which requests
it may serve itself and on which engines, derived from the same state the Python gateway routes
by. A pure function of that state, so what the data plane does is decided here, in one place.

The data plane serves a model's requests itself only where the Python gateway would do nothing
per request that the table cannot say: routing mode Disaggregated (P/D on every request),
Aggregated (straight to decode) or Auto (P/D or local prefill, decided per request in the data
plane from the view of Auto mode's model pushed here: `auto_table`), with engines that speak
OpenAI or behind render servers (render -> P/D -> derender, streamed through the same derender
pipeline or not), keeping the request log's entries of what it serves when the gateway keeps
one (`request_log_table`), picking engines by where a request's KV probably is as Placement
does (`PLACEMENT`, each model's `blockSize`), keeping bidirectional KV as the Python gateway
does (each conversation's KV on decode pointed at by its next prefill, and the budget of what
decode holds: `bidirectional_table`), and serving the bodies it cannot prove valid cheaply once
this gateway's intake judged them (app.py intake_for_data_plane). Long prompts (by body size,
or by rendered token count behind render servers) wait for a fair prefill admission slot in
this replica's queue, which the data plane runs (`admission`), or, while another gateway
replica leads admission, ask this gateway."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.affinity import CONVERSATION_BONUS, MAX_BLOCKS_PER_ENGINE, MAX_CONVERSATIONS
from pdserve.gateway.dataplane_metrics import ROUTES
from pdserve.gateway.endpoints import (
    AFFINITY_SLACK,
    PREFILL_TOKENS_PER_LOAD_UNIT,
    Endpoint,
    Endpoints,
    NoEndpoints,
    Selection,
)
from pdserve.gateway.held_kv import MAX_HOLDS, DecodeHolds
from pdserve.gateway.policy import AutoPolicy
from pdserve.gateway.settings import GatewaySettings

PD, DECODE, AUTO, UNAVAILABLE = "pd", "decode", "auto", "unavailable"
BYTES_PER_PROMPT_TOKEN = 4
"""How the gateway estimates prompt tokens from characters (exchange.estimated_prompt_tokens):
the body-size threshold for fair admission is the long-prompt threshold in these units."""

PLACEMENT = {
    "affinitySlack": AFFINITY_SLACK,
    "conversationBonus": CONVERSATION_BONUS,
    "maxBlocksPerEngine": MAX_BLOCKS_PER_ENGINE,
    "maxConversations": MAX_CONVERSATIONS,
    "prefillTokensPerLoadUnit": PREFILL_TOKENS_PER_LOAD_UNIT,
}
"""How the data plane picks among engines by where a request's KV probably is and by load, as
Placement and Endpoints.pick do (the shared cases: dataplane/testdata/placement_cases.json)."""


def route_of(config: GatewayConfig) -> str:
    """The route the data plane takes for this model's requests, its engines permitting."""
    mode = config.routing.mode
    if mode == "Aggregated" or config.pools.prefill is None:
        return DECODE
    return PD if mode == "Disaggregated" else AUTO


class Engines(NamedTuple):
    """The render servers (behind which the engines take token ids; none for OpenAI engines)
    and the engine groups the data plane may pair; no groups when no complete set is routable,
    and then why; with `local_prefill`, every request prefills on decode for that reason
    (planner.settle's fallbacks: the P/D pair is missing, the pools are not broken)."""

    render: list[str]
    groups: list[dict[str, list[str]]]
    why: str | None = None
    local_prefill: str | None = None


def engines(config: GatewayConfig, endpoints: Endpoints, route: str) -> Engines:
    """The engines the data plane may pair: per KV-compatibility digest and slice, the prefill
    replicas and the decode replicas that can pull their KV, as the Python gateway would choose
    them (one parity-consistent set of every pool, healthy, replica-checked,
    transport-verified when Required)."""
    needed = ["render", "decode"] if config.engine_api == "tokens" else ["decode"]
    try:
        selection = endpoints.select(needed, ["prefill"])
    except NoEndpoints as error:
        return Engines([], [], str(error))
    render = urls(selection.pools.get("render", []))
    decode = selection.pools["decode"]
    if route == DECODE:
        return Engines(render, [{"prefill": [], "decode": urls(decode)}])
    groups, why, local = pd_groups(config, selection)
    if route == AUTO or local is not None:
        # Local prefill runs on any decode replica: those no prefill replica pairs with too.
        paired = {url for g in groups for url in g["decode"]}
        if unpaired := [url for url in urls(decode) if url not in paired]:
            groups.append({"prefill": [], "decode": unpaired})
        if route == AUTO:  # Auto decides each request local itself (and where: auto.go)
            return Engines(render, groups)
        return Engines(render, groups, why, local)
    return Engines(render, groups, why)


def pd_groups(
    config: GatewayConfig, selection: Selection
) -> tuple[list[dict[str, list[str]]], str | None, str | None]:
    """Per KV-compatibility digest and slice, the prefill replicas that may take P/D traffic and
    the decode replicas that can pull their KV; none, and why, when no pair is routable, and
    the fallback reason when the Python gateway then prefills locally rather than wait."""
    decode = selection.pools["decode"]
    prefill = selection.pools.get("prefill", [])
    if not prefill:
        return [], "routing mode Disaggregated but no healthy prefill endpoint", None
    if config.kv_transfer.verify == "Required":
        prefill = [e for e in prefill if e.kv_transport == "Verified"]
        if not prefill:
            why = "no prefill replica whose KV transport is Verified"
            return [], why, "transport_unverified"
    keyed: dict[tuple[str | None, str | None], list[Endpoint]] = {}
    for each in prefill:
        keyed.setdefault((each.kv_compat, each.slice), []).append(each)
    found = []
    for _, members in sorted(keyed.items(), key=lambda item: (str(item[0][0]), str(item[0][1]))):
        pullers = Endpoints.same_slice(Endpoints.kv_compatible(decode, members[0]), members[0])
        if pullers:
            found.append({"prefill": urls(members), "decode": urls(pullers)})
    if not found:
        why = "no decode replica with a prefill replica's KV-compatibility digest"
        return [], why, "no_compatible_decode"
    return found, None, None


class Served(NamedTuple):
    """The route the data plane takes now, its render servers and engine groups; why, while it
    holds every request for engines (UNAVAILABLE) or prefills every request locally
    (`local_prefill`): what `/status` shows."""

    route: str
    render: list[str]
    groups: list[dict[str, list[str]]]
    why: str | None = None
    local_prefill: str | None = None


def served_route(config: GatewayConfig, endpoints: Endpoints) -> Served:
    """With no complete set of engines the data plane holds each request up to the endpoint
    wait for one, as the Python gateway does (planner.plan), then answers 503 with its words."""
    route = route_of(config)
    found = engines(config, endpoints, route)
    if not found.groups:
        return Served(UNAVAILABLE, [], [], found.why)
    if found.local_prefill is not None:
        route = DECODE
    return Served(route, found.render, found.groups, found.why, found.local_prefill)


def urls(endpoints: Iterable[Endpoint]) -> list[str]:
    """The routing targets as the data plane names them (Endpoint.key): a server, or one
    data-parallel rank of it as `<url>#dp<n>`, which the data plane pins with vLLM's
    X-data-parallel-rank as this gateway does (the rank's own load and queue; a failed server
    is retried on another server, never on its other rank)."""
    return sorted({e.key for e in endpoints})


def admission_table(
    settings: GatewaySettings, *, leader_elsewhere: bool, others: Mapping[str, int]
) -> dict[str, Any]:
    """How the data plane runs this replica's fair queue (dataplane/fairqueue.go): the limits,
    whether another replica leads admission (then it asks this gateway), and the long prefills
    the peers hold on their own per prefill replica (PeerAdmission.total)."""
    queue = settings.fair_queue
    return {
        "maxLongPerReplica": queue.max_long_per_replica,
        "maxWaitSeconds": queue.max_wait_seconds,
        "leaderElsewhere": leader_elsewhere,
        "others": {url: n for url, n in sorted(others.items()) if n > 0},
    }


def auto_table(
    config: GatewayConfig,
    endpoints: Endpoints,
    policy: AutoPolicy,
    peers_queued: int,
    step_window_seconds: float,
) -> dict[str, Any]:
    """Routing mode Auto as the data plane decides it (dataplane/auto.go): the view of Auto
    mode's model now, the settings for what it keeps between requests (the degraded path's
    probes, the one request measuring the first handoff, its own step meters' window), and the
    engines' queues as last scraped (it adds its own requests in flight, its own admission
    queue to the peers', and the step times of the streams it relays)."""
    slo, settings = config.routing.slo, policy.settings
    return {
        "view": policy.view(slo.ttft_seconds, slo.itl_seconds).to_wire(),
        "probeEvery": settings.probe_every,
        "learningTimeoutSeconds": settings.learning_timeout_budgets * (slo.ttft_seconds or 0.0),
        "localOnPrefillPool": settings.local_on_prefill_pool,
        "queues": {
            each.key: {
                "waiting": each.waiting,
                "running": each.running,
                "backlog": each.prefill_backlog,
                "stepSeconds": each.steps.seconds,
            }
            for pool in ("prefill", "decode")
            for each in endpoints.pools.get(pool, [])
        },
        "queued": peers_queued,
        "stepWindowSeconds": step_window_seconds,
    }


def routing_table(
    config: GatewayConfig,
    endpoints: Endpoints,
    settings: GatewaySettings,
    version: int,
    admission: Mapping[str, Any] | None = None,
    *,
    policy: AutoPolicy,
    peers_queued: int = 0,
    holds: DecodeHolds | None = None,
    gateway_replicas: int = 1,
) -> dict[str, Any]:
    """The table the data plane is sent (`version` orders the pushes; `admission`: from
    admission_table, by default this replica alone; `policy`: Auto mode's, which the data
    plane decides by in that mode; `peers_queued`: long prompts in the peers' queues;
    `holds`: this gateway's reckoning of decode's held KV, shared by `gateway_replicas`)."""
    served = served_route(config, endpoints)
    route = served.route
    entry: dict[str, Any] = {
        "route": route, "groups": served.groups, "render": served.render,
        "blockSize": config.block_size,  # the prefix index's blocks of token ids
        # A decode is sent prefill's KV only this long after prefill answered (hops.kv_start_by).
        "kvStartWithinSeconds": settings.kv_start_within(config.kv_transfer.prefill_lease_seconds),
    }  # fmt: skip
    if route == UNAVAILABLE:
        # Held up to the endpoint wait for a table with engines, then answered 503 so.
        entry["unavailable"] = {
            "message": served.why,
            "waitSeconds": settings.endpoint_wait_seconds,
        }
    if served.local_prefill is not None:
        entry["localPrefillReason"] = served.local_prefill  # counted per request
    if route == AUTO:
        entry["auto"] = auto_table(
            config, endpoints, policy, peers_queued, settings.step_window_seconds
        )
    if config.engine_api == "tokens" and config.kv_transfer.bidirectional:
        entry["bidirectional"] = bidirectional_table(
            config, endpoints, settings, holds, gateway_replicas
        )
    logged = settings.request_log is not None
    if logged:
        entry["parityHash"] = parity_hash(config, endpoints)
    return {
        "version": version,
        # Every engine serves the model's adapters (the parity set holds them): one route.
        "models": {name: entry for name in (config.model, *config.adapters)},
        "apiKeySha256": [hashlib.sha256(k.encode()).hexdigest() for k in settings.api_keys],
        # Without gateway keys the client's own credentials go on to the engines (intake.py).
        "passAuthorization": not settings.api_keys,
        "maxTokensCap": settings.max_tokens_cap or 0,
        "longBodyBytes": settings.fair_queue.long_prompt_tokens * BYTES_PER_PROMPT_TOKEN,
        "longPromptTokens": settings.fair_queue.long_prompt_tokens,
        # Engines without a tokenizer refuse some parameters: the data plane says which and why
        # before any engine call, as intake does.
        "tokensOnlyEngines": config.tokens_only_engines,
        "derenderPipelining": settings.derender_pipelining,
        "load": target_loads(endpoints),
        "admission": admission or admission_table(settings, leader_elsewhere=False, others={}),
        "placement": PLACEMENT,
        **({"requestLog": request_log_table(endpoints)} if logged else {}),
    }


def bidirectional_table(
    config: GatewayConfig,
    endpoints: Endpoints,
    settings: GatewaySettings,
    holds: DecodeHolds | None,
    gateway_replicas: int,
) -> dict[str, Any]:
    """How the data plane keeps bidirectional KV (dataplane/bidirectional.go), as this gateway
    does (held_kv.py, affinity.DecodeKv): how long decode holds a finished request's blocks,
    the share of each decode engine's KV blocks the holds may take (its capacity once
    scraped, by Endpoint.key), split among the gateway replicas, and what decode holds per
    server for the requests this gateway served itself."""
    decode = endpoints.pools.get("decode", [])
    capacity = {
        e.key: {"blocks": e.kv_blocks, "blockSize": e.kv_block_size or 0}
        for e in decode
        if e.kv_blocks
    }
    own = {} if holds is None else {e.url: holds.held(e.url) for e in decode}
    return {
        "ttlSeconds": config.kv_transfer.decode_blocks_ttl_seconds,
        "fraction": settings.held_kv_fraction,
        "gatewayReplicas": gateway_replicas,
        "maxConversations": MAX_CONVERSATIONS,
        "maxHolds": MAX_HOLDS,
        "capacity": dict(sorted(capacity.items())),
        "heldElsewhere": {url: n for url, n in sorted(own.items()) if n > 0},
    }


def request_log_table(endpoints: Endpoints) -> dict[str, Any]:
    """What the data plane's request log entries name as this gateway's do (exchange.py
    log_entry): its routes by their names here, and each engine as the table names it (render
    servers by URL, engines by Endpoint.key) by what the log calls it (a render server's pod,
    an engine's pod with its rank: Endpoint.label and Endpoint.target)."""
    names = {
        (each.url if pool == "render" else each.key): (
            each.label if pool == "render" else each.target
        )
        for pool, members in endpoints.pools.items()
        for each in members
    }
    return {"routes": dict(ROUTES), "names": dict(sorted(names.items()))}


def parity_hash(config: GatewayConfig, endpoints: Endpoints) -> str | None:
    """The parity hash of the set of pools a request is routed to now (the log's
    parity_hash: Selection.parity_hash), none while no complete set is routable."""
    needed = ["render", "decode"] if config.engine_api == "tokens" else ["decode"]
    try:
        return endpoints.select(needed, ["prefill"]).parity_hash
    except NoEndpoints:
        return None


def target_loads(endpoints: Endpoints) -> dict[str, float]:
    """Per routing target (Endpoint.key: a server, or one rank of it), its base load."""
    return {each.key: base_load(each) for pool in endpoints.pools.values() for each in pool}


def base_load(endpoint: Endpoint) -> float:
    """An engine's load as the Python gateway ranks it (Endpoint.load), less the Python
    gateway's own in-flight count: the data plane adds its own."""
    return round(endpoint.load() - endpoint.inflight, 3)


def same_table(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> bool:
    """Equal but for the version: nothing to push."""
    if a is None:
        return False
    return {k: v for k, v in a.items() if k != "version"} == {
        k: v for k, v in b.items() if k != "version"
    }
