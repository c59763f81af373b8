"""A parity change rolled out under steady load, on the real node: no request fails, and every
request is served by render, prefill and decode pods of one parity hash."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam

from pdserve.contract.names import PARITY_HASH_ANNOTATION
from tests.cluster.clitools import ensure_cli_tools
from tests.cluster.localplane import ADMIN_USER, wait_until
from tests.e2e.conftest import MODEL_NAMESPACE, Cluster, describe, model_status, pods, ready

GATEWAY = "app.kubernetes.io/component=gateway"


def patch_dm(cluster: Cluster, patch: dict[str, Any]) -> None:
    cluster.kubectl("patch", "dm", "sim-qwen3", "-n", MODEL_NAMESPACE, "--type=merge",
                    "-p", json.dumps(patch))  # fmt: skip


def settled(cluster: Cluster, parity: str | None = None) -> bool:
    """Every pod of the model Ready, none terminating, all of one parity hash (`parity`)."""
    current = pods(cluster, MODEL_NAMESPACE)
    hashes = {p["metadata"]["annotations"].get(PARITY_HASH_ANNOTATION) for p in current}
    return (
        all(ready(p) and not p["metadata"].get("deletionTimestamp") for p in current)
        and len(hashes) == 1
        and (parity is None or hashes == {parity})
    )


@dataclass
class PodHistory:
    """Every pod incarnation seen (by uid): its name and parity hash."""

    by_name: dict[str, set[str]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def watch(self, cluster: Cluster) -> None:
        while not self.stop.is_set():
            for pod in pods(cluster, MODEL_NAMESPACE):
                parity = pod["metadata"]["annotations"].get(PARITY_HASH_ANNOTATION, "")
                self.by_name.setdefault(pod["metadata"]["name"], set()).add(parity)
            self.stop.wait(0.25)


@dataclass
class GatewayLogs:
    """`kubectl logs -f` of every gateway pod that appears, so no replaced pod's request log
    is lost."""

    lines: list[str] = field(default_factory=list)
    followed: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def follow(self, cluster: Cluster) -> None:
        kubectl = str(ensure_cli_tools().kubectl)
        kubeconfig = f"--kubeconfig={cluster.plane.kubeconfig(ADMIN_USER)}"
        while not self.stop.is_set():
            for pod in pods(cluster, MODEL_NAMESPACE, GATEWAY):
                name = pod["metadata"]["name"]
                running = pod["status"].get("containerStatuses", [{}])[0].get("state", {})
                if name in self.followed or "running" not in running:
                    continue
                process = subprocess.Popen(
                    [kubectl, kubeconfig, "logs", "-f", "-n", MODEL_NAMESPACE, name],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                )  # fmt: skip
                self.followed[name] = process
                threading.Thread(target=self._read, args=(process,), daemon=True).start()
            self.stop.wait(0.25)
        for process in self.followed.values():
            process.terminate()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.append(line)

    def requests(self) -> list[dict[str, Any]]:
        entries = []
        for line in self.lines:
            if line.startswith('{"request_id"'):
                entries.append(json.loads(line))
        return entries


@dataclass
class Load:
    """Clients sending chat completions, streamed and not, one after another."""

    url: str
    clients: int = 3
    sent: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run_one(self, index: int) -> None:
        client = openai.OpenAI(base_url=self.url, api_key="unused", timeout=30, max_retries=0)
        turn = 0
        while not self.stop.is_set():
            turn += 1
            question: list[ChatCompletionMessageParam] = [
                {"role": "user", "content": f"client {index}, question {turn}"}
            ]
            finish: str | None
            try:
                if turn % 2:
                    chat = client.chat.completions.create(
                        model="sim-qwen3", messages=question, max_tokens=16
                    )
                    finish = chat.choices[0].finish_reason
                else:
                    stream = client.chat.completions.create(
                        model="sim-qwen3", messages=question, max_tokens=16, stream=True
                    )
                    finish = [c.choices[0].finish_reason for c in stream if c.choices][-1]
                if finish not in ("stop", "length"):
                    self.failures.append(f"finish_reason {finish}")
            except openai.OpenAIError as error:
                self.failures.append(repr(error))
            self.sent += 1


@contextmanager
def running(*targets: tuple[Any, threading.Event]) -> Iterator[None]:
    threads = [threading.Thread(target=t, daemon=True) for t, _ in targets]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        for _, stop in targets:
            stop.set()
        for thread in threads:
            thread.join(timeout=60)


def test_parity_change_under_load_fails_no_request_and_never_mixes_hashes(
    cluster: Cluster, model: str
) -> None:
    # The request log, so each request names the pods that served it (a non-parity change).
    patch_dm(cluster, {"spec": {"gateway": {"requestLog": True}}})
    wait_until("the gateways to roll with the request log", lambda: settled(cluster) and all(
        "--request-log" in p["spec"]["containers"][0]["args"]
        for p in pods(cluster, MODEL_NAMESPACE, GATEWAY)
    ), timeout=120, interval=1)  # fmt: skip
    old = model_status(cluster)["parityHash"]

    history, logs, load = PodHistory(), GatewayLogs(), Load(model)
    workers = [(partial(load.run_one, i), load.stop) for i in range(load.clients)]
    with running((lambda: history.watch(cluster), history.stop),
                 (lambda: logs.follow(cluster), logs.stop)):  # fmt: skip
        with running(*workers):
            wait_until("steady load", lambda: load.sent >= 10, timeout=60)
            started = time.monotonic()
            # A parity change: the default chat-template kwargs every pool renders with.
            patch_dm(cluster, {"spec": {"serving": {
                "defaultChatTemplateKwargs": {"enable_thinking": False}}}})  # fmt: skip
            wait_until("the new parity hash", lambda: model_status(cluster)["parityHash"] != old,
                       timeout=30)  # fmt: skip
            new = model_status(cluster)["parityHash"]
            wait_until(
                "every pod on the new parity hash",
                lambda: settled(cluster, new),
                timeout=240,
                interval=1,
            )
            rollout_seconds = time.monotonic() - started
            during = load.sent
            wait_until("requests after the rollout", lambda: load.sent >= during + 10, timeout=60)
        # Every request the clients sent reaches a gateway's log (written in the background).
        wait_until("the request log", lambda: len(logs.requests()) >= load.sent, timeout=30)

    entries = logs.requests()
    print(f"rollout {rollout_seconds:.1f}s, {load.sent} requests, {len(load.failures)} failed, "
          f"{len(entries)} logged")  # fmt: skip
    assert load.failures == [], f"{len(load.failures)} of {load.sent} failed: {load.failures[:5]}"
    assert {e["parity_hash"] for e in entries} == {old, new}, describe(cluster, MODEL_NAMESPACE)
    for entry in entries:
        for stage in ("render_engine", "prefill_engine", "decode_engine"):
            pod = entry[stage]
            if pod is None:
                continue
            # The pod it names existed with the request's parity hash.
            assert entry["parity_hash"] in history.by_name.get(pod, set()), (stage, entry)
    # Nothing is lost: the gateways logged every request the clients sent.
    assert len(entries) >= load.sent
