"""`pdserve gateway` as its own process: config file, request log, errors at startup."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.localplane import free_port, wait_until
from pdserve.sim.engine_config import EngineConfig
from pdserve.sim.engine_core import SchedulerConfig
from pdserve.sim.render_server import RenderConfig, RenderServer
from tests.support.serving import serving, serving_engine

MODEL = "qwen"


@asynccontextmanager
async def simulated(time_scale: float) -> AsyncIterator[dict[str, str]]:
    """A render server and a decode engine on loopback: their URLs by pool."""
    render = RenderServer(RenderConfig(model="m", served_model_name=MODEL))
    config = EngineConfig(
        model="m",
        served_model_name=MODEL,
        scheduler=SchedulerConfig(time_scale=time_scale),
    )
    async with (
        serving(render.app()) as render_url,
        serving_engine(config) as (_, decode_url),
    ):
        yield {"render": render_url, "decode": decode_url}


@pytest.fixture
async def upstreams() -> AsyncIterator[dict[str, str]]:
    async with simulated(time_scale=0.01) as urls:
        yield urls


def write_config(path: Path, upstreams: dict[str, str]) -> Path:
    pool = {"service": "x", "port": 8000}
    config: dict[str, Any] = {
        "model": MODEL,
        "engineApi": "tokens",
        "pools": {"render": pool, "prefill": None, "decode": pool},
        "parityHash": "p1",
        "endpoints": {name: [{"url": url, "parityHash": "p1"}] for name, url in upstreams.items()},
    }
    path.write_text(json.dumps(config))
    return path


def start_gateway(
    tmp_path: Path, upstreams: dict[str, str], *flags: str
) -> tuple[subprocess.Popen[bytes], str]:
    """`pdserve gateway` over `upstreams`, serving (its /health answers): the process, its URL."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "gateway",
            "--config",
            str(write_config(tmp_path / "routing.json", upstreams)),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until("the gateway", lambda: _health(url) == 200, timeout=30)
    except BaseException:
        process.kill()
        raise
    return process, url


def _health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health").status_code
    except httpx.TransportError:
        return None


async def test_gateway_process_serves_and_logs_each_request(
    upstreams: dict[str, str], tmp_path: Path
) -> None:
    log_file = tmp_path / "requests.jsonl"
    process, url = start_gateway(
        tmp_path, upstreams, "--request-log", str(log_file), "--log-format", "json"
    )
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 12,
                "stream": True,
            }
            response = await client.post(
                "/v1/chat/completions",
                json=body,
                headers={"X-Request-Id": "req-42", "X-PDServe-Class": "document"},
            )
            assert response.status_code == 200
            assert response.text.rstrip().endswith("data: [DONE]")
            assert response.headers["X-Request-Id"] == "req-42"
            own_id = response.headers["X-PDServe-Request-Id"]
        wait_until(
            "the request log",
            lambda: log_file.exists() and log_file.read_text().strip() != "",
            timeout=10,
        )
        [entry] = [json.loads(line) for line in log_file.read_text().splitlines()]
        # The gateway's own id (what the engines were told), and the client's beside it.
        assert (entry["request_id"], entry["client_request_id"]) == (own_id, "req-42")
        assert own_id.startswith("pdserve-")
        assert entry["class"] == "document"
        assert entry["requested_output_tokens"] == 12
        assert entry["sent_at_ms"] <= entry["first_token_at_ms"] <= entry["finished_at_ms"]
        assert entry["output_tokens"] > 0
        assert entry["prompt_tokens"] > 0
        # Where it ran and why (Auto, the default mode, with no prefill pool to use).
        assert entry["decode_engine"] == upstreams["decode"]
        assert entry["render_engine"] == upstreams["render"]
        assert entry["parity_hash"] == "p1"
        assert (entry["prefill_engine"], entry["auto_reason"]) == (None, "no_prefill")
        # What aiohttp's HTTP parser refuses, answered by the process in the OpenAI shape too.
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
            b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n{}"
        )
        answer = await asyncio.wait_for(reader.read(), 10)  # the refusal closes the connection
        writer.close()
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0].endswith(b" 400 Bad Request")
        assert b"Content-Type: application/json" in head
        error = json.loads(payload)["error"]
        assert error["message"].startswith("the request has both Content-Length and Transfer-")
    finally:
        process.terminate()
        process.wait(timeout=10)


