"""The Go code's own checks, as its ecosystem runs them: gofmt, go vet and staticcheck over every
Go module pdserve ships (the data plane and the benchmark's native programs), and the data
plane's tests, under the race detector and without it (the raw socket calls the product runs
are Go's own calls in race builds: rawio_race.go). `make lint` runs the checks; `make test`
runs them too (tests/unit/dataplane/test_go_tests.py), so CI cannot land Go code that fails
them.

    python -m devtools.golint          # gofmt, vet, staticcheck; exit 1 naming what failed
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pdserve.bench.native import SOURCE as NATIVE
from pdserve.gateway.dataplane import SOURCE as DATAPLANE

MODULES = (DATAPLANE, NATIVE)
STATICCHECK = "honnef.co/go/tools/cmd/staticcheck@v0.8.2"
"""Built from the Go module proxy on first use (about a minute on 2 cores), then cached by Go.
v0.8.2 is the newest the proxy serves that builds with Go 1.26."""
TIMEOUT_SECONDS = 900


def go() -> str:
    command = shutil.which("go")
    if command is None:
        raise SystemExit("Go (>= 1.22) is required: the data plane is built from Go source")
    return command


def go_env(*, cgo: bool = False) -> dict[str, str]:
    """The environment every Go command here runs in: the local toolchain, modules resolved
    from go.mod; cgo only for the race detector (it needs a C compiler)."""
    return {
        **os.environ,
        "CGO_ENABLED": "1" if cgo else "0",
        "GOTOOLCHAIN": "local",
        "GOFLAGS": "-mod=mod",
    }


def run(args: list[str], module: Path, *, cgo: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=module,
        env=go_env(cgo=cgo),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_SECONDS,
        check=False,
    )


def problems() -> list[str]:
    """What gofmt, go vet and staticcheck find, one entry per module and tool; empty when clean."""
    found = []
    gofmt = str(Path(go()).with_name("gofmt"))
    for module in MODULES:
        name = module.relative_to(DATAPLANE.parents[2])
        unformatted = run([gofmt, "-l", "."], module)
        if unformatted.returncode != 0 or unformatted.stdout.strip():
            found.append(
                f"{name}: gofmt -l (run gofmt -w):\n{unformatted.stdout}{unformatted.stderr}"
            )
        for tool, args in (
            ("go vet", [go(), "vet", "./..."]),
            ("staticcheck", [go(), "run", STATICCHECK, "./..."]),
        ):
            done = run(args, module)
            if done.returncode != 0:
                found.append(f"{name}: {tool}:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    return found


def race_tests() -> subprocess.CompletedProcess[str]:
    """The data plane's Go tests under the race detector (fuzz targets run their seed corpora)."""
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        raise SystemExit("go test -race needs a C compiler (gcc): apt-get install gcc")
    return run([go(), "test", "-race", "-count=1", "./..."], DATAPLANE, cgo=True)


def plain_tests() -> subprocess.CompletedProcess[str]:
    """The data plane's Go tests as the product is built: its raw socket calls (race builds
    use Go's own, rawio_race.go)."""
    return run([go(), "test", "-count=1", "./..."], DATAPLANE)


def main() -> int:
    found = problems()
    for problem in found:
        print(problem, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
