"""Real vLLM (its CPU build) in the pods the operator creates, on the real node: the image built
here (devtools/vllm_image.py), the tiny model from a PersistentVolumeClaim, and
examples/vllm-cpu-tiny.yaml applied with kubectl, with one LoRA adapter added from a claim of
its own (spec.model.adapters; the adapter made here, tests/support/lora_adapter.py). The kubelet
starts render, prefill and decode from the operator's StatefulSets and Deployments, with their
env, volumes, probes and ports; the OpenAI SDK through the gateway Service gets the greedy
answers the same vLLM gives aggregated, for the model and for the adapter, and decode's NIXL
metrics show the KV crossed the pod network."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from devtools.localplane import ControlPlaneError, wait_until
from devtools.model_volume import model_volume
from devtools.tiny_model import ensure_tiny_model
from devtools.vllm_image import build_vllm_image
from pdserve.vllm.metrics import (
    NIXL_BYTES_TRANSFERRED,
    NIXL_FAILED_TRANSFERS,
    NIXL_XFER_TIME,
    Totals,
    count,
    counter_samples,
    sum_samples,
    total,
)
from tests.support.chat_cases import CHAT_CASES, request
from tests.support.lora_adapter import RANK, make_lora_adapter
from tests.support.real_stack import chat_answer, chat_stream_answer, pretty
from tests.support.real_vllm import SERVED_NAME as SERVED
from tests.support.realcluster import (
    MODEL_NAMESPACE,
    ROOT,
    Cluster,
    describe,
    ensure_namespace,
    model_status,
    operator_logs,
    pods,
    ready,
)
from tests.support.rollout_load import Load, running

# The first test also waits for the model: a 7 GB image imported and unpacked, three vLLM
# processes started on two cores (about 6 minutes; pyproject's 600 s is per test).
pytestmark = pytest.mark.timeout(1500)

EXAMPLE = ROOT / "examples" / "vllm-cpu-tiny.yaml"
NAME = "tiny-vllm"
ADAPTER = "lora-a"
ADAPTER_CLAIM = "tiny-lora-adapters"
CASES = ["reasoning", "tools-auto", "tools-required", "length"]
STREAM_CASES = ["reasoning", "tools-auto", "length"]
ENGINE_PORT = 8000
SERVING = "render,prefill,decode,gateway"  # not the preflight probe's pods
POD_SECURITY = {
    "pod-security.kubernetes.io/enforce": "baseline",
    "pod-security.kubernetes.io/warn": "restricted",
}
NON_ROOT_UID = 10001


@dataclass
class RealModel:
    gateway: str  # the gateway Service's OpenAI base URL
    decode: str  # the decode pod's own address, for its /metrics and the aggregated answer


def timestamp(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def startup_times(cluster: Cluster) -> str:
    """Per pod of the model: created -> container started -> Ready, in seconds."""
    lines = []
    serving = f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component in ({SERVING})"
    for pod in pods(cluster, MODEL_NAMESPACE, serving):
        created = timestamp(pod["metadata"]["creationTimestamp"])
        [status] = pod["status"]["containerStatuses"]
        started = status["state"]["running"]["startedAt"]
        ready = next(c["lastTransitionTime"] for c in pod["status"]["conditions"]
                     if c["type"] == "Ready")  # fmt: skip
        lines.append(
            f"  {pod['metadata']['name']}: started +{timestamp(started) - created:.0f}s, "
            f"Ready +{timestamp(ready) - created:.0f}s"
        )
    return "\n".join(lines)


def pod_url(cluster: Cluster, component: str) -> str:
    [pod] = pods(cluster, MODEL_NAMESPACE, f"app.kubernetes.io/instance={NAME},"
                 f"app.kubernetes.io/component={component}")  # fmt: skip
    return f"http://{pod['status']['podIP']}:{ENGINE_PORT}"


def with_adapter(adapters: Path) -> Path:
    """The example as a user extends it with an adapter in a claim of its own."""
    [body] = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    body["spec"]["model"]["adapters"] = [
        {"name": ADAPTER, "rank": RANK, "pvc": {"claimName": ADAPTER_CLAIM, "path": ADAPTER}}
    ]
    path = adapters.parent / "vllm-cpu-tiny-lora.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.fixture(scope="module")
def real_model(
    cluster: Cluster, operator: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealModel]:
    started = time.monotonic()
    image = build_vllm_image()
    model = ensure_tiny_model()
    adapters = tmp_path_factory.mktemp("real-vllm") / "adapters"
    make_lora_adapter(adapters / ADAPTER, model, seed=0)
    built = time.monotonic()
    cluster.node.import_images([image.archive])
    imported = time.monotonic()
    volume = model_volume(model, MODEL_NAMESPACE)
    adapter_volume = model_volume(adapters, MODEL_NAMESPACE, ADAPTER_CLAIM)
    # As a production namespace runs engines: Pod Security baseline enforced, and restricted
    # warned (the API server names what a pod breaks of it on every create).
    ensure_namespace(cluster, MODEL_NAMESPACE, *volume, *adapter_volume, labels=POD_SECURITY)
    cluster.kubectl("apply", "-f", str(with_adapter(adapters)))
    waited = cluster.kubectl(
        "wait", "--for=condition=Ready", f"dm/{NAME}", "-n", MODEL_NAMESPACE, "--timeout=15m",
        check=False, timeout=960,
    )  # fmt: skip
    assert waited.returncode == 0, (
        waited.stderr + describe(cluster, MODEL_NAMESPACE) + operator_logs(cluster)
    )
    print(f"\nvLLM image {image.name}: built or found in {built - started:.0f}s, imported in "
          f"{imported - built:.0f}s; model Ready {time.monotonic() - imported:.0f}s after apply\n"
          + startup_times(cluster))  # fmt: skip
    service = json.loads(
        cluster.kubectl("get", "svc", f"{NAME}-gateway", "-n", MODEL_NAMESPACE, "-o", "json").stdout
    )
    spec = service["spec"]
    yield RealModel(
        gateway=f"http://{spec['clusterIP']}:{spec['ports'][0]['port']}/v1",
        decode=pod_url(cluster, "decode"),
    )
    cluster.kubectl("delete", "-f", str(EXAMPLE), "--wait", check=False, timeout=300)

    # The simulator model's tests, next, count the pods of the namespace: every pod of this
    # model gone first (the garbage collector removes them after the model, vLLM drains).
    def gone() -> bool:
        return not pods(cluster, MODEL_NAMESPACE, f"app.kubernetes.io/instance={NAME}")

    wait_until("the real-vLLM model's pods gone", gone, timeout=300, interval=2)
    for claim, persistent in ((volume[1], volume[0]), (adapter_volume[1], adapter_volume[0])):
        cluster.kubectl("delete", "pvc", claim["metadata"]["name"], "-n", MODEL_NAMESPACE,
                        "--wait", check=False)  # fmt: skip
        cluster.kubectl("delete", "pv", persistent["metadata"]["name"], "--wait", check=False)
    cluster.kubectl("label", "namespace", MODEL_NAMESPACE, *(f"{k}-" for k in POD_SECURITY))


KV_SAMPLES = {
    count(NIXL_XFER_TIME): "transfers",
    total(NIXL_BYTES_TRANSFERRED): "bytes",
    **dict.fromkeys(counter_samples(NIXL_FAILED_TRANSFERS), "failed"),
}


def kv_counters(engine: str) -> Totals:
    """Decode's NIXL counters, read from the pod's /metrics over the pod network."""
    text = httpx.get(f"{engine}/metrics", timeout=10).text
    return sum_samples(text, lambda name, _: KV_SAMPLES.get(name))


def clients(model: RealModel) -> tuple[openai.OpenAI, openai.OpenAI]:
    """The gateway Service, and the decode pod itself: the same vLLM answering aggregated
    (a request with no KV-transfer parameters prefills locally)."""
    options: dict[str, Any] = {"api_key": "unused", "timeout": 120, "max_retries": 0}
    return (openai.OpenAI(base_url=model.gateway, **options),
            openai.OpenAI(base_url=f"{model.decode}/v1", **options))  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_the_gateway_answers_what_the_same_vllm_answers_aggregated(
    case: str, real_model: RealModel
) -> None:
    gateway, aggregated = clients(real_model)
    body = request(CHAT_CASES[case])
    before = kv_counters(real_model.decode)
    # Through the gateway first: decode must pull this prompt's KV from prefill, not find it in
    # its own prefix cache from the aggregated answer.
    got = chat_answer(gateway.chat.completions.create(**body))
    after = kv_counters(real_model.decode)
    expected = chat_answer(aggregated.chat.completions.create(**body))
    assert got == expected, f"through the gateway:\n{pretty(got)}\naggregated:\n{pretty(expected)}"
    assert after.get("transfers", 0) > before.get("transfers", 0), (
        f"decode pulled no KV from the prefill pod: {before} -> {after}"
    )
    assert after.get("failed", 0) == before.get("failed", 0), (before, after)


def test_an_adapter_through_the_gateway_answers_what_the_same_vllm_answers_with_it(
    real_model: RealModel,
) -> None:
    """The adapter named in `model`, over render -> prefill -> decode: decode's own answer for
    it, not the model's; listed by /v1/models with the model as its parent. One request at a
    time: vLLM's CPU LoRA kernels apply an adapter to base requests batched with LoRA ones."""
    gateway, aggregated = clients(real_model)
    body = {**request(CHAT_CASES["reasoning"]), "model": ADAPTER}
    before = kv_counters(real_model.decode)
    got = chat_answer(gateway.chat.completions.create(**body))
    after = kv_counters(real_model.decode)
    expected = chat_answer(aggregated.chat.completions.create(**body))
    base = chat_answer(aggregated.chat.completions.create(**{**body, "model": SERVED}))
    assert got == expected, f"through the gateway:\n{pretty(got)}\naggregated:\n{pretty(expected)}"
    assert got["choices"] != base["choices"], f"the adapter answers as the model: {pretty(got)}"
    assert after.get("transfers", 0) > before.get("transfers", 0), (before, after)
    listed = {m.id: m.model_dump().get("parent") for m in gateway.models.list()}
    assert listed == {SERVED: None, ADAPTER: SERVED}


