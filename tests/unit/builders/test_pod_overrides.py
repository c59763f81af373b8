"""podOverrides: what a cluster's own rules need (priority, scheduler, runtime class, identity,
labels, volumes, init containers, sidecars, spread, affinity, securityContext) lands on each
pool's pods, merged onto what pdserve builds; and whatever would collide with pdserve's own
names, paths or wiring is refused naming the field and the fix."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from pdserve.api import DisaggregatedModel
from pdserve.api.images import DEFAULT_GATEWAY_IMAGE
from pdserve.builders import build_all
from pdserve.builders.pods import RESTRICTED_POD_SECURITY
from pdserve.controller.settings import OperatorSettings, add_arguments, from_arguments
from tests.unit.builders.test_engine_lifecycle import container, objects, pod, problems
from tests.unit.builders.test_scaling_builders import model

OVERRIDES: dict[str, Any] = {
    "labels": {"team": "search", "kueue.x-k8s.io/queue-name": "gpu"},
    "priorityClassName": "inference-high",
    "schedulerName": "kai-scheduler",
    "runtimeClassName": "nvidia",
    "volumes": [{"name": "certs", "secret": {"secretName": "store-ca"}}],
    "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/store", "readOnly": True}],
    "initContainers": [{"name": "warm", "image": "busybox:1.37", "command": ["true"]}],
    "sidecars": [{"name": "log-shipper", "image": "fluent/fluent-bit:3.2"}],
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                   "whenUnsatisfiable": "ScheduleAnyway",
                                   "labelSelector": {"matchLabels": {"team": "search"}}}],
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 50, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": {"matchLabels": {"team": "x"}}}}]}},
}  # fmt: skip

POOLS = {
    "prefill": "StatefulSet/qwen-prefill",
    "decode": "StatefulSet/qwen-decode",
    "render": "Deployment/qwen-render",
    "gateway": "Deployment/qwen-gateway",
}


@pytest.mark.parametrize("pool", list(POOLS))
def test_each_pools_overrides_land_on_its_pods_and_keep_pdserves_own(pool: str) -> None:
    plain = objects(model())[POOLS[pool]]
    built = objects(model(**{pool: {"podOverrides": OVERRIDES}}))
    template, spec = built[POOLS[pool]]["spec"]["template"], pod(built[POOLS[pool]])
    assert template["metadata"]["labels"] == {
        **plain["spec"]["template"]["metadata"]["labels"], **OVERRIDES["labels"]
    }  # fmt: skip
    assert spec["priorityClassName"] == "inference-high"
    assert spec["schedulerName"] == "kai-scheduler"
    assert spec["runtimeClassName"] == "nvidia"
    # Added after pdserve's own volumes, mounts and containers, which stay as they were.
    assert spec["volumes"] == [*pod(plain).get("volumes", []), *OVERRIDES["volumes"]]
    main = container(built[POOLS[pool]])
    assert main["volumeMounts"] == [*container(plain)["volumeMounts"], *OVERRIDES["volumeMounts"]]
    assert main["args"] == container(plain)["args"]
    assert main["env"] == container(plain)["env"]
    assert [c["name"] for c in spec["containers"]] == [main["name"], "log-shipper"]
    assert spec["initContainers"] == OVERRIDES["initContainers"]
    assert spec["topologySpreadConstraints"] == OVERRIDES["topologySpreadConstraints"]
    # Terms added to pdserve's affinity, whose own terms stay.
    affinity = spec["affinity"]
    for kind, terms in pod(plain).get("affinity", {}).items():
        assert affinity[kind] == terms
    assert affinity["podAntiAffinity"] == OVERRIDES["affinity"]["podAntiAffinity"]
    # The other pools are untouched.
    for other, key in POOLS.items():
        if other != pool:
            assert built[key] == objects(model())[key], other


def test_security_contexts_and_the_service_account_replace_pdserves() -> None:
    plain = pod(objects(model())["Deployment/qwen-render"])
    assert plain["securityContext"] == RESTRICTED_POD_SECURITY
    assert plain["automountServiceAccountToken"] is False
    own = {"runAsNonRoot": True, "runAsUser": 2000, "seccompProfile": {"type": "RuntimeDefault"}}
    render = pod(objects(model(render={"podOverrides": {
        "securityContext": own, "containerSecurityContext": {"readOnlyRootFilesystem": True},
        "serviceAccountName": "model-store-reader",
    }}))["Deployment/qwen-render"])  # fmt: skip
    assert render["securityContext"] == own
    assert render["containers"][0]["securityContext"] == {"readOnlyRootFilesystem": True}
    assert render["serviceAccountName"] == "model-store-reader"
    assert "automountServiceAccountToken" not in render  # the user's identity: theirs to mount


def test_the_gateway_service_takes_annotations() -> None:
    annotations = {"service.beta.kubernetes.io/aws-load-balancer-internal": "true"}
    service = objects(model(gateway={"serviceAnnotations": annotations}))["Service/qwen-gateway"]
    assert service["metadata"]["annotations"] == annotations
    assert "annotations" not in objects(model())["Service/qwen-gateway"]["metadata"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"labels": {"app.kubernetes.io/component": "x"}},
         "spec.decode.podOverrides.labels: app.kubernetes.io/component: keys under "
         "app.kubernetes.io/ and pdserve.io/ are pdserve's"),
        ({"volumes": [{"name": "model", "emptyDir": {}}]},
         "spec.decode.podOverrides.volumes: volume name model is pdserve's own"),
        ({"volumes": [{"emptyDir": {}}]},
         "spec.decode.podOverrides.volumes: [0] has no name"),
        ({"volumeMounts": [{"name": "certs", "mountPath": "/models/extra"}]},
         "spec.decode.podOverrides.volumeMounts: [0].mountPath /models/extra "
         "overlaps pdserve's mount /models; mount elsewhere"),
        ({"volumeMounts": [{"name": "certs", "mountPath": "/etc"}]},
         "[0].mountPath /etc overlaps pdserve's mount /etc/pdserve"),
        ({"volumeMounts": [{"name": "hf-cache", "mountPath": "/cache"}]},
         "[0].name hf-cache is pdserve's own volume"),
        ({"sidecars": [{"name": "vllm", "image": "x"}]},
         "spec.decode.podOverrides.sidecars: container name vllm is pdserve's own"),
        ({"initContainers": [{"name": "a"}, {"name": "a"}]},
         "spec.decode.podOverrides.initContainers: two containers share a name"),
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}},
         "use the pool's nodeSelector"),
        ({"hostNetwork": True}, "spec.decode.podOverrides.hostNetwork"),
    ],
)  # fmt: skip
def test_what_would_collide_with_pdserves_pods_is_refused_naming_the_field(
    overrides: dict[str, Any], expected: str
) -> None:
    assert expected in problems(decode={"podOverrides": overrides})


def test_the_gateway_keeps_its_own_service_account() -> None:
    message = problems(gateway={"podOverrides": {"serviceAccountName": "mine"}})
    assert "spec.gateway.podOverrides: serviceAccountName: the gateway runs as" in (message)


# ---- the gateway's image: the operator's own unless the spec names one ---------------------


def settings_of(argv: list[str], env: dict[str, str]) -> OperatorSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_arguments(parser.parse_args(argv), env)


def test_the_gateway_runs_the_operators_image_unless_the_spec_names_one() -> None:
    def image(dm: DisaggregatedModel, operators: str) -> str:
        built = {f"{o['kind']}/{o['metadata']['name']}": o
                 for o in build_all(dm, gateway_image=operators)}  # fmt: skip
        return str(container(built["Deployment/qwen-gateway"])["image"])

    # Nothing stored in the object: an operator upgrade moves the gateway with it.
    assert "gateway" not in model().to_json()["spec"]["image"]
    assert image(model(), "registry.example/pdserve:0.2.0") == "registry.example/pdserve:0.2.0"
    pinned = model(image={"gateway": "registry.example/pdserve:0.1.5"})
    assert image(pinned, "registry.example/pdserve:0.2.0") == "registry.example/pdserve:0.1.5"
    # The operator's own image comes from the chart's environment, or the flag.
    env = {"PDSERVE_GATEWAY_IMAGE": "registry.example/pdserve:0.2.0"}
    assert settings_of([], env).gateway_image == "registry.example/pdserve:0.2.0"
    assert settings_of(["--gateway-image", "mine:1"], env).gateway_image == "mine:1"
    assert settings_of([], {}).gateway_image == DEFAULT_GATEWAY_IMAGE
