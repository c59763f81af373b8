"""Go programs that ship as source in this package (the benchmark's stub engine and load
generator, the gateway's data plane), built with the local Go toolchain into a cache keyed by
their source, so a changed source is rebuilt and an unchanged one never is."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


class GoUnavailable(Exception):
    """Go is missing or the build failed: the message says what to install or pass."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve"


def source_digest(source: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(source.rglob("*")):
        if path.is_file() and path.suffix in (".go", ".mod"):
            digest.update(path.relative_to(source).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def built(source: Path, programs: list[str], cache: str, go: str | None = None) -> Path:
    """The directory holding `programs` (packages under `source`, or "." for its root, named
    after the source directory) built once per source version; `go`: the Go command (default
    `go` on PATH)."""
    out = cache_root() / cache / source_digest(source)
    names = [source.name if p == "." else p for p in programs]
    if all((out / name).exists() for name in names):
        return out
    command = go or shutil.which("go")
    if command is None:
        raise GoUnavailable(
            f"{', '.join(names)} are built with Go (>= 1.22), which is not on PATH: install Go "
            "or pass --go PATH"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside, then renamed into place: another process finding `out` (this check, at
    # the same time) must find the programs whole, never half written.
    building = Path(tempfile.mkdtemp(prefix=f"{out.name}.building-", dir=out.parent))
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}
    try:
        done = subprocess.run(
            [command, "build", "-o", str(building)]
            + [p if p == "." else f"./{p}" for p in programs],
            cwd=source,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise GoUnavailable(f"building {source} with {command} failed:\n{done.stderr[-2000:]}")
        building.chmod(0o755)  # mkdtemp's 0700 would hide the programs from other users
        with contextlib.suppress(OSError):  # another process put the same build there first
            building.rename(out)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return out
