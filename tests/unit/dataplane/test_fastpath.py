"""What the data plane is told to do: the routing table the Python gateway derives from its
own state. It serves a request itself only where the Python gateway would route it the same
way with nothing decided per request, and never pairs engines the Python gateway would not."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pdserve.gateway.affinity import MAX_CONVERSATIONS
from pdserve.gateway.endpoints import Endpoint, Endpoints, rank_targets
from pdserve.gateway.fairqueue import FairQueueSettings
from pdserve.gateway.fastpath import admission_table, routing_table, same_table, served_route
from pdserve.gateway.held_kv import MAX_HOLDS, DecodeHolds
from pdserve.gateway.policy import AutoPolicy
from pdserve.gateway.settings import GatewaySettings
from tests.support.gateway_fakes import MODEL, config


def table_for(
    mode: str = "Disaggregated",
    prefill: list[Endpoint] | None = None,
    decode: list[Endpoint] | None = None,
    *,
    engine_api: str = "openai",
    settings: GatewaySettings | None = None,
    kv_transfer: dict[str, Any] | None = None,
    render: list[Endpoint] | None = None,
    tokens_engines: str = "scale_out",
) -> dict[str, object]:
    cfg = config(engine_api, mode, kv_transfer, tokens_engines)
    endpoints = Endpoints(cfg)
    endpoints.replace("prefill", prefill if prefill is not None else [Endpoint("http://p", "p1")])
    endpoints.replace("decode", decode if decode is not None else [Endpoint("http://d", "p1")])
    if engine_api == "tokens":
        endpoints.replace("render", render if render is not None else [Endpoint("http://r", "p1")])
    return routing_table(cfg, endpoints, settings or GatewaySettings(), 1, policy=AutoPolicy())


def model(table: dict[str, object]) -> dict[str, object]:
    models = table["models"]
    assert isinstance(models, dict)
    entry = models[MODEL]
    assert isinstance(entry, dict)
    return entry


def test_disaggregated_and_aggregated_are_served_by_the_data_plane() -> None:
    pd = model(table_for("Disaggregated"))
    assert pd == {
        "route": "pd", "groups": [{"prefill": ["http://p"], "decode": ["http://d"]}], "render": [],
        "blockSize": 16, "kvStartWithinSeconds": 29.0,
    }  # fmt: skip
    aggregated = model(table_for("Aggregated"))
    assert aggregated == {
        "route": "decode", "groups": [{"prefill": [], "decode": ["http://d"]}], "render": [],
        "blockSize": 16, "kvStartWithinSeconds": 29.0,
    }  # fmt: skip


def test_behind_render_servers_the_data_plane_renders_and_derenders_around_p_d() -> None:
    pd = model(table_for("Disaggregated", engine_api="tokens"))
    assert pd == {
        "route": "pd", "groups": [{"prefill": ["http://p"], "decode": ["http://d"]}],
        "render": ["http://r"], "blockSize": 16, "kvStartWithinSeconds": 29.0,
    }  # fmt: skip
    assert model(table_for("Aggregated", engine_api="tokens"))["route"] == "decode"
    # The render servers of the engines' parity only: never a template the engines disagree with.
    render = [Endpoint("http://r-old", "p0"), Endpoint("http://r", "p1")]
    assert model(table_for(engine_api="tokens", render=render))["render"] == ["http://r"]
    # No routable render server: the data plane waits for one or answers 503.
    assert model(table_for(engine_api="tokens", render=[])) == {
        "route": "unavailable", "groups": [], "render": [], "blockSize": 16,
        "kvStartWithinSeconds": 29.0,
        "unavailable": {"message": "no healthy render endpoint", "waitSeconds": 30.0},
    }  # fmt: skip
    # Long prompts are counted in rendered tokens; what tokens-only engines would refuse, the
    # data plane refuses as intake does (naming the parameter and what to send instead).
    table = table_for(engine_api="tokens", tokens_engines="tokens_only")
    assert table["longPromptTokens"] == GatewaySettings().fair_queue.long_prompt_tokens
    assert table["tokensOnlyEngines"] is True
    assert table_for(engine_api="tokens")["tokensOnlyEngines"] is False
    assert table_for(engine_api="tokens")["derenderPipelining"] is True
    unpipelined = GatewaySettings(derender_pipelining=False)
    assert table_for(engine_api="tokens", settings=unpipelined)["derenderPipelining"] is False


def test_auto_mode_is_decided_in_the_data_plane_from_the_view_pushed_to_it() -> None:
    busy = Endpoint("http://d", "p1", waiting=2, running=3, prefill_backlog=40)
    busy.steps.seconds = 0.02
    auto = model(table_for("Auto", decode=[busy]))
    assert auto["route"] == "auto"
    assert auto["groups"] == [{"prefill": ["http://p"], "decode": ["http://d"]}]
    block = auto["auto"]
    assert isinstance(block, dict)
    assert block["view"] == AutoPolicy().view(None, None).to_wire()
    assert block["queues"]["http://d"] == {
        "waiting": 2, "running": 3, "backlog": 40, "stepSeconds": 0.02,
    }  # fmt: skip
    assert (block["probeEvery"], block["localOnPrefillPool"]) == (20, True)
    # Local prefill runs on any decode replica, those no prefill replica can pair with too.
    decode = [
        Endpoint("http://d-a", "p1", kv_compat="a"),
        Endpoint("http://d-b", "p1", kv_compat="b"),
    ]
    mixed = model(
        table_for("Auto", prefill=[Endpoint("http://p", "p1", kv_compat="a")], decode=decode)
    )
    assert mixed["groups"] == [
        {"prefill": ["http://p"], "decode": ["http://d-a"]}, {"prefill": [], "decode": ["http://d-b"]},
    ]  # fmt: skip
    # No prefill replica to pair: every request is decided local (no_prefill), in the data plane.
    held = Endpoint("http://p", "p1")
    held.routable = False
    assert model(table_for("Auto", prefill=[held]))["groups"] == [
        {"prefill": [], "decode": ["http://d"]}
    ]
    assert "auto" not in model(table_for("Disaggregated"))


def test_bidirectional_kv_is_kept_by_the_data_plane_with_this_gateways_budget() -> None:
    """A conversation's KV left on decode is the data plane's to point the next prefill at:
    the table says how long decode holds it, each decode engine's KV capacity once scraped
    (by its key), the budget's share split among the gateway replicas, and what decode holds
    for the requests this gateway served itself (counted in the data plane's budget too)."""
    bidirectional = {"bidirectional": True, "decodeBlocksTtlSeconds": 120}
    scraped = Endpoint("http://d", "p1", rank=1)
    scraped.kv_blocks, scraped.kv_block_size = 1000, 32
    unknown = Endpoint("http://d2", "p1")
    cfg = config("tokens", "Disaggregated", bidirectional, "scale_out")
    endpoints = Endpoints(cfg)
    endpoints.replace("prefill", [Endpoint("http://p", "p1")])
    endpoints.replace("decode", [scraped, unknown])
    endpoints.replace("render", [Endpoint("http://r", "p1")])
    holds = DecodeHolds(ttl=120, block_size=16, fraction=0.5)
    holds.finished("own-1", scraped, [100])
    table = routing_table(
        cfg, endpoints, GatewaySettings(held_kv_fraction=0.25), 1, policy=AutoPolicy(),
        holds=holds, gateway_replicas=3,
    )  # fmt: skip
    entry = model(table)
    assert entry["route"] == "pd"
    assert entry["bidirectional"] == {
        "ttlSeconds": 120, "fraction": 0.25, "gatewayReplicas": 3,
        "maxConversations": MAX_CONVERSATIONS, "maxHolds": MAX_HOLDS,
        "capacity": {"http://d#dp1": {"blocks": 1000, "blockSize": 32}},
        "heldElsewhere": {"http://d": 4},  # 100 tokens at its 32 a block
    }  # fmt: skip
    # Without bidirectional KV, or with OpenAI engines (no token ids to match), none.
    assert "bidirectional" not in model(table_for(engine_api="tokens"))
    assert "bidirectional" not in model(table_for(kv_transfer=bidirectional))


def test_engines_behind_tls_are_served_by_the_data_plane() -> None:
    # Its client speaks TLS to https:// engines (dataplane/tls_test.go).
    secured = [Endpoint("https://p", "p1")], [Endpoint("https://d", "p1")]
    table = model(table_for(prefill=secured[0], decode=secured[1]))
    assert table["route"] == "pd"
    assert table["groups"] == [{"prefill": ["https://p"], "decode": ["https://d"]}]


def test_with_a_request_log_the_table_names_what_the_log_names() -> None:
    """The data plane's entries name routes and engines as this gateway's do (log_entry)."""
    logged = GatewaySettings(request_log=Path("/tmp/requests.jsonl"))
    ranked = Endpoint("http://d", "p1", name="decode-0", rank=1)
    table = table_for(settings=logged, decode=[ranked])
    log = table["requestLog"]
    assert isinstance(log, dict)
    assert log["routes"] == {
        "pd": "openai_pd", "decode": "aggregated",
        "render_pd": "render_pd", "render_decode": "render",
    }  # fmt: skip
    assert log["names"]["http://d#dp1"] == "decode-0#dp1"
    assert log["names"]["http://p"] == "http://p"  # no pod: its URL
    assert model(table)["parityHash"] == "p1"
    assert "requestLog" not in table_for()
    assert "parityHash" not in model(table_for())


def served(
    mode: str = "Disaggregated",
    prefill: list[Endpoint] | None = None,
    decode: list[Endpoint] | None = None,
    *,
    kv_transfer: dict[str, Any] | None = None,
) -> tuple[str, str | None, str | None]:
    """The data plane's route, why (what `/status` shows) and the fallback each request is
    counted under when every one prefills on decode."""
    cfg = config("openai", mode, kv_transfer)
    endpoints = Endpoints(cfg)
    endpoints.replace("prefill", prefill if prefill is not None else [Endpoint("http://p", "p1")])
    endpoints.replace("decode", decode if decode is not None else [Endpoint("http://d", "p1")])
    found = served_route(cfg, endpoints)
    return found.route, found.why, found.local_prefill


def test_without_a_pair_the_data_plane_waits_or_prefills_locally_as_the_planner_does() -> None:
    """planner.plan: a missing pool (or, in mode Disaggregated, a missing prefill replica) holds
    the request up to the endpoint wait, then answers 503; a prefill replica that may not take
    P/D (transport not Verified under Required, no KV-compatible decode) makes every request
    prefill on decode, counted. The data plane does both itself: nothing is handed over."""
    assert served() == ("pd", None, None)
    assert served("Auto") == ("auto", None, None)
    assert served(decode=[]) == ("unavailable", "no healthy decode endpoint", None)
    held = Endpoint("http://p", "p1")
    held.routable = False
    assert served(prefill=[held]) == (
        "unavailable", "routing mode Disaggregated but no healthy prefill endpoint", None,
    )  # fmt: skip
    assert served("Auto", prefill=[held])[0] == "auto"  # Auto prefills locally, by design
    unverified = Endpoint("http://p", "p1", kv_transport="Failed")
    required = {"verify": "Required"}
    assert served("Auto", prefill=[unverified], kv_transfer=required) == ("auto", None, None)
    route, why, local = served(prefill=[unverified], kv_transfer={"verify": "Required"})
    assert (route, local) == ("decode", "transport_unverified")
    assert "Verified" in str(why)
    other_build = [Endpoint("http://p", "p1", kv_compat="b")]
    route, why, local = served(prefill=other_build)
    assert (route, local) == ("decode", "no_compatible_decode")
    assert "KV-compatibility" in str(why)


def test_the_table_says_how_long_to_hold_a_request_for_engines_and_what_to_count() -> None:
    waiting = model(table_for(decode=[], settings=GatewaySettings(endpoint_wait_seconds=7.5)))
    assert (waiting["route"], waiting["groups"]) == ("unavailable", [])
    assert waiting["unavailable"] == {"message": "no healthy decode endpoint", "waitSeconds": 7.5}
    other_build = model(table_for(prefill=[Endpoint("http://p", "p1", kv_compat="b")]))
    assert other_build["route"] == "decode"
    assert other_build["groups"] == [{"prefill": [], "decode": ["http://d"]}]
    assert other_build["localPrefillReason"] == "no_compatible_decode"
    assert "localPrefillReason" not in model(table_for())


def test_engines_pair_only_within_one_kv_compatibility_digest() -> None:
    prefill = [Endpoint("http://p-old", "p1", kv_compat="a"),
               Endpoint("http://p-new", "p1", kv_compat="b")]  # fmt: skip
    decode = [Endpoint("http://d-old", "p1", kv_compat="a"),
              Endpoint("http://d-new", "p1", kv_compat="b")]  # fmt: skip
    assert model(table_for(prefill=prefill, decode=decode))["groups"] == [
        {"prefill": ["http://p-old"], "decode": ["http://d-old"]},
        {"prefill": ["http://p-new"], "decode": ["http://d-new"]},
    ]
    # Mid-upgrade, a new prefill with no new decode yet is left out.
    assert model(table_for(prefill=prefill, decode=decode[:1]))["groups"] == [
        {"prefill": ["http://p-old"], "decode": ["http://d-old"]}
    ]


def test_a_prefill_pairs_with_its_slice_first() -> None:
    prefill = [Endpoint("http://p-a", "p1", slice="a"), Endpoint("http://p-b", "p1", slice="b")]
    decode = [Endpoint("http://d-a", "p1", slice="a"), Endpoint("http://d-c", "p1", slice="c")]
    assert model(table_for(prefill=prefill, decode=decode))["groups"] == [
        {"prefill": ["http://p-a"], "decode": ["http://d-a"]},
        # No decode in slice b: any (as the Python gateway's same_slice falls back to).
        {"prefill": ["http://p-b"], "decode": ["http://d-a", "http://d-c"]},
    ]


def test_replicas_the_python_gateway_would_not_route_to_are_left_out() -> None:
    held = Endpoint("http://p-held", "p1")
    held.routable = False  # its replica check is pending or failed
    other_parity = Endpoint("http://p-old", "p0")
    unverified = Endpoint("http://p-unverified", "p1", kv_transport="Failed")
    verified = Endpoint("http://p-ok", "p1", kv_transport="Verified")
    groups = model(
        table_for(prefill=[held, other_parity, unverified, verified],
                  kv_transfer={"verify": "Required"})
    )["groups"]  # fmt: skip
    assert groups == [{"prefill": ["http://p-ok"], "decode": ["http://d"]}]
    # Mode Disaggregated with no prefill to pair: every request prefills on decode, counted.
    assert model(table_for(prefill=[unverified], kv_transfer={"verify": "Required"})) == {
        "route": "decode", "groups": [{"prefill": [], "decode": ["http://d"]}], "render": [],
        "blockSize": 16, "kvStartWithinSeconds": 29.0, "localPrefillReason": "transport_unverified",
    }  # fmt: skip


def test_keys_are_sent_as_digests_and_the_limits_as_the_python_gateway_applies_them() -> None:
    settings = GatewaySettings(api_keys=("k1",), max_tokens_cap=64)
    table = table_for(settings=settings)
    assert table["apiKeySha256"] == [hashlib.sha256(b"k1").hexdigest()]
    assert table["passAuthorization"] is False  # the gateway's own key is not the engines'
    assert table["maxTokensCap"] == 64
    assert table["longBodyBytes"] == settings.fair_queue.long_prompt_tokens * 4
    assert table_for()["passAuthorization"] is True


def test_the_engines_scraped_load_goes_along_and_only_changes_are_pushed() -> None:
    busy = Endpoint("http://p", "p1", waiting=2, running=1)
    busy.inflight = 1  # the Python gateway's own requests: the data plane counts its own
    table = table_for(prefill=[busy])
    assert table["load"] == {"http://p": 9.0, "http://d": 0.0}
    again = {**table, "version": 2}
    assert same_table(table, again)
    assert not same_table(table, {**again, "load": {"http://p": 1.0, "http://d": 0.0}})
    assert not same_table(None, table)


def test_the_data_plane_runs_this_replicas_fair_queue_with_the_gateways_limits() -> None:
    settings = GatewaySettings(
        fair_queue=FairQueueSettings(max_long_per_replica=2, max_wait_seconds=4)
    )
    assert table_for(settings=settings)["admission"] == {
        "maxLongPerReplica": 2,
        "maxWaitSeconds": 4,
        "leaderElsewhere": False,
        "others": {},
    }  # alone: every long prompt waits in the data plane's queue, none asks this gateway
    led = admission_table(settings, leader_elsewhere=True, others={"http://p1": 1, "http://p0": 0})
    # Another replica leads: the data plane asks this gateway (which asks the leader); the
    # peers' own long prefills count, replicas without any are left out.
    assert (led["leaderElsewhere"], led["others"]) == (True, {"http://p1": 1})


def test_each_data_parallel_rank_is_a_target_of_its_own_with_its_own_load() -> None:
    """The data plane pins ranks as this gateway does: it is told every rank (`<url>#dp<n>`,
    Endpoint.key) and each rank's load, never one pod-wide sum."""
    prefill = rank_targets(Endpoint("http://p", "p1"), 2)
    decode = rank_targets(Endpoint("http://d", "p1"), 2)
    prefill[0].waiting, decode[1].running = 1, 3
    table = table_for(prefill=prefill, decode=decode)
    assert model(table)["groups"] == [
        {"prefill": ["http://p#dp0", "http://p#dp1"], "decode": ["http://d#dp0", "http://d#dp1"]}
    ]
    assert table["load"] == {
        "http://p#dp0": 4.0, "http://p#dp1": 0.0, "http://d#dp0": 0.0, "http://d#dp1": 3.0,
    }  # fmt: skip


def test_a_decode_is_sent_prefills_kv_only_within_the_lease_less_the_margin() -> None:
    """The data plane checks prefill's lease as the Python gateway does (hops.kv_start_by):
    the routing config's lease, less the gateway's margin for the way to decode."""
    settings = GatewaySettings(lease_margin_seconds=2.5)
    table = table_for(kv_transfer={"prefillLeaseSeconds": 20}, settings=settings)
    assert model(table)["kvStartWithinSeconds"] == 17.5
