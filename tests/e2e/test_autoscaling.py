"""The operator's Builtin render autoscaling on the real node: parser load from real streams
makes it add render pods, which start and take traffic."""

from __future__ import annotations

import json
import threading
import time
from functools import partial
from typing import Any

import httpx
import openai

from devtools.localplane import wait_until
from tests.support.realcluster import MODEL_NAMESPACE, Cluster, describe, operator_logs, pods, ready

RENDER = "app.kubernetes.io/component=render"


def render_requests(pod: dict[str, Any]) -> float:
    """What the render pod's own /metrics says it served."""
    metrics = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("pdserve_sim_render_requests_total{")
    )


def stream_until(url: str, stop: threading.Event, errors: list[str]) -> None:
    client = openai.OpenAI(base_url=url, api_key="unused", timeout=60, max_retries=0)
    while not stop.is_set():
        try:
            for _ in client.chat.completions.create(
                model="sim-qwen3", messages=[{"role": "user", "content": "Think it through"}],
                max_tokens=256, stream=True,
            ):  # fmt: skip
                pass
        except openai.OpenAIError as error:
            errors.append(repr(error))


def test_builtin_render_autoscaling_adds_render_pods_that_take_traffic(
    cluster: Cluster, model: str
) -> None:
    scaling = {"engine": "Builtin", "minReplicas": 1, "maxReplicas": 2,
               "scaleUpStabilizationSeconds": 0, "cooldownSeconds": 0}  # fmt: skip
    cluster.kubectl("patch", "dm", "sim-qwen3", "-n", MODEL_NAMESPACE, "--type=merge", "-p",
                    json.dumps({"spec": {"render": {"autoscaling": scaling}}}))  # fmt: skip
    [first] = pods(cluster, MODEL_NAMESPACE, RENDER)

    stop, errors = threading.Event(), list[str]()
    clients = [threading.Thread(target=partial(stream_until, model, stop, errors), daemon=True)
               for _ in range(6)]  # fmt: skip
    for client in clients:
        client.start()
    started = time.monotonic()
    try:

        def two_ready() -> bool:
            current = pods(cluster, MODEL_NAMESPACE, RENDER)
            return len(current) == 2 and all(ready(p) for p in current)

        try:
            wait_until("a second render pod, Ready", two_ready, timeout=180, interval=2)
        except Exception as error:
            raise AssertionError(
                f"{error}\n{describe(cluster, MODEL_NAMESPACE)}{operator_logs(cluster)}"
            ) from error
        print(f"render 1 -> 2 Ready {time.monotonic() - started:.1f}s into the load")  # -s
        [added] = [p for p in pods(cluster, MODEL_NAMESPACE, RENDER)
                   if p["metadata"]["name"] != first["metadata"]["name"]]  # fmt: skip
        # The gateway sends the new render pod its share of the work.
        wait_until("traffic on the new render pod", lambda: render_requests(added) > 0,
                   timeout=60)  # fmt: skip
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=90)
    assert errors == [], errors[:5]
    events = json.loads(cluster.kubectl(
        "get", "events", "-n", MODEL_NAMESPACE, "--field-selector",
        "involvedObject.name=sim-qwen3,reason=ScaledUp", "-o", "json",
    ).stdout)["items"]  # fmt: skip
    assert any("render" in e["message"] for e in events), [e["message"] for e in events]
