"""Autoscaling on the real control plane: the HPA and KEDA ScaledObject pdserve builds pass the
API server's validation (KEDA's CRD installed as a minimal structural schema), and the Builtin
loop changes the replicas of a real render Deployment and of whole engine slices
(StatefulSets) from the metrics of simulator servers.

kwok pods have fake IPs, so the operator's reconciler runs in this process with its metrics
target resolver pointed at simulators on loopback; everything it writes goes to the real API
server as the operator's own user."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import httpx
import pytest

from devtools.localplane import OPERATOR_USER, ControlPlane
from devtools.resources import KEDA_CRD, SMALL_PD_SPEC, apply_dm, events_for
from pdserve.api import parse_resource
from pdserve.builders import build_all
from pdserve.contract.names import COMPONENT_LABEL, FIELD_MANAGER
from pdserve.controller.runner import Reconciler
from pdserve.controller.settings import OperatorSettings
from pdserve.kube.client import KINDS, Kube
from pdserve.kube.credentials import load_credentials
from pdserve.sim.engine_config import EngineConfig
from pdserve.sim.engine_server import EngineServer
from pdserve.sim.render_server import RenderConfig, RenderServer
from pdserve.sim.tokenizer import SimTokenizer
from tests.support.serving import serving

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("dm_crd")]


async def eventually(
    what: str,
    probe: Callable[[], Awaitable[bool]],
    *,
    timeout: float,  # noqa: ASYNC109 - a polling deadline, not a cancel scope
    interval: float = 0.5,
) -> None:
    """Poll an async probe until it holds; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await probe():
            return
        await asyncio.sleep(interval)  # the poll period, not synchronization
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class PassCounter(logging.Handler):
    """Counts the reconciler's log lines that say a pass found nothing to apply."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text, self.count = text, 0
        self.logger = logging.getLogger("pdserve.reconcile")
        self.level_before = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.count += 1

    async def at_least(self, count: int) -> bool:
        return self.count >= count

    def close(self) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)
        super().close()


@pytest.fixture
async def admin(control_plane: ControlPlane) -> AsyncIterator[Kube]:
    kube = Kube(load_credentials(str(control_plane.kubeconfig())))
    yield kube
    await kube.close()


async def keda_crd(kube: Kube) -> None:
    crd_kind = KINDS[("apiextensions.k8s.io/v1", "CustomResourceDefinition")]
    await kube.apply(KEDA_CRD, field_manager="pdserve-tests")

    async def established() -> bool:
        crd = await kube.get(crd_kind, None, "scaledobjects.keda.sh") or {}
        conditions = (crd.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    await eventually("the ScaledObject CRD to be Established", established, timeout=30)


def resource(namespace: str, name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "pdserve.io/v1alpha1", "kind": "DisaggregatedModel",
            "metadata": {"name": name, "namespace": namespace}, "spec": dict(spec)}  # fmt: skip


async def test_hpa_and_keda_objects_pass_server_side_dry_run(admin: Kube, namespace: str) -> None:
    await keda_crd(admin)
    render = {"resources": {"requests": {"cpu": "2"}}}
    hpa_model = parse_resource(resource(namespace, "qwen", {**SMALL_PD_SPEC, "render": render}))
    keda = {
        **render,
        "autoscaling": {
            "engine": "KEDA",
            "minReplicas": 2,
            "maxReplicas": 9,
            "prometheusAddress": "http://prometheus.monitoring:9090",
        },
    }
    keda_model = parse_resource(resource(namespace, "qwen", {**SMALL_PD_SPEC, "render": keda}))
    checked = {}
    for dm in (hpa_model, keda_model):
        for obj in build_all(dm):
            if obj["kind"] in ("HorizontalPodAutoscaler", "ScaledObject", "Deployment"):
                stored = await admin.apply(obj, field_manager=FIELD_MANAGER, dry_run=True)
                checked[(obj["kind"], obj["metadata"]["name"])] = stored
    hpa = checked[("HorizontalPodAutoscaler", "qwen-render")]["spec"]
    assert [m["type"] for m in hpa["metrics"]] == ["Resource", "Pods", "Pods"]
    assert hpa["metrics"][1]["pods"]["target"]["averageValue"] == "1400m"  # canonical as built
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    scaled = checked[("ScaledObject", "qwen-render")]["spec"]
    assert [t["type"] for t in scaled["triggers"]] == ["prometheus", "prometheus", "cpu"]
    assert scaled["scaleTargetRef"]["name"] == "qwen-render"
    # With an external autoscaler, pdserve's Deployment never carries replicas.
    [render_deployment] = [
        o
        for o in build_all(keda_model)
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "qwen-render"
    ]
    assert "replicas" not in render_deployment["spec"]


# The Builtin loop: render, and prefill/decode in two slices of 1 + 1 on one node each.
BUILTIN_SPEC: dict[str, Any] = {
    **SMALL_PD_SPEC,
    "serving": {"reasoningParser": "qwen3"},
    # Tight targets, so a small simulated load is "too much": a render worker aims at 10% busy
    # and the SLOs are 1 ms (the simulator's TTFT and ITL are tens of milliseconds).
    "render": {"workers": 1, "autoscaling": {
        "engine": "Builtin", "minReplicas": 1, "maxReplicas": 3, "targetParserBusyPercent": 10,
        "cooldownSeconds": 0,
    }},
    "prefill": {"replicas": 1, "autoscaling": {
        "minReplicas": 1, "maxReplicas": 2, "scaleUpStabilizationSeconds": 0, "cooldownSeconds": 0,
    }},
    "decode": {"replicas": 1, "autoscaling": {
        "minReplicas": 1, "maxReplicas": 2, "scaleUpStabilizationSeconds": 0, "cooldownSeconds": 0,
    }},
    "gateway": {"replicas": 1, "slo": {"ttftMs": 1, "itlMs": 1}},
    "kvTransfer": {"verify": "Off"},
    "placement": {
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
        "slices": 2,
        "domain": {"topologyKey": "kubernetes.io/hostname"},
    },
}  # fmt: skip
TOKENIZER = SimTokenizer()
REASONING = "<think>\n" + "let me weigh this step by step. " * 200 + "\n</think>\n\nDone."


async def render_load(url: str) -> None:
    """Long reasoning streams derendered per chunk: every call re-parses the whole output so far
    (the first call brings a long history, so each later one is expensive)."""
    ids = TOKENIZER.encode(REASONING)
    chat = {"model": "sim-model", "messages": [{"role": "user", "content": "think"}]}
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while True:
            state, start = None, 0
            for end in range(len(ids) - 400, len(ids), 8):
                body = {"stream": True, "model": "sim-model", "stream_state": state,
                        "generate_chunk": {"request_id": "r", "choices": [
                            {"index": 0, "token_ids": ids[start:end], "finish_reason": None}
                        ]}, "prompt_tokens": 3, "prompt_token_ids": [1, 2, 3],
                        "chat_request": chat}  # fmt: skip
                answer = await client.post("/v1/chat/completions/derender", json=body)
                state, start = answer.json()["stream_state"], end
                await asyncio.sleep(0.002)  # pacing: a steady parser load, not a flood


async def engine_load(url: str) -> None:
    """Prompts to prefill (TTFT samples, prompt tokens) and generations (ITL samples)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while True:
            prompt = {"token_ids": list(range(1, 400)), "model": "sim-model",
                      "sampling_params": {"max_tokens": 1}}  # fmt: skip
            generate = {**prompt, "sampling_params": {"max_tokens": 30}}
            await asyncio.gather(
                client.post("/inference/v1/generate", json=prompt),
                client.post("/inference/v1/generate", json=generate),
            )


