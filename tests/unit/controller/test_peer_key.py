"""The gateways' peer key through reconcile passes on an in-memory API server: derived from the
operator's master key and the model's identity into a Secret the model owns, the same on every
pass (a resync writes nothing), mounted into the gateway pods of a model with API keys or more
than one gateway replica, pruned when it has neither, never in a log line, the status or an
Event; and no Secret but the master is ever read."""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
import logging
from pathlib import Path
from typing import Any, cast

import pytest

from pdserve.builders.peer_key import PEER_KEY_FILE, peer_key_digest
from pdserve.contract.names import (
    PEER_KEY_HASH_ANNOTATION,
    PEER_KEY_SECRET_KEY,
    PEER_MASTER_SECRET_KEY,
    PEER_MASTER_SECRET_NAME,
)
from pdserve.controller.peer_key import PeerMaster, master_secret
from pdserve.controller.reconcile import PassFailed
from pdserve.controller.settings import operator_namespace
from pdserve.kube.client import Kube
from tests.support.fakekube import NAME, NS, SPEC, FakeKube, model_in, one_pass, settled

OPERATOR_NS = "pdserve-system"
MASTER = ("Secret", OPERATOR_NS, PEER_MASTER_SECRET_NAME)
MASTER_READ = f"get Secret {OPERATOR_NS}/{PEER_MASTER_SECRET_NAME}"
SECRET = ("Secret", NS, f"{NAME}-gateway-peer-key")
GATEWAY = ("Deployment", NS, f"{NAME}-gateway")
KEYED: dict[str, Any] = {
    **SPEC,
    "gateway": {**SPEC["gateway"], "apiKeySecretRef": {"name": "clients", "key": "k"}},
}
# No API keys, and peers: the replicas hold long-prefill slots on each other with the peer key.
REPLICATED: dict[str, Any] = {**SPEC, "gateway": {**SPEC["gateway"], "replicas": 2}}
KEYED_REPLICATED: dict[str, Any] = {**KEYED, "gateway": {**KEYED["gateway"], "replicas": 2}}


def master_of(kube: FakeKube) -> PeerMaster:
    return PeerMaster(cast(Kube, kube), OPERATOR_NS)


def with_master(kube: FakeKube, master: bytes = b"m" * 32) -> bytes:
    kube.put(master_secret(OPERATOR_NS, master))
    return master


def derived(master: bytes, uid: str = "uid-1") -> str:
    return hmac.new(master, f"{NS}/{NAME}/{uid}".encode(), hashlib.sha256).hexdigest()


def stored_key(kube: FakeKube) -> str:
    return base64.b64decode(kube.objects[SECRET]["data"][PEER_KEY_SECRET_KEY]).decode()


def gateway_pod(kube: FakeKube) -> dict[str, Any]:
    template: dict[str, Any] = kube.objects[GATEWAY]["spec"]["template"]
    return template


def rolled_for(kube: FakeKube) -> str:
    annotation: str = gateway_pod(kube)["metadata"]["annotations"][PEER_KEY_HASH_ANNOTATION]
    return annotation


def set_spec(kube: FakeKube, spec: dict[str, Any]) -> None:
    dm = kube.objects[("DisaggregatedModel", NS, NAME)]
    dm["spec"] = copy.deepcopy(spec)
    dm["metadata"]["generation"] += 1


def secret_reads(kube: FakeKube) -> list[str]:
    return [r for r in kube.reads if r.split()[1] == "Secret"]