@pytest.mark.parametrize("case", STREAM_CASES)
def test_a_stream_through_the_gateway_answers_what_aggregated_vllm_answers(
    case: str, real_model: RealModel
) -> None:
    gateway, aggregated = clients(real_model)
    body = {**request(CHAT_CASES[case]), "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    before = kv_counters(real_model.decode)
    got = chat_stream_answer(list(gateway.chat.completions.create(**body)))
    after = kv_counters(real_model.decode)
    expected = chat_stream_answer(list(aggregated.chat.completions.create(**body)))
    assert got == expected, f"streamed:\n{pretty(got)}\naggregated:\n{pretty(expected)}"
    assert after.get("transfers", 0) > before.get("transfers", 0), (before, after)


def test_the_kv_crossed_between_the_pods_and_the_model_reports_it(
    cluster: Cluster, real_model: RealModel
) -> None:
    # Ready does not wait for the preflight's reports (spec.kvTransfer.verify is not Required):
    # under load they land after it.
    def concluded() -> bool:
        return all("verified" in v for v in model_status(cluster, NAME)["transport"])

    try:
        wait_until("the preflight's verdict", concluded, timeout=300, interval=2)
    except ControlPlaneError as exc:
        jobs = cluster.kubectl("get", "jobs,pods", "-n", MODEL_NAMESPACE, "-o", "wide",
                               check=False)  # fmt: skip
        raise AssertionError(f"{exc}: {model_status(cluster, NAME).get('transport')}\n"
                             f"{jobs.stdout}{operator_logs(cluster)}") from exc  # fmt: skip
    counters = kv_counters(real_model.decode)
    status = model_status(cluster, NAME)
    print(f"decode's NIXL: {counters['transfers']:.0f} transfers, {counters['bytes']:.0f} "
          f"bytes, {counters.get('failed', 0):.0f} failed; {status.get('transport')}")  # fmt: skip
    assert counters["bytes"] > 0, counters
    assert counters.get("failed", 0) == 0, counters
    # The operator's preflight ran its NIXL probe in the vLLM image between two real pods.
    [verdict] = status["transport"]
    assert verdict["verified"] is True, verdict
    assert verdict["transport"] == "tcp", verdict


def restricted_warning(cluster: Cluster, pod: dict[str, Any]) -> str:
    """What the API server warns of a copy of `pod` created (dry run) in its namespace, which
    warns at restricted: empty when the pod passes restricted."""
    spec = {k: v for k, v in pod["spec"].items() if k != "nodeName"}
    meta = {"name": f"psa-{pod['metadata']['name'][:40]}", "namespace": MODEL_NAMESPACE}
    copy = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
    created = cluster.kubectl(
        "create", "--dry-run=server", "-o", "name", "-f", "-", stdin=json.dumps(copy)
    )
    return created.stderr.strip()


def processes_of(*words: str) -> dict[int, int]:
    """pid -> owner uid of this machine's processes whose command line holds every word (the
    real node's containers run here)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            uid = entry.stat().st_uid
        except OSError:
            continue  # it exited meanwhile
        if all(word.encode() in argv for word in words):
            found[int(entry.name)] = uid
    return found


def test_render_and_gateway_pass_restricted_and_vllm_renders_as_a_non_root_user(
    cluster: Cluster, real_model: RealModel
) -> None:
    """The CPU pods run real vLLM's render server and the gateway as UID 10001 with the
    restricted securityContext (their answers are the tests above); the engines need baseline
    (vLLM's images run as root), which the API server says of them and of nothing else."""
    serving = pods(cluster, MODEL_NAMESPACE, f"app.kubernetes.io/instance={NAME},"
                   f"app.kubernetes.io/component in ({SERVING})")  # fmt: skip
    component = "app.kubernetes.io/component"
    warned = {p["metadata"]["labels"][component]: restricted_warning(cluster, p) for p in serving}
    assert (warned["render"], warned["gateway"]) == ("", ""), warned
    for engine in ("prefill", "decode"):
        assert 'would violate PodSecurity "restricted:latest"' in warned[engine], warned
        assert "runAsNonRoot != true" in warned[engine], warned
    renders = processes_of("launch", "render", "--served-model-name", SERVED)
    assert renders, "no vLLM render server process on this machine"
    assert set(renders.values()) == {NON_ROOT_UID}, renders


ENGINES = f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component in (prefill,decode)"


def engine_pods(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["uid"]: p for p in pods(cluster, MODEL_NAMESPACE, ENGINES)}


def test_an_engine_rollout_under_load_fails_and_cuts_no_request(
    cluster: Cluster, real_model: RealModel
) -> None:
    """A parity-neutral change to both engine pools (an env var: neither the parity hash nor
    the KV-compatibility digest moves) under two steady clients: each pool's one pod is
    replaced, draining for real (vLLM's --shutdown-timeout finishes what it holds), and the
    requests that arrive while a pool has no pod wait for the new one
    (gateway.endpointWaitSeconds) instead of failing."""
    before = engine_pods(cluster)
    parity = model_status(cluster, NAME)["parityHash"]
    dm = json.loads(cluster.kubectl("get", "dm", NAME, "-n", MODEL_NAMESPACE, "-o", "json").stdout)
    marker = {"name": "PDSERVE_E2E_ROLLOUT", "value": "1"}
    patch = {"spec": {pool: {"env": [*dm["spec"][pool]["env"], marker]}
                      for pool in ("prefill", "decode")}}  # fmt: skip
    load = Load(real_model.gateway, clients=2, model=SERVED, timeout=600)
    workers = [(partial(load.run_one, i), load.stop) for i in range(load.clients)]

    def replaced() -> bool:
        now = engine_pods(cluster)
        return (
            len(now) == 2
            and not set(now) & set(before)
            and all(ready(p) and not p["metadata"].get("deletionTimestamp") for p in now.values())
        )

    with running(*workers):
        wait_until("steady load", lambda: len(load.sent) >= 4, timeout=120)
        started = time.monotonic()
        cluster.kubectl("patch", "dm", NAME, "-n", MODEL_NAMESPACE, "--type=merge",
                        "-p", json.dumps(patch))  # fmt: skip
        try:
            wait_until("both engine pods replaced and Ready", replaced, timeout=900, interval=2)
        except ControlPlaneError as error:
            raise AssertionError(f"{error}\n{describe(cluster, MODEL_NAMESPACE)}") from None
        rollout_seconds = time.monotonic() - started
        load.wait_for_more(4, timeout=300)
    print(f"engine rollout {rollout_seconds:.0f}s: {len(load.sent)} requests, "
          f"{len(load.failures)} failed, slowest {max(load.seconds):.1f}s")  # fmt: skip
    assert load.failures == [], f"{len(load.failures)} failed: {load.failures[:5]}"
    assert model_status(cluster, NAME)["parityHash"] == parity
