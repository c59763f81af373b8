"""The data plane's own Go tests (the JSON splicer, the routing table, picking, the API keys),
run by `go test` so `make test` runs them too."""

from __future__ import annotations

import os
import shutil
import subprocess

from pdserve.gateway.dataplane import SOURCE


def test_the_data_plane_go_tests_pass() -> None:
    go = shutil.which("go")
    assert go is not None, "Go (>= 1.22) is required: the data plane is built from Go source"
    done = subprocess.run(
        [go, "test", "-count=1", "./..."],
        cwd=SOURCE,
        env={**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "ok" in done.stdout
