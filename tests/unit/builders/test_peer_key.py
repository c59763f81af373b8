"""The gateways' peer key as built: the Secret that holds the key the controller chose, the
gateway pods reading it from a file, rolled by its digest; for a gateway behind API keys or with
more than one replica (they hold long-prefill slots on each other, which needs the key), nothing
for one replica without API keys, nor in `pdserve manifests` (which never writes a key into a
file)."""

from __future__ import annotations

import base64
import copy
import json
import os
from pathlib import Path
from typing import Any

from pdserve.api import DisaggregatedModel, parse_resource
from pdserve.builders import build_all
from pdserve.builders.names import labels
from pdserve.builders.peer_key import PEER_KEY_FILE, peer_key_digest
from pdserve.contract.names import (
    PEER_KEY_HASH_ANNOTATION,
    PEER_KEY_SECRET_KEY,
    Component,
    peer_key_secret_name,
)
from pdserve.manifests import render_manifests
from pdserve.yamlio import dump_documents

GOLDEN = Path(__file__).parent / "golden" / "peer-key"
UPDATE = os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1"
KEY = "test-peer-key-not-random"
API_KEY_REF = {"name": "clients", "key": "api-key"}
BODY: dict[str, Any] = {
    "metadata": {"name": "m", "namespace": "ns"},
    "spec": {"model": {"name": "org/model"}, "prefill": {}},
}


def model(*, api_keys: bool = True, replicas: int | None = None) -> DisaggregatedModel:
    """`replicas`: the gateway's (None: the default, 2)."""
    body = copy.deepcopy(BODY)
    gateway: dict[str, Any] = {}
    body["spec"]["gateway"] = gateway
    if api_keys:
        gateway["apiKeySecretRef"] = API_KEY_REF
    if replicas is not None:
        gateway["replicas"] = replicas
    return parse_resource(body)


def by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def gateway_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = by_key(objects)[("Deployment", "m-gateway")]["spec"]["template"]
    return pod


def test_golden_peer_key_secret_and_gateway_deployment() -> None:
    objects = by_key(build_all(model(), peer_key=KEY))
    rendered = dump_documents(
        [objects[("Secret", "m-gateway-peer-key")], objects[("Deployment", "m-gateway")]]
    )
    golden = GOLDEN / "api-keys.yaml"
    if UPDATE:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(rendered)
    assert golden.exists(), f"no golden file: run PDSERVE_UPDATE_GOLDEN=1 pytest {__file__}"
    assert rendered == golden.read_text(), (
        "the peer key builds differently from its golden file; if intended, regenerate with "
        "PDSERVE_UPDATE_GOLDEN=1 and review the diff"
    )


def test_the_secret_holds_the_given_key_with_the_models_gateway_labels() -> None:
    secret = by_key(build_all(model(), peer_key=KEY))[("Secret", peer_key_secret_name("m"))]
    assert secret["metadata"]["labels"] == labels(model(), Component.gateway)
    assert secret["metadata"]["namespace"] == "ns"
    assert base64.b64decode(secret["data"][PEER_KEY_SECRET_KEY]).decode() == KEY


def test_the_gateway_reads_the_key_from_the_mounted_secret_file() -> None:
    pod = gateway_pod(build_all(model(), peer_key=KEY))
    [container] = pod["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--peer-key-file") + 1] == PEER_KEY_FILE
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "peer-key"]
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "peer-key"]
    [item] = volume["secret"]["items"]
    assert f"{mount['mountPath']}/{item['path']}" == PEER_KEY_FILE
    assert (volume["secret"]["secretName"], item["key"]) == ("m-gateway-peer-key", "peer-key")
    assert mount["readOnly"] is True


def test_the_key_is_only_in_its_secret() -> None:
    encoded = base64.b64encode(KEY.encode()).decode()
    for obj in build_all(model(), peer_key=KEY):
        if obj["kind"] != "Secret":
            text = json.dumps(obj)
            assert KEY not in text, obj["kind"]
            assert encoded not in text, obj["kind"]


def test_a_new_key_rolls_the_gateways_and_the_same_key_builds_the_same() -> None:
    def digest(key: str) -> str:
        annotations = gateway_pod(build_all(model(), peer_key=key))["metadata"]["annotations"]
        return str(annotations[PEER_KEY_HASH_ANNOTATION])

    assert digest(KEY) == digest(KEY)
    assert digest(KEY) != digest(KEY + "-rotated")
    assert build_all(model(), peer_key=KEY) == build_all(model(), peer_key=KEY)