async def test_sigterm_finishes_the_requests_in_flight_then_exits(tmp_path: Path) -> None:
    """SIGTERM: after its drain the gateway stops accepting, lets a stream under way run to its
    end, and exits 0."""
    async with simulated(time_scale=0.5) as upstreams:  # ~10 ms a token
        process, url = start_gateway(tmp_path, upstreams)
        try:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 150,
                "ignore_eos": True,
                "stream": True,
            }
            async with (
                httpx.AsyncClient(base_url=url, timeout=30) as client,
                client.stream("POST", "/v1/chat/completions", json=body) as response,
            ):
                assert response.status_code == 200
                lines = response.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
                process.terminate()
                rest = [line async for line in lines if line]
            assert rest[-1] == "data: [DONE]", rest[-3:]
            events = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
            finishes = [c["finish_reason"] for e in events for c in e.get("choices", [])]
            assert finishes[-1] == "length", rest[-3:]
            assert process.wait(timeout=30) == 0
            assert _health(url) is None
        finally:
            process.kill()
            process.wait(timeout=10)


async def test_sigterm_drains_each_answer_closing_its_connection(
    upstreams: dict[str, str], tmp_path: Path
) -> None:
    """SIGTERM first drains: the gateway keeps answering, on new connections and on kept-alive
    ones, and each answer says `Connection: close` and closes its connection, so a busy client
    moves to another replica between two requests instead of losing one to a closed
    connection. SIGINT ends the drain."""
    process, url = start_gateway(tmp_path, upstreams, "--drain-seconds", "600")
    host, port = url.removeprefix("http://").split(":")
    health = b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"
    try:
        # A connection kept alive from before the signal, idle when it comes.
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(health)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert b"Connection: close" not in head
        await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))

        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            process.terminate()

            async def closes() -> bool:
                answer = await client.get("/health")
                assert answer.status_code == 200
                return bool(answer.headers.get("connection") == "close")

            deadline = asyncio.get_running_loop().time() + 30
            while not await closes():  # until the gateway has the signal
                assert asyncio.get_running_loop().time() < deadline, "never started draining"
            # Each a new connection (the last one closed), each answered, each closing.
            assert [await closes() for _ in range(3)] == [True] * 3

        writer.write(health)
        answer = await asyncio.wait_for(reader.read(), 10)  # to the connection's end
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:80]
        assert b"Connection: close" in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")
        assert process.poll() is None, "stopped during its 600 s drain"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
        process.wait(timeout=10)


def test_bad_config_is_refused_naming_the_field(tmp_path: Path) -> None:
    config = tmp_path / "routing.json"
    config.write_text(json.dumps({"model": MODEL, "pools": {}}))
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "gateway", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "routing.json: pools.decode: Field required" in proc.stderr


def test_discovery_without_cluster_credentials_says_where_they_come_from(tmp_path: Path) -> None:
    """A routing config without `endpoints` (as the operator writes it) outside a pod and with
    no kubeconfig: a clear start-up error naming the flag, not a crash."""
    config = tmp_path / "routing.json"
    pool = {"service": "x", "port": 8000, "selector": {"app.kubernetes.io/instance": "m"}}
    config.write_text(json.dumps({"model": MODEL, "pools": {"decode": pool}}))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "gateway", "--config", str(config)],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "needs cluster credentials" in proc.stderr
    assert "--kubeconfig" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("api-key-file", "--api-key-file"),
        ("peer-key-file", "--peer-key-file"),
        ("PDSERVE_API_KEY", "PDSERVE_API_KEY"),
        ("PDSERVE_PEER_KEY", "PDSERVE_PEER_KEY"),
    ],
)
def test_an_empty_key_is_a_start_up_error_never_serving_everyone(
    tmp_path: Path, setting: str, named: str
) -> None:
    """An empty Secret or key file (a key that failed to arrive) stops the gateway, naming
    where the key was to come from and what to do."""
    config = write_config(tmp_path / "routing.json", {"render": "http://r", "decode": "http://d"})
    args = [sys.executable, "-m", "pdserve.cli", "gateway", "--config", str(config)]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    env |= {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}  # this checkout's code
    if setting.startswith("PDSERVE_"):
        env[setting] = "  \n"
    else:
        (tmp_path / "keys").write_text("\n  \n")
        args += [f"--{setting}", str(tmp_path / "keys")]
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=30, check=False, env=env
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr
    assert "Traceback" not in proc.stderr
