"""The API objects NVIDIA's DRA driver for GPUs writes for ComputeDomains, for the kwok twin.

kwok runs no kubelet plugin and the plane runs no ComputeDomain controller, so a test creates
what they would: the DeviceClasses the Helm chart installs, the ResourceSlice the
compute-domain kubelet plugin publishes on each GB200 node, and the ResourceClaimTemplate the
controller creates for a ComputeDomain. The real scheduler's DRA plugin (GA since Kubernetes
1.34, on by default) then allocates channel claims against them exactly as on hardware.

Every object and field is what the driver writes; sources are NVIDIA/k8s-dra-driver-gpu (now
kubernetes-sigs/dra-driver-nvidia-gpu) at commit 22407113785e78c7763b4637689a201eb39c6199:

- DeviceClasses: deployments/helm/dra-driver-nvidia-gpu/templates/
  deviceclass-compute-domain-{default-channel,daemon}.yaml (resource.k8s.io/v1 where the API
  server serves it: the chart's `resourceApiVersion` helper picks the highest version).
- ResourceSlice: cmd/compute-domain-kubelet-plugin/driver.go NewDriver publishes one pool
  named after the node with one slice holding `channel-0` and `daemon-0` only ("channels are
  ... advertised as a network resource from the control plane": IDs 1..2047 are skipped);
  deviceinfo.go gives each device exactly two attributes, `type` and `id`. Neither device is
  marked allowMultipleAllocations, so channel-0 backs ONE allocated claim per node: at most
  one pod per node can hold a ComputeDomain channel claim (kubernetes-sigs/dra-driver-nvidia-gpu
  issues #309 and #353: one ComputeDomain per node; multiple pods per node only through one
  shared, manually managed ResourceClaim).
  The slice's metadata is what k8s.io/dynamic-resource-allocation/resourceslice (v0.36,
  vendored) writes for a fresh pool: generateName `<5-hex index>-<driver>-<node>-`, the Node as
  controlling owner, pool generation 1, resourceSliceCount 1.
- ResourceClaimTemplate: templates/compute-domain-workload-claim-template.tmpl.yaml rendered by
  cmd/compute-domain-controller/resourceclaimtemplate.go (WorkloadResourceClaimTemplateManager
  .Create) with the constants of cmd/compute-domain-controller/computedomain.go: the
  ComputeDomain's namespace and spec.channel.resourceClaimTemplate.name, finalizer and label
  resource.nvidia.com/computeDomain=<ComputeDomain UID>, label
  resource.nvidia.com/computeDomainTarget=Workload, one request `channel` of DeviceClass
  compute-domain-default-channel.nvidia.com, and an opaque ComputeDomainChannelConfig
  (resource.nvidia.com/v1beta1) carrying domainID=<UID> and allocationMode, the
  ComputeDomain's spec.channel.allocationMode (its CRD defaults it to Single:
  deployments/helm/dra-driver-nvidia-gpu/crds/resource.nvidia.com_computedomains.yaml).

Not modelled: the node label resource.nvidia.com/computeDomain=<UID>. The kubelet plugin sets
it in Prepare (device_state.go applyComputeDomainChannelConfig -> AddNodeLabel), after the pod
is bound, to place the per-domain IMEX daemon DaemonSet (controller daemonset.go nodeSelector);
workload pods get no affinity from it, so it plays no part in scheduling, and kwok runs no
Prepare.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from devtools.localplane import ControlPlaneError

RESOURCE_API = "resource.k8s.io/v1"
RESOURCE_PATH = f"/apis/{RESOURCE_API}"
# cmd/compute-domain-kubelet-plugin/main.go and cmd/compute-domain-controller/main.go.
COMPUTE_DOMAIN_DRIVER = "compute-domain.nvidia.com"
# The Helm chart's DeviceClasses (deviceclass-compute-domain-*.yaml).
DEFAULT_CHANNEL_CLASS = "compute-domain-default-channel.nvidia.com"
DAEMON_CLASS = "compute-domain-daemon.nvidia.com"
# cmd/compute-domain-controller/computedomain.go.
COMPUTE_DOMAIN_LABEL = "resource.nvidia.com/computeDomain"
COMPUTE_DOMAIN_FINALIZER = COMPUTE_DOMAIN_LABEL
TARGET_LABEL = "resource.nvidia.com/computeDomainTarget"
TARGET_WORKLOAD = "Workload"
# api/nvidia.com/resource/v1beta1/{api.go,computedomainconfig.go}.
CONFIG_API_VERSION = "resource.nvidia.com/v1beta1"
CHANNEL_CONFIG_KIND = "ComputeDomainChannelConfig"
# The request name in templates/compute-domain-workload-claim-template.tmpl.yaml.
CHANNEL_REQUEST = "channel"
CHANNEL_DEVICE = "channel-0"
DAEMON_DEVICE = "daemon-0"


def device_classes() -> list[dict[str, Any]]:
    """The two ComputeDomain DeviceClasses the chart installs (resources.computeDomains.enabled,
    its default)."""
    attrs = f"device.attributes['{COMPUTE_DOMAIN_DRIVER}']"
    driver = f"device.driver == '{COMPUTE_DOMAIN_DRIVER}'"
    return [
        _device_class(DAEMON_CLASS, f"{driver} && {attrs}.type == 'daemon'"),
        _device_class(
            DEFAULT_CHANNEL_CLASS, f"{driver} && {attrs}.type == 'channel' && {attrs}.id == 0"
        ),
    ]


def _device_class(name: str, expression: str) -> dict[str, Any]:
    return {
        "apiVersion": RESOURCE_API,
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


def _device(kind: str, index: int) -> dict[str, Any]:
    # deviceinfo.go GetDevice: name "<type>-<id>", attributes type (string) and id (int).
    return {
        "name": f"{kind}-{index}",
        "attributes": {"type": {"string": kind}, "id": {"int": index}},
    }


def resource_slice(node: Mapping[str, Any]) -> dict[str, Any]:
    """The ResourceSlice the compute-domain kubelet plugin publishes on `node` (a Node object as
    read from the API server: its UID becomes the owner reference)."""
    name, uid = node["metadata"]["name"], node["metadata"]["uid"]
    return {
        "apiVersion": RESOURCE_API,
        "kind": "ResourceSlice",
        "metadata": {
            "generateName": f"00000-{COMPUTE_DOMAIN_DRIVER}-{name}-",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid, "controller": True}
            ],
        },
        "spec": {
            "driver": COMPUTE_DOMAIN_DRIVER,
            "nodeName": name,
            "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
            "devices": [_device("channel", 0), _device("daemon", 0)],
        },
    }


def compute_domain_claim_template(
    namespace: str, name: str, *, domain_uid: str, allocation_mode: str = "Single"
) -> dict[str, Any]:
    """The ResourceClaimTemplate the ComputeDomain controller creates for a ComputeDomain of
    UID `domain_uid` in `namespace` whose spec.channel.resourceClaimTemplate.name is `name`;
    `allocation_mode` is its spec.channel.allocationMode (Single, the CRD's default, or All)."""
    parameters = {
        "apiVersion": CONFIG_API_VERSION,
        "kind": CHANNEL_CONFIG_KIND,
        "domainID": domain_uid,
        "allocationMode": allocation_mode,
    }
    return {
        "apiVersion": RESOURCE_API,
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "namespace": namespace,
            "name": name,
            "finalizers": [COMPUTE_DOMAIN_FINALIZER],
            "labels": {COMPUTE_DOMAIN_LABEL: domain_uid, TARGET_LABEL: TARGET_WORKLOAD},
        },
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": CHANNEL_REQUEST,
                            "exactly": {"deviceClassName": DEFAULT_CHANNEL_CLASS},
                        }
                    ],
                    "config": [
                        {
                            "requests": [CHANNEL_REQUEST],
                            "opaque": {"driver": COMPUTE_DOMAIN_DRIVER, "parameters": parameters},
                        }
                    ],
                }
            }
        },
    }