def test_replicas_without_api_keys_get_the_key_for_their_holds_on_each_other() -> None:
    # Each gateway refuses a hold without the peer key, API keys or not: without it the
    # replicas could not share the long-prefill limit.
    for replicas in (None, 2, 5):
        objects = by_key(build_all(model(api_keys=False, replicas=replicas), peer_key=KEY))
        secret = objects[("Secret", peer_key_secret_name("m"))]
        assert base64.b64decode(secret["data"][PEER_KEY_SECRET_KEY]).decode() == KEY
        deployment = objects[("Deployment", "m-gateway")]
        assert deployment["spec"]["replicas"] == (replicas or 2)
        pod = deployment["spec"]["template"]
        [container] = pod["spec"]["containers"]
        assert container["args"][container["args"].index("--peer-key-file") + 1] == PEER_KEY_FILE
        assert "peer-key" in [v["name"] for v in pod["spec"]["volumes"]]
        assert pod["metadata"]["annotations"][PEER_KEY_HASH_ANNOTATION] == peer_key_digest(KEY)
        assert "PDSERVE_API_KEY" not in {e["name"] for e in container["env"]}


def test_golden_peer_key_of_replicas_without_api_keys() -> None:
    objects = by_key(build_all(model(api_keys=False), peer_key=KEY))
    rendered = dump_documents(
        [objects[("Secret", "m-gateway-peer-key")], objects[("Deployment", "m-gateway")]]
    )
    golden = GOLDEN / "replicas.yaml"
    if UPDATE:
        golden.write_text(rendered)
    assert golden.exists(), f"no golden file: run PDSERVE_UPDATE_GOLDEN=1 pytest {__file__}"
    assert rendered == golden.read_text(), (
        "the peer key builds differently from its golden file; if intended, regenerate with "
        "PDSERVE_UPDATE_GOLDEN=1 and review the diff"
    )


def test_one_replica_without_api_keys_gets_no_key_even_when_given_one() -> None:
    # No peer to hold a slot on: no Secret, no master key, nothing that rolls.
    alone = model(api_keys=False, replicas=1)
    assert build_all(alone, peer_key=KEY) == build_all(alone)
    assert not [o for o in build_all(alone, peer_key=KEY) if o["kind"] == "Secret"]
    assert [v["name"] for v in gateway_pod(build_all(alone))["spec"]["volumes"]] == ["routing"]


def test_one_replica_behind_api_keys_keeps_its_key() -> None:
    objects = by_key(build_all(model(replicas=1), peer_key=KEY))
    assert ("Secret", peer_key_secret_name("m")) in objects


def test_scaling_from_one_replica_mounts_the_key_in_the_same_deployment() -> None:
    # One object carries both: the apply that adds the second replica also gives every
    # replica of the new template the key, and the digest rolls the first one onto it.
    one = by_key(build_all(model(api_keys=False, replicas=1), peer_key=KEY))
    two = by_key(build_all(model(api_keys=False, replicas=2), peer_key=KEY))
    assert ("Secret", peer_key_secret_name("m")) in two
    before, after = one[("Deployment", "m-gateway")], two[("Deployment", "m-gateway")]
    assert (before["spec"]["replicas"], after["spec"]["replicas"]) == (1, 2)
    assert "--peer-key-file" in after["spec"]["template"]["spec"]["containers"][0]["args"]
    annotations = before["spec"]["template"]["metadata"]["annotations"]
    assert PEER_KEY_HASH_ANNOTATION not in annotations


def test_without_a_key_the_replicas_send_their_api_key_as_before() -> None:
    objects = build_all(model())
    assert not [o for o in objects if o["kind"] == "Secret"]
    pod = gateway_pod(objects)
    assert "--peer-key-file" not in pod["spec"]["containers"][0]["args"]
    assert PEER_KEY_HASH_ANNOTATION not in pod["metadata"]["annotations"]
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["routing"]


def test_manifests_never_write_a_key() -> None:
    for dm in (model(), model(api_keys=False)):
        rendered = render_manifests([dm])
        assert "kind: Secret" not in rendered
        assert "--peer-key-file" not in rendered