async def test_the_key_is_derived_into_a_secret_the_model_owns() -> None:
    kube = FakeKube()
    master = with_master(kube)
    model_in(kube, KEYED)
    peers = master_of(kube)
    await one_pass(kube, peer_master=peers)
    # Applied before the Deployment that mounts it: no gateway pod waits for its volume.
    secret_at = kube.writes.index(f"apply Secret/{SECRET[2]}")
    assert secret_at < kube.writes.index(f"apply Deployment/{GATEWAY[2]}")
    assert stored_key(kube) == derived(master)
    meta = kube.objects[SECRET]["metadata"]
    [owner] = meta["ownerReferences"]
    # The garbage collector deletes it with the model.
    owner_of = (owner["kind"], owner["name"], owner["uid"], owner["controller"])
    assert owner_of == ("DisaggregatedModel", NAME, "uid-1", True)
    assert meta["labels"]["app.kubernetes.io/instance"] == NAME
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "pdserve"

    await settled(kube, peer_master=peers)
    for _ in range(3):  # resyncs: the same key, and not one write
        writes_before, unchanged = len(kube.writes), len(kube.unchanged_applies)
        again = await one_pass(kube, peer_master=peers)
        assert kube.writes[writes_before:] == []
        # The Secret is applied unread each pass: the same bytes, which the server does not write.
        assert kube.unchanged_applies[unchanged:] == [f"apply Secret/{SECRET[2]}"]
        assert (again.applied, again.pruned, again.status_written) == ([], [], False)
        assert stored_key(kube) == derived(master)


async def test_no_secret_but_the_master_is_ever_read_and_it_only_once() -> None:
    kube = FakeKube()
    with_master(kube)
    model_in(kube, KEYED)
    peers = master_of(kube)
    await settled(kube, peer_master=peers)
    for _ in range(3):
        await one_pass(kube, peer_master=peers)
    set_spec(kube, SPEC)  # pruning reads no Secret either
    await settled(kube, peer_master=peers)
    assert secret_reads(kube) == [MASTER_READ]


async def test_the_gateway_pods_read_the_key_from_its_file_and_carry_its_digest() -> None:
    kube = FakeKube()
    with_master(kube)
    model_in(kube, KEYED)
    await settled(kube, peer_master=master_of(kube))
    pod = gateway_pod(kube)
    [container] = pod["spec"]["containers"]
    assert container["args"][container["args"].index("--peer-key-file") + 1] == PEER_KEY_FILE
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "peer-key"]
    assert volume["secret"]["secretName"] == SECRET[2]
    assert any(m["name"] == "peer-key" for m in container["volumeMounts"])
    assert rolled_for(kube) == peer_key_digest(stored_key(kube))
    assert "PDSERVE_PEER_KEY" not in {e["name"] for e in container["env"]}


async def test_a_missing_master_is_made_once_and_reused_after_a_restart() -> None:
    kube = FakeKube()
    model_in(kube, KEYED)
    await settled(kube, peer_master=master_of(kube))
    assert [w for w in kube.writes if w.startswith("create Secret")] == [
        f"create Secret/{PEER_MASTER_SECRET_NAME}"
    ]
    master = base64.b64decode(kube.objects[MASTER]["data"][PEER_MASTER_SECRET_KEY])
    assert len(master) == 32  # 256 bits
    assert kube.objects[MASTER]["metadata"].get("ownerReferences") is None  # outlives models
    assert stored_key(kube) == derived(master)
    # Read, created, read back (the stored key is the one every replica uses).
    assert secret_reads(kube) == [MASTER_READ, MASTER_READ]

    restarted = master_of(kube)  # a new operator process: reads the master, makes none
    writes = len(kube.writes)
    await one_pass(kube, peer_master=restarted)
    assert kube.writes[writes:] == []
    assert stored_key(kube) == derived(master)


async def test_a_present_master_is_used_and_none_is_made() -> None:
    kube = FakeKube()
    master = with_master(kube, b"k" * 32)
    model_in(kube, KEYED)
    await settled(kube, peer_master=master_of(kube))
    assert not [w for w in kube.writes if w.startswith("create Secret")]
    assert stored_key(kube) == derived(master)


async def test_a_replica_that_loses_the_race_to_make_the_master_uses_the_winners() -> None:
    kube = FakeKube()
    winner = b"w" * 32
    kube.before_create = lambda: (kube.put(master_secret(OPERATOR_NS, winner)), None)[1]
    model_in(kube, KEYED)
    await one_pass(kube, peer_master=master_of(kube))  # its create answered 409
    kube.before_create = None
    assert base64.b64decode(kube.objects[MASTER]["data"][PEER_MASTER_SECRET_KEY]) == winner
    assert stored_key(kube) == derived(winner)


