"""The gateways' peer key through reconcile passes on an in-memory API server: generated once in
a Secret the model owns, never rotated by a resync (which writes nothing), mounted into the
gateway pods, replaced only when gone or unusable (rolling the gateways), pruned with the API
keys, and never in a log line, the status or an Event."""

from __future__ import annotations

import base64
import copy
import json
import logging
from typing import Any

import pytest

from pdserve.builders.peer_key import PEER_KEY_FILE, peer_key_digest
from pdserve.contract.names import PEER_KEY_HASH_ANNOTATION, PEER_KEY_SECRET_KEY
from pdserve.controller.reconcile import PassFailed
from tests.support.fakekube import NAME, NS, SPEC, FakeKube, model_in, one_pass, settled

SECRET = ("Secret", NS, f"{NAME}-gateway-peer-key")
GATEWAY = ("Deployment", NS, f"{NAME}-gateway")
KEYED: dict[str, Any] = {
    **SPEC,
    "gateway": {**SPEC["gateway"], "apiKeySecretRef": {"name": "clients", "key": "k"}},
}


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


async def test_the_key_is_made_once_in_a_secret_the_model_owns() -> None:
    kube = FakeKube()
    model_in(kube, KEYED)
    first = await one_pass(kube)
    assert f"Secret/{SECRET[2]}" in first.applied
    # Applied before the Deployment that mounts it: no gateway pod waits for its volume.
    order = first.applied
    assert order.index(f"Secret/{SECRET[2]}") < order.index(f"Deployment/{GATEWAY[2]}")
    key = stored_key(kube)
    assert len(key) >= 43  # 256 bits
    assert key.strip() == key  # one line
    meta = kube.objects[SECRET]["metadata"]
    [owner] = meta["ownerReferences"]
    # The garbage collector deletes it with the model.
    owner_of = (owner["kind"], owner["name"], owner["uid"], owner["controller"])
    assert owner_of == ("DisaggregatedModel", NAME, "uid-1", True)
    assert meta["labels"]["app.kubernetes.io/instance"] == NAME
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "pdserve"
    assert meta["labels"]["pdserve.io/model"] == NAME

    await settled(kube)
    for _ in range(3):  # resyncs: the same key, and not one write
        writes = len(kube.writes)
        again = await one_pass(kube)
        assert kube.writes[writes:] == []
        assert (again.applied, again.pruned, again.status_written) == ([], [], False)
        assert stored_key(kube) == key


async def test_the_gateway_pods_read_the_key_from_its_file_and_carry_its_digest() -> None:
    kube = FakeKube()
    model_in(kube, KEYED)
    await settled(kube)
    pod = gateway_pod(kube)
    [container] = pod["spec"]["containers"]
    assert container["args"][container["args"].index("--peer-key-file") + 1] == PEER_KEY_FILE
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "peer-key"]
    assert volume["secret"]["secretName"] == SECRET[2]
    assert any(m["name"] == "peer-key" for m in container["volumeMounts"])
    assert rolled_for(kube) == peer_key_digest(stored_key(kube))
    assert "PDSERVE_PEER_KEY" not in {e["name"] for e in container["env"]}


@pytest.mark.parametrize("damage", ["deleted", "emptied"])
async def test_a_secret_gone_or_emptied_gets_a_new_key_and_rolls_the_gateways(
    damage: str,
) -> None:
    kube = FakeKube()
    model_in(kube, KEYED)
    await settled(kube)
    old = stored_key(kube)
    if damage == "deleted":
        del kube.objects[SECRET]
    else:
        kube.objects[SECRET]["data"][PEER_KEY_SECRET_KEY] = base64.b64encode(b" \n").decode()
    outcome = await one_pass(kube)
    assert {f"Secret/{SECRET[2]}", f"Deployment/{GATEWAY[2]}"} <= set(outcome.applied)
    new = stored_key(kube)
    assert new.strip()
    assert new != old
    assert rolled_for(kube) == peer_key_digest(new)
    await settled(kube)
    assert stored_key(kube) == new


async def test_a_key_written_by_hand_is_kept_and_rolls_the_gateways() -> None:
    kube = FakeKube()
    model_in(kube, KEYED)
    await settled(kube)
    kube.objects[SECRET]["data"][PEER_KEY_SECRET_KEY] = base64.b64encode(b"mine").decode()
    await settled(kube)
    assert stored_key(kube) == "mine"
    assert rolled_for(kube) == peer_key_digest("mine")


async def test_taking_the_api_keys_away_prunes_the_secret_and_the_mount() -> None:
    kube = FakeKube()
    model_in(kube, KEYED)
    await settled(kube)
    old = stored_key(kube)
    set_spec(kube, SPEC)
    outcome = await one_pass(kube)
    assert f"Secret/{SECRET[2]}" in outcome.pruned
    assert SECRET not in kube.objects
    pod = gateway_pod(kube)
    assert "--peer-key-file" not in pod["spec"]["containers"][0]["args"]
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["routing"]
    # (The digest annotation goes too, as server-side apply drops what pdserve no longer sets;
    # this fake merges maps, so it is not checked here: the builders' tests check it is unset.)
    # And back: a fresh key (the old one is gone with its Secret).
    set_spec(kube, KEYED)
    await settled(kube)
    assert stored_key(kube) != old


async def test_the_key_is_never_logged_nor_in_status_nor_in_events(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kube = FakeKube()
    model_in(kube, KEYED)
    with caplog.at_level(logging.DEBUG):
        outcome = await one_pass(kube)
        await settled(kube)
        del kube.objects[SECRET]  # a second key, made and applied while logging
        await settled(kube)
    key = stored_key(kube)
    secrets = {key, base64.b64encode(key.encode()).decode()}
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert outcome.status is not None
    status = kube.objects[("DisaggregatedModel", NS, NAME)].get("status")
    told = json.dumps([outcome.status.to_json(), status, kube.created])
    for secret in secrets:
        assert secret not in logged
        assert secret not in told
        assert not [w for w in kube.writes if secret in w]


async def test_an_operator_that_may_not_list_secrets_serves_models_without_api_keys() -> None:
    kube = FakeKube()
    kube.forbidden = {"Secret"}
    model_in(kube)
    await settled(kube)
    assert ("Deployment", NS, f"{NAME}-gateway") in kube.objects
    # With API keys it must read its Secret back, or it would make a new key every pass.
    set_spec(kube, KEYED)
    with pytest.raises(PassFailed) as raised:
        await one_pass(kube)
    assert "403" in str(raised.value.error)
