"""Steady load on a model on the real node, and what it leaves behind: the clients (chat,
streamed and not), every gateway's request log (which pods served each request) and every pod
incarnation seen with its parity hash. The day-2 scenarios (tests/e2e) run under it."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import openai
from openai.types.chat import ChatCompletionMessageParam

from devtools.localplane import ControlPlaneError, wait_until
from pdserve.contract.names import KV_COMPAT_ANNOTATION, PARITY_HASH_ANNOTATION
from tests.support.realcluster import MODEL_NAMESPACE, Cluster, patch_dm, pods, ready, settled

GATEWAY = "app.kubernetes.io/component=gateway"


@dataclass
class Incarnation:
    """One pod (by uid) and when it was seen, in wall-clock ms (the request log's clock)."""

    name: str
    kv_compat: str | None
    first_ms: int
    last_ms: int
    ready_ms: int | None = None  # first seen Ready


@dataclass
class PodHistory:
    """Every pod incarnation seen (by uid): its name, parity hash and KV-compatibility digest."""

    by_name: dict[str, set[str]] = field(default_factory=dict)
    incarnations: dict[str, Incarnation] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def watch(self, cluster: Cluster) -> None:
        while not self.stop.is_set():
            seen_ms = int(time.time() * 1000)
            for pod in pods(cluster, MODEL_NAMESPACE):
                meta = pod["metadata"]
                parity = meta["annotations"].get(PARITY_HASH_ANNOTATION, "")
                self.by_name.setdefault(meta["name"], set()).add(parity)
                known = self.incarnations.setdefault(meta["uid"], Incarnation(
                    meta["name"], meta["annotations"].get(KV_COMPAT_ANNOTATION), seen_ms, seen_ms
                ))  # fmt: skip
                known.last_ms = seen_ms
                if known.ready_ms is None and ready(pod):
                    known.ready_ms = seen_ms
            self.stop.wait(0.25)

    def kv_compat_of(self, pod: str, start_ms: int, end_ms: int) -> set[str | None]:
        """The digests of the incarnations named `pod` alive at some moment of [start, end]
        (one, unless the pod was replaced within it; the poll's 250 ms widens each)."""
        return {
            i.kv_compat for i in self.incarnations.values()
            if i.name == pod and i.first_ms - 500 <= end_ms and start_ms <= i.last_ms + 500
        }  # fmt: skip


@dataclass
class GatewayLogs:
    """Every gateway container's log, read from the node's log files through descriptors opened
    while the pod lives, so a replaced pod's last lines are read even after the kubelet deletes
    its files. (`kubectl logs -f` is not enough: it stops at the end of the file as soon as the
    runtime reports the container exited, and the runtime may still be writing its last lines.)"""

    directory: Path
    namespace: str
    files: dict[Path, IO[str]] = field(default_factory=dict)
    unfinished: dict[Path, str] = field(default_factory=dict)  # a record being written
    joined: dict[Path, str] = field(default_factory=dict)  # P(artial) records of a long line
    lines: list[str] = field(default_factory=list)  # request log entries
    said: list[str] = field(default_factory=list)  # every other line, by pod
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def follow(self) -> None:
        while not self.stop.is_set():
            self.read()
            self.stop.wait(0.2)

    def logs(self) -> list[Path]:
        """The gateway pods' log files now; the kubelet removes a deleted pod's directory,
        possibly while it is being listed."""
        try:
            return list(self.directory.glob(f"{self.namespace}_*/gateway/*.log"))
        except FileNotFoundError:
            return []

    def read(self) -> None:
        with self.lock:
            for path in self.logs():
                if path not in self.files:
                    try:
                        self.files[path] = path.open(encoding="utf-8")
                    except FileNotFoundError:
                        continue  # its pod went away meanwhile (files opened stay readable)
            for path, handle in self.files.items():
                text = self.unfinished.pop(path, "") + handle.read()
                for record in text.splitlines(keepends=True):
                    if not record.endswith("\n"):
                        self.unfinished[path] = record
                        continue
                    # CRI format: <time> <stream> <P|F> <text>
                    _, _, tag, content = record.split(" ", 3)
                    content = self.joined.pop(path, "") + content.removesuffix("\n")
                    if tag == "P":
                        self.joined[path] = content
                    elif content.startswith('{"request_id"'):
                        self.lines.append(content)
                    else:  # the gateway's own log: what a failure names
                        self.said.append(f"{path.parent.parent.name}: {content}")

    def requests(self) -> dict[str, dict[str, Any]]:
        """The request log's entries by the client's X-Request-Id (`request_id` is the
        gateway's own)."""
        self.read()
        entries = (json.loads(line) for line in self.lines if line.startswith('{"request_id"'))
        return {entry["client_request_id"]: entry for entry in entries}

    def close(self) -> None:
        for handle in self.files.values():
            handle.close()


@dataclass
class Load:
    """Clients sending chat completions, streamed and not, one after another."""

    url: str
    clients: int = 3
    model: str = "sim-qwen3"
    timeout: float = 30  # the client's, per request
    sent: list[str] = field(default_factory=list)  # request ids
    failures: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # each request's, as its client saw it
    stop: threading.Event = field(default_factory=threading.Event)

    def run_one(self, index: int) -> None:
        client = openai.OpenAI(
            base_url=self.url, api_key="unused", timeout=self.timeout, max_retries=0
        )
        turn = 0
        while not self.stop.is_set():
            turn += 1
            question: list[ChatCompletionMessageParam] = [
                {"role": "user", "content": f"client {index}, question {turn}"}
            ]
            request_id = f"rollout-{index}-{turn}"
            headers = {"X-Request-Id": request_id}
            finish: str | None
            started = time.monotonic()
            try:
                if turn % 2:
                    chat = client.chat.completions.create(
                        model=self.model, messages=question, max_tokens=16, extra_headers=headers
                    )
                    finish = chat.choices[0].finish_reason
                else:
                    stream = client.chat.completions.create(
                        model=self.model, messages=question, max_tokens=16, stream=True,
                        extra_headers=headers,
                    )  # fmt: skip
                    finish = [c.choices[0].finish_reason for c in stream if c.choices][-1]
                if finish not in ("stop", "length"):
                    self.failures.append(f"finish_reason {finish}")
            except openai.OpenAIError as error:
                self.failures.append(f"{request_id}: {error!r}")
            self.seconds.append(time.monotonic() - started)
            self.sent.append(request_id)

    def wait_for_more(self, count: int = 10, timeout: float = 60) -> None:
        """Until `count` more requests were sent (the load goes on after a change)."""
        before = len(self.sent)
        wait_until(f"{count} more requests", lambda: len(self.sent) >= before + count,
                   timeout=timeout)  # fmt: skip


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


def request_log_on(cluster: Cluster) -> None:
    """The gateways' request log on, so each request names the pods that served it (not a
    parity change: only the gateways roll)."""
    patch_dm(cluster, {"spec": {"gateway": {"requestLog": True}}})
    wait_until("the gateways to roll with the request log", lambda: settled(cluster) and all(
        "--request-log" in p["spec"]["containers"][0]["args"]
        for p in pods(cluster, MODEL_NAMESPACE, GATEWAY)
    ), timeout=120, interval=1)  # fmt: skip


def logged_requests(load: Load, logs: GatewayLogs) -> list[dict[str, Any]]:
    """Every request the clients sent, as a gateway logged it: nothing is lost (the log is
    written in the background, so polled for)."""

    def missing() -> list[str]:
        return sorted(set(load.sent) - set(logs.requests()))

    try:
        wait_until("every request in the request log", lambda: not missing(), timeout=30)
    except ControlPlaneError as error:
        lost = missing()
        raise AssertionError(
            f"{error}: {len(lost)} of {len(load.sent)} never logged ({lost[:10]}); "
            f"failed: {load.failures[:5]}; the gateways said:\n" + "\n".join(logs.said[-40:])
        ) from None
    logged = logs.requests()
    return [logged[request_id] for request_id in load.sent]
