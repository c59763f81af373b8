"""The gateway pod as a user gets it, on the real node: it runs the compiled data plane from
the pdserve image in front of the Python gateway, the OpenAI SDK gets its answers (streamed and
not) through the Service, and the gateway's own metrics show that the data plane, not the
Python gateway, served them, its request log entries in the gateway's log beside the Python
gateway's: with OpenAI engines in routing mode Auto (the default: the data plane decides each
request), and with engines behind the render pool in mode Disaggregated."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import yaml

from devtools.localplane import ControlPlaneError, wait_until
from pdserve.contract.names import DATA_PLANE_BINARY
from tests.support.realcluster import EXAMPLE, Cluster, describe, pods

NAMESPACE = "llm-dataplane"
NAME = "sim-fast"
ROUTE = {"openai": "decode", "render": "render_pd"}
"""The data plane's route label for this test's requests, by whether the engines sit behind the
render pool: in mode Auto its short prompts on an idle decode replica are prefilled there."""
TABLE_ROUTE = {"openai": "auto", "render": "pd"}
"""The route the data plane's routing table gives the model (`/status`)."""


def fast_model(engines: str) -> dict[str, Any]:
    """The simulator example with the data plane on and one gateway replica: with `engines`
    "openai" no render pool (the engines speak OpenAI) and the default routing mode, Auto; with
    "render" the example's render pool and mode Disaggregated (prefill then decode for every
    request)."""
    model: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    model["metadata"] = {"name": NAME, "namespace": NAMESPACE}
    spec = model["spec"]
    spec["gateway"].update(replicas=1, requestLog=True)  # every gateway pod runs the data plane
    if engines == "openai":
        spec["render"] = {"enabled": False}
        spec["gateway"].pop("routing", None)
    else:
        spec["gateway"]["routing"] = {"mode": "Disaggregated"}
    return model


@pytest.fixture(scope="module")
def namespace(cluster: Cluster) -> Iterator[str]:
    """The module's namespace, one for both models in turn: deleting a namespace lasts as long
    as the longest grace period of the pods it had (the namespace controller waits that long
    before it looks again, about a minute here), deleting the model only until its pods are
    gone."""
    cluster.kubectl("create", "namespace", NAMESPACE)
    try:
        yield NAMESPACE
    finally:
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


@pytest.fixture(params=list(ROUTE))
def fast(
    request: pytest.FixtureRequest, cluster: Cluster, operator: None, namespace: str
) -> Iterator[tuple[str, str, str]]:
    """The gateway Service's URL, the route the data plane serves this test's requests by, and
    its routing table's route."""
    manifest = json.dumps(fast_model(request.param))
    cluster.kubectl("apply", "-f", "-", stdin=manifest)
    try:
        waited = cluster.kubectl(
            "wait", "--for=condition=Ready", f"dm/{NAME}", "-n", NAMESPACE, "--timeout=4m",
            check=False, timeout=300,
        )  # fmt: skip
        assert waited.returncode == 0, waited.stderr + describe(cluster, NAMESPACE)
        service = json.loads(cluster.kubectl(
            "get", "svc", f"{NAME}-gateway", "-n", NAMESPACE, "-o", "json"
        ).stdout)  # fmt: skip
        base = f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"
        yield base, ROUTE[request.param], TABLE_ROUTE[request.param]
    finally:
        # The model's objects go with it (owner references), its pods last: none left for the
        # next model to share the node with.
        cluster.kubectl("delete", "dm", NAME, "-n", namespace, "--wait", check=False, timeout=300)
        wait_until(f"the pods of namespace {namespace} to go",
                   lambda: not pods(cluster, namespace),
                   timeout=120)  # fmt: skip


def metrics_of(base: str) -> str:
    metrics = httpx.get(f"{base}/metrics", timeout=10)
    assert metrics.status_code == 200, metrics.text
    return metrics.text


def served_by_data_plane(base: str, route: str) -> float:
    name = "pdserve_gateway_dataplane_requests_total"
    found = re.search(rf'^{name}{{route="{route}"}} (\S+)$', metrics_of(base), re.M)
    return float(found.group(1)) if found else 0.0


GATEWAY_ROUTE = {"pd": "openai_pd", "decode": "aggregated", "render_pd": "render_pd"}
"""The gateway's own `route` label for what the data plane serves on each route."""


def requests_ok(base: str, route: str) -> float:
    name = "pdserve_gateway_requests_total"
    found = re.search(rf'^{name}{{outcome="ok",route="{route}"}} (\S+)$', metrics_of(base), re.M)
    return float(found.group(1)) if found else 0.0