# ---- on the plane ----------------------------------------------------------------------------


def _post(http: httpx.Client, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    if response.status_code == 409:
        return {}
    if not response.is_success:
        raise ControlPlaneError(f"creating {body['kind']} at {path}: {response.text}")
    created: dict[str, Any] = response.json()
    return created


def serves_resource_v1(http: httpx.Client) -> bool:
    return http.get(RESOURCE_PATH).is_success


def install_device_classes(http: httpx.Client) -> list[str]:
    """Create the chart's ComputeDomain DeviceClasses; returns their names."""
    if not serves_resource_v1(http):
        raise ControlPlaneError(f"the API server does not serve {RESOURCE_API}")
    for body in device_classes():
        _post(http, f"{RESOURCE_PATH}/deviceclasses", body)
    return [c["metadata"]["name"] for c in device_classes()]


def publish_resource_slices(http: httpx.Client, node_names: Iterable[str]) -> list[str]:
    """Publish each node's compute-domain ResourceSlice as its kubelet plugin would, replacing
    one published before; returns the slices' names."""
    names = []
    for node_name in node_names:
        node = http.get(f"/api/v1/nodes/{node_name}")
        if not node.is_success:
            raise ControlPlaneError(f"reading node {node_name}: {node.text}")
        delete_resource_slices(http, [node_name])
        created = _post(http, f"{RESOURCE_PATH}/resourceslices", resource_slice(node.json()))
        names.append(created["metadata"]["name"])
    return names


def delete_resource_slices(http: httpx.Client, node_names: Iterable[str]) -> None:
    """Remove the compute-domain ResourceSlices of these nodes (the kubelet plugin's cleanup)."""
    for node_name in node_names:
        selector = f"spec.nodeName={node_name},spec.driver={COMPUTE_DOMAIN_DRIVER}"
        listed = http.get(f"{RESOURCE_PATH}/resourceslices", params={"fieldSelector": selector})
        listed.raise_for_status()
        for item in listed.json()["items"]:
            http.delete(f"{RESOURCE_PATH}/resourceslices/{item['metadata']['name']}")


def create_compute_domain_claim_template(
    http: httpx.Client, namespace: str, name: str, *, domain_uid: str
) -> dict[str, Any]:
    """What the ComputeDomain controller creates when a ComputeDomain appears in `namespace`."""
    body = compute_domain_claim_template(namespace, name, domain_uid=domain_uid)
    path = f"{RESOURCE_PATH}/namespaces/{namespace}/resourceclaimtemplates"
    return _post(http, path, body)


def delete_compute_domain_claim_template(http: httpx.Client, namespace: str, name: str) -> None:
    """The controller's cleanup: delete, then drop its finalizer so the object goes."""
    path = f"{RESOURCE_PATH}/namespaces/{namespace}/resourceclaimtemplates/{name}"
    http.delete(path)
    http.patch(
        path,
        json=[{"op": "remove", "path": "/metadata/finalizers"}],
        headers={"Content-Type": "application/json-patch+json"},
    )
