"""The generated CRD on a real API server: accepted as structural, defaults filled in, CEL and
schema errors name the field, and what the server stores parses back into the models."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from devtools.clitools import Kubectl
from pdserve.api import parse_resource

pytestmark = pytest.mark.cluster


def dm(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "pdserve.io/v1alpha1", "kind": "DisaggregatedModel",
            "metadata": {"name": name}, "spec": spec}  # fmt: skip


def causes(response: httpx.Response) -> dict[str, str]:
    details = response.json().get("details", {}).get("causes", [])
    return {c["field"]: c["message"] for c in details if c.get("field") not in (None, "<nil>")}


@pytest.mark.usefixtures("dm_crd")
def test_server_fills_defaults_and_the_stored_object_parses(
    http_api: httpx.Client, namespace: str
) -> None:
    url = f"/apis/pdserve.io/v1alpha1/namespaces/{namespace}/disaggregatedmodels"
    spec = {
        "model": {"name": "Qwen/Qwen2.5-7B-Instruct", "source": {"pvc": {"claimName": "weights"}}},
        "serving": {"reasoningParser": "qwen3", "toolCallParser": "hermes",
                    "enableAutoToolChoice": True,
                    "defaultChatTemplateKwargs": {"enable_thinking": False}},
        "prefill": {"tensorParallelSize": 2, "extraArgs": ["--enforce-eager"],
                    "tolerations": [{"key": "gpu", "operator": "Exists"}]},
        "decode": {"replicas": 2, "resources": {"requests": {"cpu": 8, "memory": "64Gi"}}},
        "kvTransfer": {"loadFailurePolicy": "recompute", "extraConfig": {"num_threads": 8}},
    }  # fmt: skip
    created = http_api.post(url, json=dm("qwen", spec))
    assert created.status_code == 201, created.text
    stored = created.json()
    assert stored["spec"]["decode"]["tensorParallelSize"] == 1
    assert stored["spec"]["render"]["autoscaling"]["maxReplicas"] == 4
    assert stored["spec"]["model"]["source"]["pvc"]["path"] == "."
    assert stored["spec"]["kvTransfer"]["extraConfig"] == {"num_threads": 8}
    parsed = parse_resource(stored)
    assert parsed.spec.prefill is not None
    assert parsed.spec.prefill.gpus == 2
    assert parsed.spec.serving.default_chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.usefixtures("dm_crd")
@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({"render": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
         "spec.render.autoscaling.maxReplicas", "maxReplicas must be >= minReplicas"),
        ({"kvTransfer": {"connector": "MooncakeConnector", "loadFailurePolicy": "fail"}},
         "spec.kvTransfer.loadFailurePolicy", "needs a NIXL connector"),
        ({"serving": {"enableAutoToolChoice": True}},
         "spec.serving.enableAutoToolChoice", "needs toolCallParser"),
        ({"decode": {"tensorParallelSize": 0}},
         "spec.decode.tensorParallelSize", "should be greater than or equal to 1"),
        ({"serving": {"blockSize": 12}}, "spec.serving.blockSize", "supported values"),
        ({"serving": {"blockSize": 16}, "placement": {"acceleratorResource": ""}},
         "spec.serving.blockSize", "must be a multiple of 32"),
        ({"kvTransfer": {"ucxTransports": "rc,cuda_copy,cuda_ipc"}},
         "spec.kvTransfer.ucxTransports", "leaves tcp out but placement.rdma is unset"),
        ({"kvTransfer": {"ucxTransports": "^rc,tcp"}},
         "spec.kvTransfer.ucxTransports", "leaves tcp out but placement.rdma is unset"),
    ],
)  # fmt: skip
def test_api_server_rejects_invalid_specs_naming_the_field(
    http_api: httpx.Client, namespace: str, spec: dict[str, Any], field: str, message: str
) -> None:
    url = f"/apis/pdserve.io/v1alpha1/namespaces/{namespace}/disaggregatedmodels"
    response = http_api.post(url, json=dm("bad", {"model": {"name": "m"}, **spec}))
    assert response.status_code == 422
    found = causes(response)
    assert field in found, found
    assert message in found[field]


@pytest.mark.usefixtures("dm_crd")
@pytest.mark.parametrize("transports", ["tcp,cuda_copy", "rc,tcp", "all", "^rc,ud"])
def test_api_server_accepts_transports_that_keep_tcp_without_rdma(
    http_api: httpx.Client, namespace: str, transports: str
) -> None:
    """The CRD's regex (RE2 on the server) agrees with the Python check on what keeps tcp."""
    url = f"/apis/pdserve.io/v1alpha1/namespaces/{namespace}/disaggregatedmodels"
    spec = {"model": {"name": "m"}, "kvTransfer": {"ucxTransports": transports}}
    created = http_api.post(url, json=dm("transports", spec))
    assert created.status_code == 201, created.text
    parse_resource(created.json())


@pytest.mark.usefixtures("dm_crd")
def test_long_names_are_rejected_by_the_server(http_api: httpx.Client, namespace: str) -> None:
    url = f"/apis/pdserve.io/v1alpha1/namespaces/{namespace}/disaggregatedmodels"
    response = http_api.post(url, json=dm("m" * 41, {"model": {"name": "m"}}))
    assert response.status_code == 422
    assert "metadata.name must be at most 40 characters" in response.text


@pytest.mark.usefixtures("dm_crd")
def test_kubectl_explains_fields_and_lists_with_short_names(kubectl: Kubectl) -> None:
    explained = kubectl("explain", "dm.spec.kvTransfer.loadFailurePolicy", check=True).stdout
    assert "recompute the" in explained
    assert "kv_load_failure_policy" in explained
    listed = kubectl("get", "dmodel", "--all-namespaces", check=True)
    assert listed.returncode == 0
