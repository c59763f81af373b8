"""Faults a running model meets, on the real node, seen by a real client."""

from __future__ import annotations

import threading
from typing import Any

import openai

from devtools.localplane import wait_until
from tests.support.realcluster import MODEL_NAMESPACE, Cluster, pods, ready, sigkill

DECODE = "app.kubernetes.io/component=decode"


def decode_pod(cluster: Cluster) -> dict[str, Any]:
    [pod] = pods(cluster, MODEL_NAMESPACE, DECODE)
    return pod


def restarts(pod: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses", []))


def test_decode_killed_mid_stream_ends_the_stream_cleanly_and_comes_back(
    cluster: Cluster, model: str
) -> None:
    client = openai.OpenAI(base_url=model, api_key="unused", timeout=60, max_retries=0)
    before = decode_pod(cluster)

    stream = client.chat.completions.create(
        model="sim-qwen3", messages=[{"role": "user", "content": "Write a long story"}],
        max_tokens=4000, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    received: list[Any] = []
    outcome: dict[str, BaseException | None] = {}

    def read() -> None:
        try:
            for chunk in stream:
                received.append(chunk)
            outcome["error"] = None
        except BaseException as error:  # what the client sees is the assertion
            outcome["error"] = error

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_until("the stream to carry tokens", lambda: len(received) >= 5, timeout=60)
    sigkill(cluster, MODEL_NAMESPACE, before["metadata"]["name"])
    reader.join(timeout=90)
    assert not reader.is_alive(), f"the stream hung after the decode engine died ({received[-1:]})"

    error = outcome["error"]
    print(f"stream after the kill: {len(received)} chunks, then {error!r}")  # shown with -s
    finishes = [c.choices[0].finish_reason for c in received if c.choices]
    if error is None:
        # Served to the end (retried elsewhere or on local prefill): a finish reason, no cut.
        assert finishes, received[-3:]
        assert finishes[-1] in ("stop", "length"), received[-3:]
    else:
        # Or a clear error event the SDK raises, never a bare disconnect.
        assert isinstance(error, openai.APIError), repr(error)
        assert not isinstance(error, openai.APIConnectionError), repr(error)

    def back() -> bool:
        pod = decode_pod(cluster)
        return ready(pod) and restarts(pod) > restarts(before)

    wait_until("the decode pod to restart and be Ready", back, timeout=120, interval=1)

    def answered() -> bool:
        chat = client.chat.completions.create(
            model="sim-qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        return chat.choices[0].finish_reason in ("stop", "length")

    # The restarted engine takes traffic again (it is the only decode replica).
    wait_until("an answer after the restart", answered, timeout=60, interval=1)