@contextlib.asynccontextmanager
async def simulators() -> AsyncIterator[dict[str, str]]:
    render = RenderServer(RenderConfig(reasoning_parser="qwen3"))
    engine = EngineServer(EngineConfig())
    async with serving(render.app()) as render_url, serving(engine.app()) as engine_url:
        tasks = [asyncio.create_task(render_load(render_url)),
                 asyncio.create_task(engine_load(engine_url))]  # fmt: skip
        try:
            yield {"render": render_url, "prefill": engine_url, "decode": engine_url}
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_builtin_loop_scales_render_and_whole_slices_from_simulator_metrics(
    control_plane: ControlPlane, http_api: httpx.Client, admin: Kube, namespace: str
) -> None:
    apply_dm(http_api, namespace, "qwen", BUILTIN_SPEC)
    statefulsets = KINDS[("apps/v1", "StatefulSet")]
    deployments = KINDS[("apps/v1", "Deployment")]

    async with simulators() as urls:

        def resolve(pod: Mapping[str, Any]) -> str | None:
            component = pod["metadata"]["labels"].get(COMPONENT_LABEL)
            return f"{urls[component]}/metrics" if component in urls else None

        settings = OperatorSettings(resync_seconds=2, engine_metrics_seconds=0,
                                    autoscale_seconds=1)  # fmt: skip
        kube = Kube(load_credentials(str(control_plane.kubeconfig(OPERATOR_USER))))
        reconciler = Reconciler(kube, settings, resolve=resolve)
        in_sync = PassCounter(f"{namespace}/qwen: children in sync")
        assert reconciler.autoscaler is not None
        loops = [asyncio.create_task(reconciler.resync_forever()),
                 asyncio.create_task(reconciler.autoscaler.run_forever())]  # fmt: skip
        try:
            reconciler.trigger(namespace, "qwen")

            async def replicas(kind: Any, name: str) -> int | None:
                obj = await admin.get(kind, namespace, name)
                return None if obj is None else obj["spec"].get("replicas")

            async def started() -> bool:
                # One pass applies the StatefulSets before the Deployments: wait for both.
                return (
                    await replicas(statefulsets, "qwen-decode-s1") == 0
                    and await admin.get(deployments, namespace, "qwen-render") is not None
                )

            # Created at the minimum: one slice of two runs, one render replica.
            await eventually("the model's children", started, timeout=60)
            assert await replicas(statefulsets, "qwen-decode-s0") == 1
            assert await replicas(deployments, "qwen-render") == 1

            async def scaled() -> bool:
                counts = [await replicas(statefulsets, f"qwen-{pool}-s1")
                          for pool in ("prefill", "decode")]  # fmt: skip
                return counts == [1, 1] and await replicas(deployments, "qwen-render") == 3

            await eventually("render 1 -> 3 and slices 1 -> 2", scaled, timeout=90)

            def scaled_up() -> str:
                return " | ".join(e["message"] for e in events_for(http_api, namespace, "qwen")
                                  if e["reason"] == "ScaledUp")  # fmt: skip

            async def explained() -> bool:
                # Each Event is posted after the pass that changed its replicas: the slices'
                # may come after render's even though its replicas changed first.
                messages = scaled_up()
                return "-> 3: parser busy" in messages and "slices 1 -> 2: prefill:" in messages

            await eventually("ScaledUp events for render -> 3 and slices 1 -> 2", explained,
                             timeout=30)  # fmt: skip
            messages = scaled_up()
            assert "render replicas 1 -> " in messages  # in one step or two
            assert "-> 3: parser busy" in messages
            assert "slices 1 -> 2: prefill:" in messages
            assert "ITL" in messages
            assert "over the SLO" in messages

            # At the maximum the load keeps asking for more: nothing left to decide, so the
            # operator writes no replicas (its applies of workloads stop).
            def workload_writes() -> int:
                return len([e for e in control_plane.audit_events(user=OPERATOR_USER)
                            if e["objectRef"].get("namespace") == namespace
                            and e["objectRef"].get("resource") in ("deployments", "statefulsets")
                            and not e["objectRef"].get("subresource")])  # fmt: skip

            held = reconciler.autoscaler.metrics.registry.get_sample_value(
                "pdserve_operator_autoscale_replicas",
                {"namespace": namespace, "model": "qwen", "pool": "render"},
            )
            assert held == 3
            before, passes = workload_writes(), in_sync.count
            await eventually("two more reconcile passes", lambda: in_sync.at_least(passes + 2),
                             timeout=10 * settings.resync_seconds)  # fmt: skip
            assert workload_writes() == before
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await reconciler.drain()
            await reconciler.autoscaler.close()
            await kube.close()
            in_sync.close()
