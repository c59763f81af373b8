"""The CPU render pool: `vllm launch render` Deployment, Service, PDB, and its autoscaler: an
HPA (CPU + the parser-busy Pods metrics) or a KEDA ScaledObject; the Builtin engine needs no
object (the operator sets replicas itself)."""

from __future__ import annotations

from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.api.autoscaling import RenderAutoscaler
from pdserve.builders.names import child_name, meta, selector_labels
from pdserve.builders.pods import (
    common_env,
    env_list,
    http_probes,
    model_volumes,
    pdb,
    pod_annotations,
    pod_template,
    resources,
)
from pdserve.builders.scaling import (
    GATEWAY_BUSY_METRIC,
    GATEWAY_DURATION_SERIES,
    PARSER_BUSY_METRIC,
    RENDER_HANDLERS,
    SERVER_DURATION_SERIES,
    ReplicaPlan,
    hpa_behavior,
    render_replicas,
)
from pdserve.builders.vllm_args import render_args
from pdserve.contract.names import RENDER_PORT, Component
from pdserve.contract.pod_layout import NON_ROOT_HOME
from pdserve.vllm.lora import SKIP_MODEL_NAME_CHECK

# Grace after the drain: the server finishes in-flight derender calls on SIGTERM.
SHUTDOWN_SECONDS = 30


def quantity(milli: int) -> str:
    """Milli-units in the API server's canonical form ("700m", "2"), so live and desired match."""
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def busy_target(dm: DisaggregatedModel) -> float:
    """Busy seconds per second one render pod should carry: workers x the target share."""
    render = dm.spec.render
    return render.worker_count * render.autoscaling.target_parser_busy_percent / 100


def adapter_env(dm: DisaggregatedModel) -> list[dict[str, Any]]:
    """With LoRA adapters: `vllm launch render` builds no LoRA config (it ignores the LoRA flags)
    and answers an adapter's name with 404, yet renders it with the model's tokenizer and
    template as `vllm serve` does. It then takes any name and passes it on in the rendered
    request, where the engines select the adapter by it; the gateway has already refused every
    name but the model's and its adapters'."""
    if not dm.spec.model.adapters:
        return []
    return [{"name": SKIP_MODEL_NAME_CHECK, "value": "1"}]


def render_pool(
    dm: DisaggregatedModel, parity: str, plan: ReplicaPlan | None = None
) -> list[dict[str, Any]]:
    render = dm.spec.render
    name = child_name(dm, Component.render)
    volumes, mounts = model_volumes(dm, non_root=True)
    container = {
        "name": "render",
        "image": dm.spec.image.render_image,
        "imagePullPolicy": dm.spec.image.pull_policy,
        "command": ["vllm", "launch", "render"],
        "args": render_args(dm, RENDER_PORT),
        # vLLM's images are built for root: HOME moves to a writable emptyDir (the pod runs as
        # NON_ROOT_UID), where vLLM and Hugging Face keep what they write.
        "env": [
            {"name": "HOME", "value": NON_ROOT_HOME},
            *common_env(dm),
            *adapter_env(dm),
            *env_list(render.env),
        ],
        "ports": [{"name": "http", "containerPort": RENDER_PORT, "protocol": "TCP"}],
        "resources": resources(
            render.resources.model_copy(
                update={"requests": {"cpu": render.cpu_request, **render.resources.requests}}
            )
        ),
        **http_probes("/health", slow_start=True),
        "volumeMounts": mounts,
    }
    if render.drain_seconds:
        # Gateways drop a terminating pod from their endpoints at once (pod watch); the sleep
        # covers the watch's delay before SIGTERM stops the listener.
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": render.drain_seconds}}}
    template = pod_template(
        dm,
        Component.render,
        containers=[container],
        volumes=volumes,
        annotations=pod_annotations(parity, render.pod_annotations),
        node_selector=render.node_selector,
        tolerations=[dict(t) for t in render.tolerations],
        termination_grace_seconds=render.drain_seconds + SHUTDOWN_SECONDS,
        overrides=render.pod_overrides,
    )
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(dm, Component.render)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0}},
        "template": template,
    }
    replicas = render_replicas(dm, plan)
    if replicas is not None:
        # With an HPA or KEDA, replicas is the autoscaler's field: never set it, or every apply
        # fights it.
        deployment_spec = {"replicas": replicas, **deployment_spec}
    objects: list[dict[str, Any]] = [
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": meta(dm, Component.render), "spec": deployment_spec},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(dm, Component.render),
         "spec": {"selector": selector_labels(dm, Component.render),
                  "ports": [{"name": "http", "port": RENDER_PORT, "targetPort": "http",
                             "protocol": "TCP"}]}},
        pdb(dm, Component.render, name),
    ]  # fmt: skip
    scaling = render.autoscaling
    if scaling.enabled and scaling.engine is RenderAutoscaler.hpa:
        objects.append(render_hpa(dm))
    elif scaling.enabled and scaling.engine is RenderAutoscaler.keda:
        objects.append(render_scaled_object(dm))
    return objects


def render_hpa(dm: DisaggregatedModel) -> dict[str, Any]:
    """CPU (the floor) plus the two parser-load Pods metrics the chart's Prometheus Adapter
    rule serves; the HPA follows whichever asks for the most replicas."""
    scaling = dm.spec.render.autoscaling
    busy = {"type": "AverageValue", "averageValue": quantity(round(busy_target(dm) * 1000))}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta(dm, Component.render),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                               "name": child_name(dm, Component.render)},
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [
                {"type": "Resource", "resource": {"name": "cpu", "target": {
                    "type": "Utilization",
                    "averageUtilization": scaling.target_cpu_utilization_percentage,
                }}},
                {"type": "Pods", "pods": {"metric": {"name": PARSER_BUSY_METRIC},
                                          "target": busy}},
                {"type": "Pods", "pods": {"metric": {"name": GATEWAY_BUSY_METRIC},
                                          "target": busy}},
            ],
            "behavior": hpa_behavior(scaling),
        },
    }  # fmt: skip


def render_scaled_object(dm: DisaggregatedModel) -> dict[str, Any]:
    """A KEDA ScaledObject: Prometheus triggers on the pool's parser busy time (summed; KEDA's
    AverageValue divides by replicas) as the render servers and the gateways measure it, and
    CPU. The series carry the model and pool labels the chart's PodMonitor adds."""
    scaling = dm.spec.render.autoscaling
    assert scaling.prometheus_address is not None
    threshold = f"{busy_target(dm):g}"
    scope = f'namespace="{dm.namespace}",model="{dm.name}"'
    server = (
        f'sum(rate({SERVER_DURATION_SERIES}{{{scope},pool="render",'
        f'handler=~"{RENDER_HANDLERS}"}}[1m]))'
    )
    gateway = f'sum(rate({GATEWAY_DURATION_SERIES}{{{scope},pool="gateway"}}[1m]))'

    def prometheus(name: str, query: str) -> dict[str, Any]:
        return {"type": "prometheus", "name": name, "metricType": "AverageValue",
                "metadata": {"serverAddress": scaling.prometheus_address, "query": query,
                             "threshold": threshold}}  # fmt: skip

    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": meta(dm, Component.render),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                               "name": child_name(dm, Component.render)},
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": 15,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": hpa_behavior(scaling)}},
            "triggers": [
                prometheus("parser-busy", server),
                prometheus("gateway-busy", gateway),
                {"type": "cpu", "metricType": "Utilization",
                 "metadata": {"value": str(scaling.target_cpu_utilization_percentage)}},
            ],
        },
    }  # fmt: skip
