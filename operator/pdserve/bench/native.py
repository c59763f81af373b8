"""The benchmark's native helpers (bench/native: a stub OpenAI engine and a load generator in Go,
standard library only), built with the local Go toolchain into a cache keyed by their source,
so a proxy is compared with neither of them being the bottleneck."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("native")
PROGRAMS = ("stubengine", "loadgen")


class NativeUnavailable(Exception):
    """Go is missing or the build failed: the message says what to install or pass."""


@dataclass(frozen=True)
class NativeTools:
    stub_engine: Path
    loadgen: Path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / "bench-native"


def source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE.rglob("*")):
        if path.is_file() and path.suffix in (".go", ".mod"):
            digest.update(path.relative_to(SOURCE).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def native_tools(go: str | None = None) -> NativeTools:
    """The two binaries, built once per source version (`go`: the Go command; default `go`
    on PATH)."""
    out = cache_root() / source_digest()
    tools = NativeTools(out / "stubengine", out / "loadgen")
    if tools.stub_engine.exists() and tools.loadgen.exists():
        return tools
    command = go or shutil.which("go")
    if command is None:
        raise NativeUnavailable(
            "the stub engine and load generator are built with Go (>= 1.22), which is not on "
            "PATH: install Go or pass --go PATH"
        )
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}
    built = subprocess.run(
        [command, "build", "-o", str(out), *(f"./{name}" for name in PROGRAMS)],
        cwd=SOURCE,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if built.returncode != 0:
        raise NativeUnavailable(f"building {SOURCE} with {command} failed:\n{built.stderr[-2000:]}")
    return tools