def why_not_served(cluster: Cluster, base: str) -> str:
    """What a failure shows: the data plane's hand-overs and the Python gateway's fallbacks by
    reason, the gateway's `/status` (the data plane's route and why it hands over, each
    replica's check) and the end of its log."""
    counted = [line for line in metrics_of(base).splitlines()
               if line.startswith(("pdserve_gateway_dataplane_fallbacks_total",
                                   "pdserve_gateway_fallbacks_total"))]  # fmt: skip
    status = httpx.get(f"{base}/status", timeout=10).text
    log = cluster.kubectl(
        "logs", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=gateway", "--tail=40",
        check=False,
    )  # fmt: skip
    return f"fallbacks: {counted}; /status: {status}; gateway log:\n{log.stdout}{log.stderr}"


def test_the_data_plane_serves_the_openai_sdk_from_the_gateway_pod(
    cluster: Cluster, fast: tuple[str, str, str]
) -> None:
    base, route, table_route = fast
    [gateway] = pods(cluster, NAMESPACE, "app.kubernetes.io/component=gateway")
    args = gateway["spec"]["containers"][0]["args"]
    assert args[args.index("--data-plane") + 1] == DATA_PLANE_BINARY
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)

    def chat() -> None:
        answer = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Say hello"}], max_tokens=24
        )
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert answer.usage is not None
        assert answer.usage.completion_tokens > 0

    def stream() -> None:
        chunks = list(client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Count to five"}],
            max_tokens=16, stream=True, stream_options={"include_usage": True},
        ))  # fmt: skip
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens > 0

    # Answered from the first moment: until the gateway has checked its engines (replica
    # check) the routing table it pushes sends every request on to the Python gateway.
    chat()
    stream()
    with pytest.raises(openai.NotFoundError) as unknown:  # in the Python gateway's words
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert "no-such-model" in str(unknown.value)

    # Its counts reach /metrics once a second, after the answer: a request's count shows up
    # in a later poll, so every poll compares with the count from before the first.
    before = served_by_data_plane(base, route)

    def fast_path_serves() -> bool:
        chat()
        return served_by_data_plane(base, route) > before

    try:
        wait_until("the data plane to serve requests itself", fast_path_serves, timeout=90,
                   interval=1)  # fmt: skip
    except ControlPlaneError as error:
        raise AssertionError(f"{error}; {why_not_served(cluster, base)}") from None
    shown = httpx.get(f"{base}/status", timeout=10).json()["dataPlane"]
    assert (shown["route"], shown.get("unavailableBecause")) == (table_route, None), shown
    # Then streamed and not, each served by it, and counted in the gateway's own request
    # metrics too, as the Python gateway counts what it serves.
    before = served_by_data_plane(base, route)
    counted = requests_ok(base, GATEWAY_ROUTE[route])
    chat()
    stream()
    wait_until("the data plane's count of both",
               lambda: served_by_data_plane(base, route) >= before + 2, timeout=20)  # fmt: skip
    wait_until("both in pdserve_gateway_requests_total", lambda: requests_ok(
        base, GATEWAY_ROUTE[route]) >= counted + 2, timeout=20)  # fmt: skip
    # A document waits for its long-prefill slot in the data plane's own queue.
    admission = httpx.get(f"{base}/status", timeout=10).json()["admission"]
    assert admission["dataPlaneAdmits"] == "here", admission
    before = served_by_data_plane(base, route)
    answer = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Summarize"}], max_tokens=4,
        extra_headers={"X-PDServe-Class": "document"},
    )  # fmt: skip
    assert answer.usage is not None
    assert answer.usage.completion_tokens > 0
    wait_until("the document served by the data plane",
               lambda: served_by_data_plane(base, route) >= before + 1, timeout=20)  # fmt: skip
    assert httpx.get(f"{base}/admission", timeout=10).json()["longInFlight"] == 0
    # spec.gateway.requestLog: the data plane's entry of it in the pod's log (its standard
    # output, shared with the Python gateway's entries and logs), whole.
    pod = gateway["metadata"]["name"]
    wait_until("the document's request log entry in the gateway's log",
               lambda: bool(documents_logged(cluster, pod)), timeout=20)  # fmt: skip
    [entry] = documents_logged(cluster, pod)
    assert entry["route"] == GATEWAY_ROUTE[route], entry
    assert entry["decode_engine"], entry
    assert entry["parity_hash"], entry
    assert entry["output_tokens"] == answer.usage.completion_tokens, entry


def documents_logged(cluster: Cluster, pod: str) -> list[dict[str, Any]]:
    """The request log's entries of documents in the gateway pod's log."""
    logged = cluster.kubectl("logs", "-n", NAMESPACE, pod, "-c", "gateway").stdout
    found = []
    for line in logged.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("class") == "document":
            found.append(entry)
    return found