async def test_an_unusable_master_fails_the_pass_naming_the_fix() -> None:
    kube = FakeKube()
    kube.put(master_secret(OPERATOR_NS, b"short"))
    model_in(kube, KEYED)
    with pytest.raises(PassFailed) as raised:
        await one_pass(kube, peer_master=master_of(kube))
    assert "delete it and restart the operator" in str(raised.value.error)
    assert SECRET not in kube.objects


async def test_a_new_model_uid_gets_a_new_key_and_rolls_the_gateways() -> None:
    kube = FakeKube()
    master = with_master(kube)
    model_in(kube, KEYED)
    peers = master_of(kube)
    await settled(kube, peer_master=peers)
    old = stored_key(kube)
    # The model deleted and made again under its name: a new uid (its children are taken over).
    kube.objects[("DisaggregatedModel", NS, NAME)]["metadata"]["uid"] = "uid-2"
    await settled(kube, peer_master=peers)
    assert stored_key(kube) == derived(master, "uid-2") != old
    assert rolled_for(kube) == peer_key_digest(stored_key(kube))


async def test_a_new_master_rolls_every_gateway() -> None:
    kube = FakeKube()
    with_master(kube)
    model_in(kube, KEYED)
    await settled(kube, peer_master=master_of(kube))
    old = rolled_for(kube)
    # Rotation: the master Secret deleted, the operator restarted (a new cache).
    del kube.objects[MASTER]
    await settled(kube, peer_master=master_of(kube))
    master = base64.b64decode(kube.objects[MASTER]["data"][PEER_MASTER_SECRET_KEY])
    assert stored_key(kube) == derived(master)
    assert rolled_for(kube) == peer_key_digest(derived(master)) != old


async def test_a_deleted_secret_is_made_again_with_the_same_key() -> None:
    kube = FakeKube()
    master = with_master(kube)
    model_in(kube, KEYED)
    peers = master_of(kube)
    await settled(kube, peer_master=peers)
    digest = rolled_for(kube)
    del kube.objects[SECRET]
    writes = len(kube.writes)
    await one_pass(kube, peer_master=peers)
    assert kube.writes[writes:] == [f"apply Secret/{SECRET[2]}"]  # the gateways do not roll
    assert stored_key(kube) == derived(master)
    assert rolled_for(kube) == digest


async def test_taking_the_api_keys_away_prunes_the_secret_and_the_mount() -> None:
    kube = FakeKube()
    master = with_master(kube)
    model_in(kube, KEYED)
    peers = master_of(kube)
    await settled(kube, peer_master=peers)
    set_spec(kube, SPEC)
    before = len(kube.writes)
    outcome = await one_pass(kube, peer_master=peers)
    assert f"Secret/{SECRET[2]}" in outcome.pruned
    # Deleted before the Deployment drops the mount: a failed delete is retried.
    this_pass = kube.writes[before:]
    deleted = this_pass.index(f"delete Secret/{SECRET[2]}")
    assert deleted < this_pass.index(f"apply Deployment/{GATEWAY[2]}")
    assert SECRET not in kube.objects
    pod = gateway_pod(kube)
    assert "--peer-key-file" not in pod["spec"]["containers"][0]["args"]
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["routing"]
    await settled(kube, peer_master=peers)  # and no delete again on later passes
    writes = len(kube.writes)
    await one_pass(kube, peer_master=peers)
    assert kube.writes[writes:] == []
    # And back: the same key, derived again.
    set_spec(kube, KEYED)
    await settled(kube, peer_master=peers)
    assert stored_key(kube) == derived(master)


