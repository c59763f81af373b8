"""The benchmark's native helpers (bench/native: a stub OpenAI engine and a load generator in Go,
standard library only), built with the local Go toolchain (pdserve.gobuild), so a proxy is
compared with neither of them being the bottleneck."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.gobuild import built

SOURCE = Path(__file__).with_name("native")
PROGRAMS = ["stubengine", "loadgen"]


@dataclass(frozen=True)
class NativeTools:
    stub_engine: Path
    loadgen: Path


def native_tools(go: str | None = None) -> NativeTools:
    """The two binaries, built once per source version (`go`: the Go command)."""
    out = built(SOURCE, PROGRAMS, "bench-native", go)
    return NativeTools(out / "stubengine", out / "loadgen")
