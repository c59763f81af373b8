"""Who owns replicas, and the autoscaler objects pdserve builds: render HPA (CPU + parser-busy
Pods metrics), KEDA ScaledObject, the Builtin engine's replicas, engine pools in whole slices,
and every refusal naming its field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdserve.api import DisaggregatedModel, SpecError, parse_resource
from pdserve.builders import ReplicaPlan, build_all


def model(**spec: Any) -> DisaggregatedModel:
    body: dict[str, Any] = {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "DisaggregatedModel",
        "metadata": {"name": "qwen", "namespace": "llm"},
        "spec": {"model": {"name": "Qwen/Qwen3-8B"}, "prefill": {"replicas": 1}},
    }
    body["spec"].update(copy.deepcopy(spec))
    return parse_resource(body)


def objects(dm: DisaggregatedModel, plan: ReplicaPlan | None = None) -> dict[str, Any]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in build_all(dm, plan=plan)}


def problems(**spec: Any) -> str:
    with pytest.raises(SpecError) as caught:
        model(**spec)
    return "; ".join(caught.value.problems)


def args_of(obj: dict[str, Any]) -> list[str]:
    args: list[str] = obj["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def test_default_hpa_scales_on_cpu_and_parser_busy_and_leaves_replicas_alone() -> None:
    built = objects(model(render={"resources": {"requests": {"cpu": "2"}}}))
    assert "replicas" not in built["Deployment/qwen-render"]["spec"]
    hpa = built["HorizontalPodAutoscaler/qwen-render"]["spec"]
    cpu, parser, gateway = hpa["metrics"]
    assert cpu["resource"]["target"] == {"type": "Utilization", "averageUtilization": 70}
    # Two workers (a worker per requested core) at 70% busy: 1.4 busy seconds per second.
    assert parser["pods"] == {
        "metric": {"name": "pdserve_render_parser_busy"},
        "target": {"type": "AverageValue", "averageValue": "1400m"},
    }
    assert gateway["pods"]["metric"] == {"name": "pdserve_render_gateway_busy"}
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert hpa["behavior"]["scaleUp"]["policies"] == [
        {"type": "Pods", "value": 4, "periodSeconds": 30}
    ]
    assert "ScaledObject/qwen-render" not in built


def test_keda_scaled_object_queries_the_models_render_and_gateway_series() -> None:
    dm = model(render={"workers": 3, "autoscaling": {
        "engine": "KEDA", "prometheusAddress": "http://prom.monitoring:9090",
        "targetParserBusyPercent": 50, "scaleDownStabilizationSeconds": 120,
    }})  # fmt: skip
    built = objects(dm)
    assert "HorizontalPodAutoscaler/qwen-render" not in built
    assert "replicas" not in built["Deployment/qwen-render"]["spec"]
    scaled = built["ScaledObject/qwen-render"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
    behaviour = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behaviour["scaleDown"]["stabilizationWindowSeconds"] == 120
    parser, gateway, cpu = spec["triggers"]
    assert parser["metadata"]["threshold"] == "1.5"  # 3 workers x 50%
    assert parser["metadata"]["serverAddress"] == "http://prom.monitoring:9090"
    assert 'namespace="llm",model="qwen",pool="render"' in parser["metadata"]["query"]
    assert 'handler=~"/v1/(chat/)?completions/(de)?render"' in parser["metadata"]["query"]
    assert "pdserve_gateway_render_call_seconds_sum" in gateway["metadata"]["query"]
    assert cpu == {"type": "cpu", "metricType": "Utilization", "metadata": {"value": "70"}}
    # CPU request follows the workers when it is not set.
    resources = built["Deployment/qwen-render"]["spec"]["template"]["spec"]["containers"][0]
    assert resources["resources"]["requests"]["cpu"] == "3"
    args = args_of(built["Deployment/qwen-render"])
    assert args[args.index("--renderer-num-workers") + 1] == "3"


def test_builtin_render_holds_replicas_within_bounds_without_an_autoscaler_object() -> None:
    dm = model(render={"autoscaling": {"engine": "Builtin", "minReplicas": 2, "maxReplicas": 5}})
    built = objects(dm)
    assert not [k for k in built if k.startswith(("HorizontalPodAutoscaler", "ScaledObject"))]
    assert built["Deployment/qwen-render"]["spec"]["replicas"] == 2  # starts at the minimum
    assert objects(dm, ReplicaPlan(render=4))["Deployment/qwen-render"]["spec"]["replicas"] == 4
    assert objects(dm, ReplicaPlan(render=9))["Deployment/qwen-render"]["spec"]["replicas"] == 5


def test_workers_follow_the_cpu_request_and_pods_drain_before_stopping() -> None:
    render = objects(model(render={"resources": {"requests": {"cpu": "2500m"}},
                                   "drainSeconds": 8}))["Deployment/qwen-render"]  # fmt: skip
    args = args_of(render)
    assert args[args.index("--renderer-num-workers") + 1] == "3"
    pod = render["spec"]["template"]["spec"]
    assert pod["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 8}}}
    assert pod["terminationGracePeriodSeconds"] == 38


def test_engine_pods_drain_before_stopping_unless_told_not_to() -> None:
    built = objects(model(prefill={"replicas": 1, "drainSeconds": 12}, decode={"drainSeconds": 0}))
    prefill = built["StatefulSet/qwen-prefill"]["spec"]["template"]["spec"]
    assert prefill["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 12}}}
    # The drain, vLLM's 60 s default --shutdown-timeout, and 30 s for the process to exit.
    assert prefill["terminationGracePeriodSeconds"] == 12 + 60 + 30
    decode = built["StatefulSet/qwen-decode"]["spec"]["template"]["spec"]
    assert "lifecycle" not in decode["containers"][0]
    assert decode["terminationGracePeriodSeconds"] == 60 + 30


def test_keda_without_a_prometheus_is_refused_naming_the_field() -> None:
    message = problems(render={"autoscaling": {"engine": "KEDA"}})
    assert "render.autoscaling.prometheusAddress" in message


def test_builtin_engines_without_slices_scale_each_pool_within_bounds() -> None:
    dm = model(
        prefill={"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}},
        decode={"replicas": 5, "autoscaling": {"minReplicas": 2, "maxReplicas": 4}},
        gateway={"slo": {"ttftMs": 2000}},
    )
    built = objects(dm)
    assert built["StatefulSet/qwen-prefill"]["spec"]["replicas"] == 1
    assert built["StatefulSet/qwen-decode"]["spec"]["replicas"] == 4  # 5 clamped to the max
    planned = objects(dm, ReplicaPlan(prefill=3, decode=2))
    assert planned["StatefulSet/qwen-prefill"]["spec"]["replicas"] == 3
    assert planned["StatefulSet/qwen-decode"]["spec"]["replicas"] == 2


def test_external_engine_leaves_the_statefulset_replicas_to_its_autoscaler() -> None:
    dm = model(decode={"replicas": 2, "autoscaling": {"engine": "External"}})
    assert "replicas" not in objects(dm)["StatefulSet/qwen-decode"]["spec"]
    assert objects(dm)["StatefulSet/qwen-prefill"]["spec"]["replicas"] == 1


SLICES: dict[str, Any] = {
    "prefill": {"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}},
    "decode": {"replicas": 2, "autoscaling": {"minReplicas": 2, "maxReplicas": 8}},
    "gateway": {"slo": {"ttftMs": 2000, "itlMs": 50}},
    "placement": {"slices": 4, "domain": {"topologyKey": "nvidia.com/gpu.clique"}},
}


def test_slices_scale_whole_keeping_the_ratio_and_idle_slices_at_zero() -> None:
    dm = model(**SLICES)
    assert dm.spec.slice_bounds() == (1, 4)

    def counts(plan: ReplicaPlan | None) -> list[tuple[int, int]]:
        built = objects(dm, plan)
        return [(built[f"StatefulSet/qwen-prefill-s{i}"]["spec"]["replicas"],
                 built[f"StatefulSet/qwen-decode-s{i}"]["spec"]["replicas"])
                for i in range(4)]  # fmt: skip

    assert counts(None) == [(1, 2), (0, 0), (0, 0), (0, 0)]  # starts at the fewest slices
    assert counts(ReplicaPlan(slices=3)) == [(1, 2), (1, 2), (1, 2), (0, 0)]
    assert counts(ReplicaPlan(slices=7)) == [(1, 2)] * 4


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"prefill": {"replicas": 1}}, "set spec.prefill.autoscaling too"),
        ({"decode": {"replicas": 2, "autoscaling": {"engine": "External"}}},
         "spec.decode.autoscaling.engine External cannot keep the P:D ratio"),
        ({"decode": {"replicas": 2, "autoscaling": {"minReplicas": 3, "maxReplicas": 3}}},
         "no whole number of slices fits"),
        ({"gateway": {}}, "spec.gateway.slo.ttftMs"),
        ({"prefill": {"replicas": 0, "autoscaling": {}}},
         "spec.prefill.autoscaling needs spec.prefill.replicas >= 1"),
    ],
)  # fmt: skip
def test_engine_autoscaling_refusals_name_the_field_and_the_fix(
    change: dict[str, Any], expected: str
) -> None:
    assert expected in problems(**{**SLICES, **change})


def test_bounds_must_be_ordered() -> None:
    message = problems(render={"autoscaling": {"minReplicas": 5, "maxReplicas": 2}})
    assert "maxReplicas (2) must be >= minReplicas (5)" in message
