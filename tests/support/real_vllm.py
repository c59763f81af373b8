"""Real vLLM on the CPU as processes on loopback ports (tests/vllm): a render server
(`vllm launch render`) and engines (`vllm serve`), all serving the tiny model built by
devtools/tiny_model.py, each with its own log, stopped with their whole process group."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from devtools.localplane import free_port
from devtools.procs import spawn_component, tail, terminate
from devtools.vllm_cpu import VllmCpu
from pdserve.api import DisaggregatedModel, parse_resource
from pdserve.ports import port_block
from pdserve.vllm.metrics import (
    GENERATION_TOKENS,
    NIXL_XFER_TIME,
    NUM_REQUESTS_RUNNING,
    REQUEST_SUCCESS,
    Totals,
    count,
    counter_samples,
    sum_samples,
)
from tests.support.operator_commands import PodCommand

SERVED_NAME = "tiny"


def tiny_cpu_engine(
    kv_cache_bytes: int = 64 << 20, *, one_process: bool = True, **fields: Any
) -> dict[str, Any]:
    """An engine pool as a user writes one for vLLM's CPU build and the tests' tiny model: the
    CPU settings in extraArgs; `one_process` runs the engine core in the API server's process
    (half the memory, the same engine)."""
    engine: dict[str, Any] = {
        "replicas": 1,
        "scheduler": {"maxNumSeqs": 8},
        "extraArgs": ["--enforce-eager", "--dtype", "float32", "--seed", "0",
                      "--kv-cache-memory-bytes", str(kv_cache_bytes)],
        **fields,
    }  # fmt: skip
    if one_process:
        engine["env"] = [{"name": "VLLM_ENABLE_V1_MULTIPROCESSING", "value": "0"}]
    return engine


def tiny_cpu_model(name: str, model: str | Path, spec: Mapping[str, Any]) -> DisaggregatedModel:
    """A DisaggregatedModel of the tiny model on CPU engines (no accelerator), named `name`."""
    return parse_resource({
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "DisaggregatedModel",
        "metadata": {"name": name, "namespace": "test"},
        "spec": {
            **spec,
            "model": {"name": str(model), "servedModelName": SERVED_NAME, **spec.get("model", {})},
            "placement": {"acceleratorResource": "", **spec.get("placement", {})},
        },
    })  # fmt: skip


# The text side, as a DisaggregatedModel's spec.serving would set it (parity flags).
TEXT_FLAGS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
              "--enable-auto-tool-choice"]  # fmt: skip
# Small and deterministic on two shared cores: no compilation, a 1 GiB KV cache, no thread
# pinning (several engines share the cores), fp32 (no bf16 kernels needed).
ENGINE_FLAGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048",
                "--max-num-seqs", "8", "--block-size", "128", "--seed", "0",
                "--kv-cache-memory-bytes", str(64 << 20)]  # fmt: skip
BASE_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
}


class VllmStartError(RuntimeError):
    """A vLLM process exited or did not become healthy in time."""


@dataclass
class VllmServer:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log, lines)


@dataclass
class VllmProcesses:
    env: VllmCpu
    model: Path
    logs: Path
    servers: dict[str, VllmServer] = field(default_factory=dict)

    def start(
        self,
        name: str,
        subcommand: Sequence[str],
        args: Sequence[str],
        extra_env: Mapping[str, str] | None = None,
    ) -> VllmServer:
        port = free_port()
        command = [str(self.env.vllm), *subcommand, str(self.model), *args]
        command += ["--port", str(port), "--host", "127.0.0.1", "--served-model-name", SERVED_NAME]
        return self._launch(name, command, port, extra_env or {})

    def start_pod(
        self,
        name: str,
        pod: PodCommand,
        *,
        side_channel_port: int | None = None,
        rpc_port: int | None = None,
    ) -> VllmServer:
        """A process running what the operator's pod for `pod.component` would run. The pods of
        one multi-node group share `rpc_port` (the leader's) and may share `side_channel_port`:
        NIXL listens on base + global data-parallel rank, distinct across the group. By default
        the base starts a free block of as many ports as the pod's data-parallel size (a rank's
        port taken by another process kills that rank's NIXL listener: the engine then never
        finishes its start)."""
        port = free_port()
        if side_channel_port is None:
            side_channel_port = port_block(pod.data_parallel_size)
        command, pod_env = pod.on_host(str(self.env.vllm), port, side_channel_port, rpc_port)
        return self._launch(name, command, port, pod_env)

    def _launch(
        self, name: str, command: list[str], port: int, extra_env: Mapping[str, str]
    ) -> VllmServer:
        env = {**_inherited_env(), **BASE_ENV, **extra_env}
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.logs / f"{name}.log").write_text(f"$ {' '.join(command)}\n")
        proc = _spawn(name, command, env, self.logs)
        server = VllmServer(name, f"http://127.0.0.1:{port}", proc, self.logs / f"{name}.log")
        self.servers[name] = server
        return server

    def render(self, name: str = "render") -> VllmServer:
        return self.start(name, ["launch", "render"], TEXT_FLAGS)

    def engine(
        self,
        name: str,
        *,
        mode: str = "--enable-scale-out",
        kv_role: str | None = None,
        extra_kv: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> VllmServer:
        args = [*ENGINE_FLAGS, mode]
        if mode != "--tokens-only":
            args += TEXT_FLAGS
        extra_env: dict[str, str] = dict(env or {})
        if kv_role is not None:
            config = {"kv_connector": "NixlConnector", "kv_role": kv_role,
                      "kv_buffer_device": "cpu", **(extra_kv or {})}  # fmt: skip
            args += ["--kv-transfer-config", json.dumps(config)]
            extra_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port_block(1))
            extra_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        return self.start(name, ["serve"], args, extra_env)

    @contextmanager
    def serving_pods(self, pods: Mapping[str, PodCommand]) -> Iterator[dict[str, VllmServer]]:
        """A process per pod (start_pod), all Ready, by pod name; every one stopped after."""
        try:
            for name, pod in pods.items():
                self.start_pod(name, pod)
            self.wait_ready()
            yield dict(self.servers)
        finally:
            self.stop()

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Poll every server's /health until all answer 200; a process that exits fails at once
        with its log."""
        deadline = time.monotonic() + timeout
        waiting = dict(self.servers)
        while waiting:
            for name, server in list(waiting.items()):
                if server.proc.poll() is not None:
                    raise VllmStartError(
                        f"{name} exited with code {server.proc.returncode}; "
                        f"{server.log}:\n{server.log_tail()}"
                    )
                try:
                    if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                        del waiting[name]
                except httpx.HTTPError:
                    pass
            if waiting and time.monotonic() > deadline:
                raise VllmStartError(
                    f"not healthy within {timeout:g} s: {sorted(waiting)}\n"
                    + "\n".join(f"--- {n}:\n{s.log_tail()}" for n, s in waiting.items())
                )
            if waiting:
                time.sleep(0.5)  # polling a process start, not synchronising with a result

    def stop(self) -> None:
        for server in self.servers.values():
            terminate(server.proc.pid, server.proc, grace=15.0)
        self.servers.clear()


