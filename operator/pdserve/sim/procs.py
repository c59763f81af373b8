"""Simulated engines, render servers and gateways as their own processes on loopback (so a load
generator never shares their event loop), started and awaited by health check, always stopped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from pdserve.ports import free_port as free_port  # re-exported: the tests start processes with it

PDSERVE = [sys.executable, "-m", "pdserve.cli"]
PreExec = Callable[[], None] | None


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sim_engine_argv(
    model: str,
    port: int,
    *,
    role: str = "both",
    tokens_only: bool = False,
    served_model_name: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`pdserve sim engine` on 127.0.0.1:port with a KV role (prefill, decode or both)."""
    argv = [*PDSERVE, "sim", "engine", model, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--role", role]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if tokens_only:
        argv.append("--tokens-only")
    return argv + list(extra)


def sim_render_argv(
    model: str, port: int, *, served_model_name: str | None = None, extra: Sequence[str] = ()
) -> list[str]:
    argv = [*PDSERVE, "sim", "render", model, "--host", "127.0.0.1", "--port", str(port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    return argv + list(extra)


@dataclass
class Proc:
    process: subprocess.Popen[bytes]
    url: str
    log: Path
    argv: list[str]


class Processes:
    """Started processes; `with Processes() as procs:` stops every one of them on exit."""

    def __init__(self, startup_timeout: float = 60.0) -> None:
        self.items: list[Proc] = []
        self.startup_timeout = startup_timeout
        self._workdir = Path(tempfile.mkdtemp(prefix="pdserve-procs-"))

    def __enter__(self) -> Processes:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()

    def spawn(self, argv: list[str], port: int, preexec_fn: PreExec = None) -> Proc:
        """Run argv (to serve on 127.0.0.1:port) without waiting for it: see wait_ready.
        `preexec_fn` runs in the child before it starts (benchmarks pin it to CPUs there)."""
        log_path = self._workdir / f"{len(self.items)}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn
            )
        proc = Proc(process, f"http://127.0.0.1:{port}", log_path, argv)
        self.items.append(proc)
        return proc

    def wait_ready(self, *procs: Proc, health: str = "/health") -> None:
        """Poll each until its health check answers 200; fail with its log if it exits or the
        startup timeout passes."""
        deadline = time.monotonic() + self.startup_timeout
        for proc in procs:
            while True:
                try:
                    if httpx.get(proc.url + health, timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.process.poll() is not None or time.monotonic() > deadline:
                    tail = proc.log.read_text(errors="replace")[-2000:]
                    command = " ".join(proc.argv[3:6])
                    raise RuntimeError(f"{command} did not start:\n{tail}")
                time.sleep(0.1)

    def start(
        self, argv: list[str], port: int, health: str = "/health", preexec_fn: PreExec = None
    ) -> Proc:
        """Run argv (serving on 127.0.0.1:port) and wait until health answers 200."""
        proc = self.spawn(argv, port, preexec_fn)
        self.wait_ready(proc, health=health)
        return proc

    def engine(
        self,
        model: str,
        *,
        role: str = "both",
        tokens_only: bool = False,
        served_model_name: str | None = None,
        extra: Sequence[str] = (),
        preexec_fn: PreExec = None,
    ) -> Proc:
        port = free_port()
        argv = sim_engine_argv(
            model,
            port,
            role=role,
            tokens_only=tokens_only,
            served_model_name=served_model_name,
            extra=extra,
        )
        return self.start(argv, port, preexec_fn=preexec_fn)

    def render(
        self,
        model: str,
        *,
        served_model_name: str | None = None,
        extra: Sequence[str] = (),
        preexec_fn: PreExec = None,
    ) -> Proc:
        port = free_port()
        argv = sim_render_argv(model, port, served_model_name=served_model_name, extra=extra)
        return self.start(argv, port, preexec_fn=preexec_fn)

    def gateway(
        self,
        config: dict[str, Any],
        *extra: str,
        module: Sequence[str] = (*PDSERVE, "gateway"),
        preexec_fn: PreExec = None,
        port: int | None = None,
    ) -> Proc:
        """A gateway over `config` (a routing.json with static endpoints) on `port` (default: a
        free one); `module` picks the entry point (`pdserve gateway`, or the benchmark's
        time-scaled one)."""
        port = port or free_port()
        path = self._workdir / f"routing-{len(self.items)}.json"
        path.write_text(json.dumps(config))
        argv = [*module, "--config", str(path), "--host", "127.0.0.1", "--port", str(port)]
        return self.start([*argv, *extra], port, preexec_fn=preexec_fn)

    def stop(self) -> None:
        for proc in self.items:
            if proc.process.poll() is None:
                proc.process.terminate()
        for proc in self.items:
            try:
                proc.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.process.kill()
                proc.process.wait(timeout=10)
        self.items.clear()
        shutil.rmtree(self._workdir, ignore_errors=True)