async def test_the_key_is_never_logged_nor_in_status_nor_in_events(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kube = FakeKube()
    model_in(kube, KEYED)
    with caplog.at_level(logging.DEBUG):
        outcome = await one_pass(kube, peer_master=master_of(kube))
        await settled(kube, peer_master=master_of(kube))
    key = stored_key(kube)
    master = kube.objects[MASTER]["data"][PEER_MASTER_SECRET_KEY]
    secrets = {key, base64.b64encode(key.encode()).decode(), master}
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert outcome.status is not None
    status = kube.objects[("DisaggregatedModel", NS, NAME)].get("status")
    told = json.dumps([outcome.status.to_json(), status, kube.created])
    for secret in secrets:
        assert secret not in logged
        assert secret not in told
        assert not [w for w in kube.writes if secret in w]


async def test_one_replica_without_api_keys_needs_no_master_and_reads_no_secret() -> None:
    kube = FakeKube()
    model_in(kube)
    await settled(kube, peer_master=master_of(kube))
    assert ("Deployment", NS, f"{NAME}-gateway") in kube.objects
    assert secret_reads(kube) == []
    assert MASTER not in kube.objects
    # With API keys and no master key to derive from, the pass fails rather than serve keyless.
    set_spec(kube, KEYED)
    with pytest.raises(PassFailed) as raised:
        await one_pass(kube)
    assert "no peer master key" in str(raised.value.error)


async def test_a_failed_prune_keeps_the_mount_so_the_retry_deletes_the_secret() -> None:
    kube = FakeKube()
    with_master(kube)
    model_in(kube, KEYED)
    peers = master_of(kube)
    await settled(kube, peer_master=peers)
    set_spec(kube, SPEC)
    kube.fail_on = "delete"
    with pytest.raises(PassFailed):
        await one_pass(kube, peer_master=peers)
    assert "--peer-key-file" in gateway_pod(kube)["spec"]["containers"][0]["args"]
    kube.fail_on = None
    outcome = await one_pass(kube, peer_master=peers)
    assert f"Secret/{SECRET[2]}" in outcome.pruned
    assert SECRET not in kube.objects


async def test_replicas_without_api_keys_get_the_key_and_the_mount() -> None:
    kube = FakeKube()
    master = with_master(kube)
    model_in(kube, REPLICATED)
    await settled(kube, peer_master=master_of(kube))
    assert stored_key(kube) == derived(master)
    assert kube.objects[GATEWAY]["spec"]["replicas"] == 2
    pod = gateway_pod(kube)
    [container] = pod["spec"]["containers"]
    assert container["args"][container["args"].index("--peer-key-file") + 1] == PEER_KEY_FILE
    assert "peer-key" in [v["name"] for v in pod["spec"]["volumes"]]
    assert rolled_for(kube) == peer_key_digest(stored_key(kube))
    assert "PDSERVE_API_KEY" not in {e["name"] for e in container["env"]}
    assert secret_reads(kube) == [MASTER_READ]


async def test_one_replica_without_api_keys_gets_no_key() -> None:
    kube = FakeKube()
    with_master(kube)
    model_in(kube)  # SPEC: one gateway replica
    await settled(kube, peer_master=master_of(kube))
    assert kube.objects[GATEWAY]["spec"]["replicas"] == 1
    assert SECRET not in kube.objects
    assert "--peer-key-file" not in gateway_pod(kube)["spec"]["containers"][0]["args"]
    assert [v["name"] for v in gateway_pod(kube)["spec"]["volumes"]] == ["routing"]
    assert secret_reads(kube) == []


async def test_the_pass_that_scales_to_two_replicas_mounts_the_key_and_one_prunes_it() -> None:
    kube = FakeKube()
    master = with_master(kube)
    model_in(kube)
    peers = master_of(kube)
    await settled(kube, peer_master=peers)
    set_spec(kube, REPLICATED)
    before = len(kube.writes)
    await one_pass(kube, peer_master=peers)
    this_pass = kube.writes[before:]
    # One Deployment write carries both: no replica of the new template starts without the
    # key, and the Secret is there before it.
    assert this_pass.count(f"apply Deployment/{GATEWAY[2]}") == 1
    assert this_pass.index(f"apply Secret/{SECRET[2]}") < this_pass.index(
        f"apply Deployment/{GATEWAY[2]}"
    )
    assert kube.objects[GATEWAY]["spec"]["replicas"] == 2
    assert "--peer-key-file" in gateway_pod(kube)["spec"]["containers"][0]["args"]
    assert stored_key(kube) == derived(master)
    await settled(kube, peer_master=peers)
    # And back to one: no peer left to hold on, so the key goes.
    set_spec(kube, SPEC)
    outcome = await one_pass(kube, peer_master=peers)
    assert f"Secret/{SECRET[2]}" in outcome.pruned
    assert SECRET not in kube.objects
    assert kube.objects[GATEWAY]["spec"]["replicas"] == 1
    assert "--peer-key-file" not in gateway_pod(kube)["spec"]["containers"][0]["args"]


async def test_taking_the_api_keys_from_replicas_keeps_their_key() -> None:
    kube = FakeKube()
    master = with_master(kube)
    model_in(kube, KEYED_REPLICATED)
    peers = master_of(kube)
    await settled(kube, peer_master=peers)
    digest = rolled_for(kube)
    set_spec(kube, REPLICATED)
    outcome = await one_pass(kube, peer_master=peers)
    assert f"Secret/{SECRET[2]}" not in outcome.pruned
    assert not [w for w in kube.writes if w.startswith("delete Secret")]
    assert stored_key(kube) == derived(master)
    assert rolled_for(kube) == digest  # the same key: only the API key leaves the pods
    env = gateway_pod(kube)["spec"]["containers"][0]["env"]
    assert "PDSERVE_API_KEY" not in {e["name"] for e in env}


async def test_replicas_without_api_keys_are_served_and_warned_of_when_no_master_can_be_had(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kube = FakeKube()
    model_in(kube, REPLICATED)
    nowhere = PeerMaster(cast(Kube, kube), None)  # the operator run outside a cluster
    with caplog.at_level(logging.WARNING):
        outcome = await one_pass(kube, peer_master=nowhere)
    assert GATEWAY in kube.objects
    assert kube.objects[GATEWAY]["spec"]["replicas"] == 2
    assert SECRET not in kube.objects
    assert "--peer-key-file" not in gateway_pod(kube)["spec"]["containers"][0]["args"]
    assert secret_reads(kube) == []
    assert outcome.status is not None
    [degraded] = [c for c in outcome.status.conditions if c.type == "Degraded"]
    assert degraded.status == "True"
    for told in (degraded.message, caplog.text):
        assert "spec.gateway.replicas" in told
        assert "cannot share the long-prefill limit" in told
        assert "set PDSERVE_OPERATOR_NAMESPACE" in told
    warned = [e for e in outcome.events if e.type == "Warning" and "PDSERVE_OPERATOR_NAMESPACE"
              in e.message]  # fmt: skip
    assert warned, outcome.events
    # Behind API keys the pass still fails, naming the fix.
    set_spec(kube, KEYED_REPLICATED)
    with pytest.raises(PassFailed) as raised:
        await one_pass(kube, peer_master=nowhere)
    assert "set PDSERVE_OPERATOR_NAMESPACE" in str(raised.value.error)


async def test_an_unusable_master_leaves_keyless_replicas_served_naming_the_fix() -> None:
    kube = FakeKube()
    kube.put(master_secret(OPERATOR_NS, b"short"))
    model_in(kube, REPLICATED)
    outcome = await one_pass(kube, peer_master=master_of(kube))
    assert GATEWAY in kube.objects
    assert SECRET not in kube.objects
    assert outcome.status is not None
    [degraded] = [c for c in outcome.status.conditions if c.type == "Degraded"]
    assert "cannot share the long-prefill limit" in degraded.message
    assert "delete it and restart the operator" in degraded.message


def test_the_operator_namespace_comes_from_the_chart_then_the_service_account(
    tmp_path: Path,
) -> None:
    account = tmp_path / "namespace"
    # Unknown: models with API keys fail, replicas without them cannot share the limit.
    assert operator_namespace({}, account) is None
    account.write_text("ops\n")
    assert operator_namespace({}, account) == "ops"
    assert operator_namespace({"PDSERVE_OPERATOR_NAMESPACE": "pdserve-system"}, account) == (
        "pdserve-system"
    )
    with pytest.raises(ValueError, match="not a namespace name"):
        operator_namespace({"PDSERVE_OPERATOR_NAMESPACE": "Not/One"}, account)
