"""Rollouts under steady load, on the real node: a parity change (no request fails, and every
request is served by render, prefill and decode pods of one parity hash) and an engine image
upgrade (no request fails or is handed between engines of two KV-compatibility digests)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial

import openai

from devtools.localplane import wait_until
from pdserve.contract.names import KV_COMPAT_ANNOTATION, LEADER_LEASE_NAME
from pdserve.sim.chat import QWEN3_TEMPLATE
from tests.support.realcluster import (
    MODEL_NAMESPACE,
    RELEASE_NAMESPACE,
    Cluster,
    describe,
    model_status,
    patch_dm,
    pods,
    ready,
    settled,
    sigkill,
)
from tests.support.rollout_load import (
    GatewayLogs,
    Incarnation,
    Load,
    PodHistory,
    logged_requests,
    request_log_on,
    running,
)


def parity_rollout_under_load(
    cluster: Cluster, model: str, change: Callable[[], object], *, within: float = 30
) -> None:
    """`change` made under steady load: a new parity hash within `within` seconds, zero failed
    requests, and every request served by render, prefill and decode pods of the one hash it
    names (both hashes served)."""
    request_log_on(cluster)
    old = model_status(cluster)["parityHash"]

    history, load = PodHistory(), Load(model)
    logs = GatewayLogs(cluster.node.pod_logs, MODEL_NAMESPACE)
    workers = [(partial(load.run_one, i), load.stop) for i in range(load.clients)]
    with running((lambda: history.watch(cluster), history.stop), (logs.follow, logs.stop)):
        with running(*workers):
            wait_until("steady load", lambda: len(load.sent) >= 10, timeout=60)
            started = time.monotonic()
            change()
            wait_until("the new parity hash", lambda: model_status(cluster)["parityHash"] != old,
                       timeout=within)  # fmt: skip
            new = model_status(cluster)["parityHash"]
            wait_until(
                "every pod on the new parity hash",
                lambda: settled(cluster, new),
                timeout=240,
                interval=1,
            )
            rollout_seconds = time.monotonic() - started
            load.wait_for_more()

        entries = logged_requests(load, logs)
    logs.close()

    print(f"rollout {rollout_seconds:.1f}s, {len(load.sent)} requests, {len(load.failures)} failed")
    assert load.failures == [], f"{len(load.failures)} failed: {load.failures[:5]}"
    assert {e["parity_hash"] for e in entries} == {old, new}, describe(cluster, MODEL_NAMESPACE)
    for entry in entries:
        for stage in ("render_engine", "prefill_engine", "decode_engine"):
            pod = entry[stage]
            if pod is None:
                continue
            # The pod it names existed with the request's parity hash.
            assert entry["parity_hash"] in history.by_name.get(pod, set()), (stage, entry)


def test_parity_change_under_load_fails_no_request_and_never_mixes_hashes(
    cluster: Cluster, model: str
) -> None:
    # A parity change: the default chat-template kwargs every pool renders with.
    parity_rollout_under_load(cluster, model, lambda: patch_dm(cluster, {"spec": {"serving": {
        "defaultChatTemplateKwargs": {"enable_thinking": False}}}}))  # fmt: skip


TEMPLATE = "sim-qwen3-chat-template"


def template_config_map(template: str) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": TEMPLATE, "namespace": MODEL_NAMESPACE},
                       "data": {"template.jinja": template}})  # fmt: skip


def prompt_tokens(model: str) -> int:
    client = openai.OpenAI(base_url=model, api_key="unused", timeout=30, max_retries=2)
    chat = client.chat.completions.create(
        model="sim-qwen3", messages=[{"role": "user", "content": "the same question"}],
        max_tokens=4,
    )  # fmt: skip
    assert chat.usage is not None
    return chat.usage.prompt_tokens


def test_chat_template_edit_under_load_fails_no_request_and_never_mixes_hashes(
    cluster: Cluster, model: str
) -> None:
    """The model's chat template from a ConfigMap, then that ConfigMap edited in place: the
    operator sees the new content (at its next resync at the latest), and the new template
    rolls out like any parity change."""
    cluster.kubectl("apply", "-f", "-", stdin=template_config_map(QWEN3_TEMPLATE))
    parity = model_status(cluster)["parityHash"]
    reference = {"name": TEMPLATE, "key": "template.jinja"}
    patch_dm(cluster, {"spec": {"serving": {"chatTemplate": reference}}})
    wait_until("the model on its ConfigMap template", lambda: (
        model_status(cluster)["parityHash"] != parity and settled(
            cluster, model_status(cluster)["parityHash"])), timeout=240, interval=1)  # fmt: skip
    before = prompt_tokens(model)
    # Every user turn gains a line: the same question renders to more tokens.
    edited = QWEN3_TEMPLATE.replace("<|im_start|>user\n", "<|im_start|>user\nQuestion:\n")
    assert edited != QWEN3_TEMPLATE
    parity_rollout_under_load(
        cluster, model,
        lambda: cluster.kubectl("apply", "-f", "-", stdin=template_config_map(edited)),
        within=90,  # the operator's resync (60 s): ConfigMaps are not watched
    )  # fmt: skip
    assert prompt_tokens(model) > before
    patch_dm(cluster, {"spec": {"serving": {"chatTemplate": None}}})


ENGINES = "app.kubernetes.io/component in (prefill,decode)"
DECODE = "app.kubernetes.io/component=decode"


def leader(cluster: Cluster) -> str:
    lease = json.loads(cluster.kubectl("get", "lease", LEADER_LEASE_NAME, "-n",
                                       RELEASE_NAMESPACE, "-o", "json").stdout)  # fmt: skip
    return str(lease["spec"].get("holderIdentity", ""))


def engine_digests(cluster: Cluster) -> set[str]:
    return {p["metadata"]["annotations"].get(KV_COMPAT_ANNOTATION, "")
            for p in pods(cluster, MODEL_NAMESPACE, ENGINES)}  # fmt: skip


def test_engine_upgrade_under_load_never_pairs_engines_of_two_digests(
    cluster: Cluster, model: str
) -> None:
    """An engine image upgrade of a 2P2D model: decode leads, prefill follows, and no request
    is handed from a prefill pod to a decode pod of another KV-compatibility digest, though
    the operator's leader is killed halfway."""
    request_log_on(cluster)
    # Every request prefill -> decode (Auto serves these short prompts on decode alone).
    patch_dm(cluster, {"spec": {"prefill": {"replicas": 2}, "decode": {"replicas": 2},
                                "gateway": {"routing": {"mode": "Disaggregated"}}}})  # fmt: skip
    wait_until("2 prefill and 2 decode pods", lambda: settled(cluster) and len(
        pods(cluster, MODEL_NAMESPACE, ENGINES)) == 4, timeout=180, interval=1)  # fmt: skip
    (old,) = engine_digests(cluster)
    # The same simulator under a new tag: what a registry's next vLLM release is to the node.
    upgraded = f"{cluster.images.sim}-next"
    cluster.node.ctr("images", "tag", "--force", cluster.images.sim, upgraded)

    history, load = PodHistory(), Load(model)
    logs = GatewayLogs(cluster.node.pod_logs, MODEL_NAMESPACE)
    workers = [(partial(load.run_one, i), load.stop) for i in range(load.clients)]
    wide: list[str] = []
    with running((lambda: history.watch(cluster), history.stop), (logs.follow, logs.stop)):
        with running(*workers):
            wait_until("steady load", lambda: len(load.sent) >= 10, timeout=60)
            started, started_ms = time.monotonic(), int(time.time() * 1000)
            patch_dm(cluster, {"spec": {"image": {"engine": upgraded}}})

            def rolled() -> bool:
                if len(wide) < 3:  # what a user watching `kubectl get dm -o wide` sees
                    wide.append(cluster.kubectl("get", "dm", "-n", MODEL_NAMESPACE,
                                                "-o", "wide").stdout)  # fmt: skip
                digests = engine_digests(cluster)
                return len(digests) == 1 and old not in digests and settled(cluster)

            # Mid-upgrade (a decode pod on the new digest Ready, prefill about to follow), the
            # leader is SIGKILLed: the next leader takes the Lease once it expires and carries
            # the upgrade on from what the pods run.
            def decode_leads() -> bool:
                return rolled() or any(
                    ready(p) and p["metadata"]["annotations"].get(KV_COMPAT_ANNOTATION) != old
                    for p in pods(cluster, MODEL_NAMESPACE, DECODE)
                )

            wait_until("a new decode pod Ready", decode_leads, timeout=180, interval=0.5)
            killed, killed_s = leader(cluster), time.monotonic() - started
            sigkill(cluster, RELEASE_NAMESPACE, killed)
            wait_until("every engine pod on the new digest", rolled, timeout=300, interval=1)
            successor = leader(cluster)
            rollout_seconds = time.monotonic() - started
            load.wait_for_more()
        entries = logged_requests(load, logs)
    logs.close()
    (new,) = engine_digests(cluster)
    steps = cluster.kubectl(
        "get", "events", "-n", MODEL_NAMESPACE, "--field-selector", "reason=EngineRolloutStep",
        "-o", "jsonpath={range .items[*]}{.message}{'\\n'}{end}",
    ).stdout.splitlines()  # fmt: skip
    # The model back to one prefill and one decode pod, routed Auto, for the tests after it.
    patch_dm(cluster, {"spec": {"prefill": {"replicas": 1}, "decode": {"replicas": 1},
                                "gateway": {"routing": {"mode": None}}}})  # fmt: skip

    paired = [e for e in entries if e["prefill_engine"] and e["decode_engine"]]
    mixed = [
        e for e in paired
        if not history.kv_compat_of(e["prefill_engine"], e["sent_at_ms"], e["finished_at_ms"])
        & history.kv_compat_of(e["decode_engine"], e["sent_at_ms"], e["finished_at_ms"])
    ]  # fmt: skip
    print(f"leader {killed} killed at +{killed_s:.1f}s, {successor} leads; "
          f"engine upgrade {rollout_seconds:.1f}s, {len(load.sent)} requests, "
          f"{len(load.failures)} failed, {len(paired)} P/D, {len(mixed)} across digests\n"
          + "\n".join(steps) + "\n" + "\n".join(wide))  # fmt: skip
    # When each new engine pod appeared and got Ready, seconds after the patch.
    for i in sorted(history.incarnations.values(), key=lambda i: i.first_ms):
        if i.kv_compat == new and i.first_ms > started_ms:
            ready_s = "-" if i.ready_ms is None else f"{(i.ready_ms - started_ms) / 1000:.1f}"
            created_s = f"{(i.first_ms - started_ms) / 1000:.1f}"
            print(f"  {i.name}: created +{created_s}s, ready +{ready_s}s")
    assert load.failures == [], f"{len(load.failures)} failed: {load.failures[:5]}"
    assert mixed == [], mixed[:5]
    assert successor != ""
    # Only while prefill has no decode pod of its digest may a request prefill on decode.
    assert len(paired) >= len(entries) * 0.5, f"{len(paired)} of {len(entries)} prefill -> decode"

    def incarnations(component: str, digest: str) -> list[Incarnation]:
        prefix = f"sim-qwen3-{component}-"
        found = history.incarnations.values()
        return [i for i in found if i.name.startswith(prefix) and i.kv_compat == digest]

    new_decode_ready = min(i.ready_ms or 2**62 for i in incarnations("decode", new))
    # Prefill started rolling only once a decode pod of the new digest was ready, and the old
    # prefill pods kept an old decode pod until they were gone.
    assert min(i.first_ms for i in incarnations("prefill", new)) >= new_decode_ready - 500
    old_prefill_gone = max(i.last_ms for i in incarnations("prefill", old))
    assert max(i.last_ms for i in incarnations("decode", old)) >= old_prefill_gone
    assert any("sim-qwen3-prefill: pods below ordinal 2 stay" in s for s in steps), steps
