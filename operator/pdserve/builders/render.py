"""The CPU render pool: `vllm launch render` Deployment, Service, HPA and PDB."""

from __future__ import annotations

from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.builders.names import RENDER_PORT, Component, child_name, meta, selector_labels
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
from pdserve.builders.vllm_args import render_args


def render_pool(dm: DisaggregatedModel, parity: str) -> list[dict[str, Any]]:
    render = dm.spec.render
    name = child_name(dm, Component.render)
    volumes, mounts = model_volumes(dm)
    container = {
        "name": "render",
        "image": dm.spec.image.render or dm.spec.image.engine,
        "imagePullPolicy": dm.spec.image.pull_policy,
        "command": ["vllm", "launch", "render"],
        "args": render_args(dm, RENDER_PORT),
        "env": common_env(dm) + env_list(render.env),
        "ports": [{"name": "http", "containerPort": RENDER_PORT, "protocol": "TCP"}],
        "resources": resources(render.resources),
        **http_probes("/health", slow_start=True),
        "volumeMounts": mounts,
    }
    template = pod_template(
        dm,
        Component.render,
        containers=[container],
        volumes=volumes,
        annotations=pod_annotations(parity, render.pod_annotations),
        node_selector=render.node_selector,
        tolerations=[dict(t) for t in render.tolerations],
    )
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(dm, Component.render)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0}},
        "template": template,
    }
    if not render.autoscaling.enabled:
        # With an HPA, replicas is the HPA's field: never set it, or every apply fights it.
        deployment_spec = {"replicas": render.replicas, **deployment_spec}
    objects: list[dict[str, Any]] = [
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": meta(dm, Component.render), "spec": deployment_spec},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(dm, Component.render),
         "spec": {"selector": selector_labels(dm, Component.render),
                  "ports": [{"name": "http", "port": RENDER_PORT, "targetPort": "http",
                             "protocol": "TCP"}]}},
        pdb(dm, Component.render, name),
    ]  # fmt: skip
    if render.autoscaling.enabled:
        scaling = render.autoscaling
        objects.append({
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": meta(dm, Component.render),
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                "minReplicas": scaling.min_replicas,
                "maxReplicas": scaling.max_replicas,
                "metrics": [{
                    "type": "Resource",
                    "resource": {"name": "cpu", "target": {
                        "type": "Utilization",
                        "averageUtilization": scaling.target_cpu_utilization_percentage,
                    }},
                }],
            },
        })  # fmt: skip
    return objects
