"""What a user does first, on the real node: `helm install` the chart, `kubectl apply` the
simulator example, wait for Ready, and talk to the model with the OpenAI SDK through the
gateway's Service. Every pod here really runs, from images built on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from devtools.localplane import wait_until
from pdserve.contract.names import LEADER_LEASE_NAME
from tests.support.realcluster import (
    MODEL_NAMESPACE,
    OPERATOR_ACCOUNT,
    RELEASE_NAMESPACE,
    Cluster,
    operator_logs,
    pods,
    ready,
)


def test_chart_runs_the_operator_as_a_pod_and_its_webhook_names_the_bad_field(
    cluster: Cluster, operator: None, tmp_path: Path
) -> None:
    # Two replicas (the chart's default), both Ready: every replica serves the webhook.
    operator_pods = pods(cluster, RELEASE_NAMESPACE, "app.kubernetes.io/name=pdserve")
    assert len(operator_pods) == 2, [p["metadata"]["name"] for p in operator_pods]
    for operator_pod in operator_pods:
        assert ready(operator_pod), operator_pod["status"]
        assert operator_pod["spec"]["serviceAccountName"] == "pdserve"
        assert operator_pod["spec"]["nodeName"] == "real-node"
    names = {p["metadata"]["name"] for p in operator_pods}

    def one_leads() -> bool:
        lease = cluster.kubectl("get", "lease", "-n", RELEASE_NAMESPACE, LEADER_LEASE_NAME,
                                "-o", "json", check=False)  # fmt: skip
        return (
            lease.returncode == 0
            and json.loads(lease.stdout)["spec"].get("holderIdentity") in names
        )

    wait_until("one operator replica to hold the leader Lease", one_leads, timeout=30)

    cluster.kubectl("create", "namespace", "webhook-check")
    bad = {
        "apiVersion": "pdserve.io/v1alpha1", "kind": "DisaggregatedModel",
        "metadata": {"name": "bad", "namespace": "webhook-check"},
        "spec": {"model": {"name": "Qwen/Qwen3-8B"},
                 "decode": {"extraArgs": ["--chat-template", "/tmp/other.jinja"]}},
    }  # fmt: skip
    refused = cluster.kubectl("apply", "-f", "-", stdin=json.dumps(bad), check=False)
    assert refused.returncode != 0
    # The API server called the operator's webhook through its Service (the CRD schema alone
    # cannot judge extraArgs), and the message names the field.
    logs = operator_logs(cluster)
    assert "admission webhook" in refused.stderr, refused.stderr + logs
    assert "spec.decode.extraArgs" in refused.stderr, refused.stderr + logs
    cluster.kubectl("delete", "namespace", "webhook-check", "--wait=false")


def test_simulated_model_is_ready_and_answers_the_openai_sdk_through_its_gateway(
    cluster: Cluster, model: str
) -> None:
    for pod in pods(cluster, MODEL_NAMESPACE):
        assert pod["status"]["phase"] == "Running", pod["metadata"]["name"]
        assert ready(pod), pod["metadata"]["name"]
        assert pod["spec"]["nodeName"] == "real-node"
    components = {
        p["metadata"]["labels"]["app.kubernetes.io/component"]
        for p in pods(cluster, MODEL_NAMESPACE)
    }
    assert components >= {"render", "prefill", "decode", "gateway"}
    # The operator made them as its own service account, with the chart's RBAC.
    writes = cluster.plane.audit_events(user=OPERATOR_ACCOUNT)
    made = {(e["objectRef"]["resource"], e["objectRef"].get("namespace")) for e in writes}
    assert {("statefulsets", MODEL_NAMESPACE), ("deployments", MODEL_NAMESPACE)} <= made, made

    client = openai.OpenAI(base_url=model, api_key="unused", timeout=60, max_retries=0)
    chat = client.chat.completions.create(
        model="sim-qwen3", messages=[{"role": "user", "content": "Say hello"}], max_tokens=48
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage is not None
    assert chat.usage.completion_tokens > 0

    stream = client.chat.completions.create(
        model="sim-qwen3", messages=[{"role": "user", "content": "Count to five"}],
        max_tokens=32, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length")
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]},
        },
    }  # fmt: skip
    tools = client.chat.completions.create(
        model="sim-qwen3", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[weather], max_tokens=128,  # type: ignore[list-item]
    )  # fmt: skip
    [call] = tools.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["city"]  # type: ignore[union-attr]

    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert "no-such-model" in str(unknown.value)


def test_gateway_service_is_reached_only_through_this_machine(cluster: Cluster, model: str) -> None:
    """The Service address resolves, through kube-proxy, to a pod on the node's bridge."""
    wait_until("the gateway Service", lambda: httpx.get(f"{model}/models").is_success, timeout=30)
    slices = json.loads(
        cluster.kubectl(
            "get", "endpointslices", "-n", MODEL_NAMESPACE,
            "-l", "kubernetes.io/service-name=sim-qwen3-gateway", "-o", "json",
        ).stdout
    )  # fmt: skip
    addresses = [a for s in slices["items"] for e in s["endpoints"] for a in e["addresses"]]
    assert addresses
    assert all(a.startswith("10.244.0.") for a in addresses)