def engine_counts(server: VllmServer) -> Totals:
    """What an engine's /metrics says now: finished requests by reason (`finished:abort`,
    `finished:stop`, ...), generated tokens, requests running and KV transfers (NIXL)."""
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    success = counter_samples(REQUEST_SUCCESS)
    generated = counter_samples(GENERATION_TOKENS)

    def select(name: str, labels: Mapping[str, str]) -> str | None:
        if name in success:
            return f"finished:{labels.get('finished_reason', '')}"
        if name in generated:
            return "generated"
        if name == NUM_REQUESTS_RUNNING:
            return "running"
        if name == count(NIXL_XFER_TIME):
            return "kv_transfers"
        return None

    return sum_samples(text, select)


def _inherited_env() -> dict[str, str]:
    import os

    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "XDG_CACHE_HOME")
    return {key: os.environ[key] for key in keep if key in os.environ}


def _spawn(
    name: str, command: list[str], env: Mapping[str, str], logs: Path
) -> subprocess.Popen[bytes]:
    with (logs / f"{name}.log").open("ab") as log:
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=dict(env),
        )  # fmt: skip


__all__ = [
    "SERVED_NAME",
    "VllmProcesses",
    "VllmServer",
    "VllmStartError",
    "engine_counts",
    "spawn_component",
]
