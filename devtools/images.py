"""pdserve's images for the real node, built on this machine without a Docker engine.

No registry can be reached, so everything starts from Debian's packages:
- the base `python:3.11.2-slim-bookworm` is made by debootstrap (Debian 12 minbase with Debian's
  python3, python3-pip, python3-venv and ca-certificates) and committed under the published name,
  so images/Dockerfile builds unchanged. It differs from the published image: Python is Debian's
  3.11 in /usr/bin (published: a CPython 3.11 built into /usr/local), pip is Debian's, packages
  install into the system site-packages (PIP_BREAK_SYSTEM_PACKAGES=1 is set), and the locale is
  C.UTF-8;
- the Go build stage's `golang:1.26.8-bookworm` is that base with this machine's Go toolchain
  (its GOROOT, which must be that Go, 1.26.8) copied to /usr/local/go and on PATH: the published
  image is Debian bookworm with the same toolchain there, and build tools the data plane's
  static, cgo-free build does not use;
- images/Dockerfile (targets `pdserve` and `sim`) is built by buildah; its RUN steps reach PyPI
  with this machine's CA bundle mounted for the build only (never stored in an image);
- the pod sandbox image is images/pause, a static C program.

Each image is cached as a docker archive under the cache directory, keyed by a hash of what it
is built from, so a warm run only imports the archives into the node's containerd.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from devtools.clitools import cache_root

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "images" / "Dockerfile"
PAUSE_DIR = ROOT / "images" / "pause"
BASE_IMAGE = "docker.io/library/python:3.11.2-slim-bookworm"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("PDSERVE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = ("python3", "python3-pip", "python3-venv", "ca-certificates")
BASE_ENV = ("PIP_BREAK_SYSTEM_PACKAGES=1", "LANG=C.UTF-8")
GO_IMAGE = "docker.io/library/golang:1.26.8-bookworm"
GO_PATH_ENV = "PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What the Dockerfile's build context COPYs: a change to any of these rebuilds the images.
CONTEXT = (
    "pyproject.toml",
    "README.md",
    "operator",
    "images/requirements.lock",
    "images/build-requirements.lock",
    "images/sim-requirements.lock",
)
BUILD_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
# The version the operator-upgrade test (tests/e2e/test_operator_upgrade.py) upgrades from:
# main as the previous release of this repository left it (2026-12-05). Built from this
# clone's history: its own tree, Dockerfile and chart.
EARLIER_COMMIT = "ccce2e7ae8d0e696a4572987884431b995d900d9"


class ImageBuildError(RuntimeError):
    """An image could not be built; the message names the step and its output."""


@dataclass(frozen=True)
class Images:
    pdserve: str
    sim: str
    archives: tuple[Path, ...]  # docker archives, pause first, for `ctr images import`


def version() -> str:
    from pdserve import __version__

    return __version__


def image_cache() -> Path:
    return cache_root() / "images"


def missing_prerequisites() -> list[str]:
    return [c for c in ("buildah", "debootstrap", "gcc") if shutil.which(c) is None]


def log(message: str) -> None:
    print(f"image build: {message}", file=sys.stderr, flush=True)


def _run(args: list[str], *, step: str, timeout: float = 1800, missing: str = "") -> str:
    """stdout; ImageBuildError naming the step (or saying ``missing``) when it fails."""
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0 and missing:
        raise ImageBuildError(missing)
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip().splitlines()[-40:]
        raise ImageBuildError(f"{step} failed ({proc.returncode}):\n" + "\n".join(output))
    return proc.stdout


class Builder:
    """buildah with a storage of its own under the cache directory."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.store = cache / "buildah"

    def buildah(self, *args: str, step: str, timeout: float = 1800) -> str:
        base = ["buildah", "--root", str(self.store / "root"), "--runroot",
                str(self.store / "run"), "--storage-driver", "overlay"]  # fmt: skip
        return _run([*base, *args], step=step, timeout=timeout)

    def has_image(self, name: str) -> bool:
        listed = self.buildah("images", "--format", "{{.Name}}:{{.Tag}}", step="list images")
        return name in listed.split()

    # ---- the three kinds of image --------------------------------------------------------------
    def base(self) -> None:
        """python:3.11.2-slim-bookworm from Debian's packages (see the module docstring)."""
        key = digest([BASE_IMAGE, DEBIAN_SUITE, *BASE_PACKAGES, *BASE_ENV])
        marker = self.cache / f"base-{key}.done"
        if marker.exists() and self.has_image(BASE_IMAGE):
            return
        log(f"debootstrap {DEBIAN_SUITE} with {', '.join(BASE_PACKAGES)} (about 2 minutes)")
        with tempfile.TemporaryDirectory(dir=self.cache) as work:
            rootfs = Path(work) / "rootfs"
            _run(
                ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                 DEBIAN_SUITE, str(rootfs), DEBIAN_MIRROR],
                step="debootstrap",
            )  # fmt: skip
            shipped = _run(
                ["chroot", str(rootfs), "python3", "-c",
                 "import platform; print(platform.python_version())"],
                step="base: Python version",
            ).strip()  # fmt: skip
            if not BASE_IMAGE.endswith(f":{shipped}-slim-{DEBIAN_SUITE}"):
                raise ImageBuildError(
                    f"Debian {DEBIAN_SUITE} now ships Python {shipped}, but the base is named "
                    f"{BASE_IMAGE}: rename it in images/Dockerfile and devtools/images.py"
                )
            for trim in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc",
                         "usr/share/man"):  # fmt: skip
                for entry in (rootfs / trim).glob("*"):
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink()
            container = self.buildah("from", "scratch", step="base: new container").strip()
            try:
                self.buildah("copy", container, str(rootfs), "/", step="base: copy rootfs")
                config = [arg for env in BASE_ENV for arg in ("--env", env)]
                self.buildah("config", *config, "--cmd", "python3", container, step="base")
                self.buildah("commit", "--rm", container, BASE_IMAGE, step="base: commit")
            except BaseException:
                self.buildah("rm", container, step="base: remove container")
                raise
        marker.write_text(BASE_IMAGE + "\n")

    def golang(self) -> None:
        """golang:1.26.8-bookworm: the base with this machine's Go (see the module docstring)."""
        wanted = GO_IMAGE.rsplit(":", 1)[1].split("-")[0]  # "1.26.8"
        go = shutil.which("go")
        if go is None:
            raise ImageBuildError(f"the data plane's build stage needs Go {wanted} on this machine")
        goroot, goversion = _run([go, "env", "GOROOT", "GOVERSION"], step="go env").split()
        if goversion != f"go{wanted}":
            raise ImageBuildError(
                f"this machine's Go is {goversion}, but the build stage is {GO_IMAGE}: "
                "install Go " + wanted + ", or rename the stage in images/Dockerfile and "
                "devtools/images.py"
            )
        key = digest([GO_IMAGE, BASE_IMAGE, goversion, GO_PATH_ENV])
        marker = self.cache / f"golang-{key}.done"
        if marker.exists() and self.has_image(GO_IMAGE):
            return
        self.base()
        log(f"{GO_IMAGE} from {BASE_IMAGE} and this machine's {goversion}")
        container = self.buildah("from", "--pull-never", BASE_IMAGE, step="golang: new").strip()
        try:
            self.buildah("copy", container, goroot, "/usr/local/go", step="golang: copy GOROOT")
            self.buildah("config", "--env", GO_PATH_ENV, "--env", "GOTOOLCHAIN=local",
                         "--cmd", "bash", container, step="golang")  # fmt: skip
            self.buildah("commit", "--rm", container, GO_IMAGE, step="golang: commit")
        except BaseException:
            self.buildah("rm", container, step="golang: remove container")
            raise
        marker.write_text(GO_IMAGE + "\n")

    def pause(self) -> Path:
        key = digest_files([PAUSE_DIR / "pause.c", PAUSE_DIR / "Dockerfile"])
        archive = self.cache / f"pause-{key}.tar"
        if archive.exists():
            return archive
        log("pause (static C)")
        with tempfile.TemporaryDirectory(dir=self.cache) as context:
            shutil.copy(PAUSE_DIR / "Dockerfile", Path(context) / "Dockerfile")
            _run(["gcc", "-static", "-O2", "-o", f"{context}/pause", str(PAUSE_DIR / "pause.c")],
                 step="gcc pause.c")  # fmt: skip
            self.buildah("bud", "--pull-never", "-t", PAUSE_IMAGE, context, step="build pause")
        return self.archive(PAUSE_IMAGE, archive)

    def target(self, target: str, name: str) -> Path:
        """One target of images/Dockerfile, tagged `name`, as a docker archive."""
        key = digest_files([DOCKERFILE, *_context_files()], extra=[target, name])
        archive = self.cache / f"{target}-{key}.tar"
        if archive.exists():
            return archive
        log(f"{name} (images/Dockerfile, target {target})")
        self._build(target, name, ROOT)
        return self.archive(name, archive)

    def revision(self, commit: str, target: str, name: str) -> Path:
        """One target of images/Dockerfile as it was at ``commit`` of this repository: that
        commit's tree (`git archive`) is the context, its own Dockerfile builds it."""
        sha = resolve_commit(ROOT, commit)
        archive = self.cache / f"rev-{target}-{sha[:12]}.tar"
        if archive.exists():
            return archive
        log(f"{name} (images/Dockerfile at {sha[:12]}, target {target})")
        with tempfile.TemporaryDirectory(dir=self.cache) as tree:
            tarball = Path(tree) / "tree.tar"
            _run(["git", "-C", str(ROOT), "archive", "-o", str(tarball), sha], step="git archive")
            _run(["tar", "-xf", str(tarball), "-C", tree], step="unpack the tree")
            tarball.unlink()
            self._build(target, name, Path(tree))
        return self.archive(name, archive)

    def _build(self, target: str, name: str, context: Path) -> None:
        self.base()
        self.golang()
        mounts = (
            ["--volume", f"{BUILD_CA_BUNDLE}:{BUILD_CA_BUNDLE}:ro"]
            if BUILD_CA_BUNDLE.exists() else []
        )  # fmt: skip
        self.buildah(
            "bud", "--pull-never", "--network", "host", *mounts,
            "--build-arg", f"VERSION={version()}", "--target", target,
            "-f", str(context / "images" / "Dockerfile"), "-t", name, str(context),
            step=f"build {name}",
        )  # fmt: skip

    def archive(self, name: str, archive: Path) -> Path:
        stem = archive.name.rsplit("-", 1)[0]
        for old in self.cache.glob(f"{stem}-*.tar"):
            old.unlink()  # one archive per image: the cache does not grow per commit
        partial = archive.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        self.buildah("push", name, f"docker-archive:{partial}:{name}", step=f"export {name}")
        partial.rename(archive)
        # The image an older archive came from is untagged now: free its layers.
        self.buildah("rmi", "--prune", step="prune old images")
        return archive


def build_images(cache: Path | None = None) -> Images:
    """Build (or find cached) the pause, pdserve and pdserve-sim images."""
    if missing := missing_prerequisites():
        raise ImageBuildError("building images needs: " + ", ".join(missing))
    directory = cache or image_cache()
    directory.mkdir(parents=True, exist_ok=True)
    builder = Builder(directory)
    pdserve = f"ghcr.io/pdserve/pdserve:{version()}"
    sim = f"ghcr.io/pdserve/pdserve-sim:{version()}"
    archives = (builder.pause(), builder.target("pdserve", pdserve), builder.target("sim", sim))
    return Images(pdserve=pdserve, sim=sim, archives=archives)


def _context_files() -> list[Path]:
    files: list[Path] = []
    for entry in CONTEXT:
        path = ROOT / entry
        if path.is_file():
            files.append(path)
            continue
        files += sorted(
            p for p in path.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p)
        )  # fmt: skip
    return files


def digest(parts: Iterable[str]) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def digest_files(files: Iterable[Path], extra: Iterable[str] = ()) -> str:
    hasher = hashlib.sha256("\0".join(extra).encode())
    for path in files:
        hasher.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return hasher.hexdigest()[:16]


def resolve_commit(repo: Path, commit: str) -> str:
    """``commit``'s full sha in the clone at ``repo``; a shallow clone (CI's may be) first
    fetches the rest of its history from its origin."""
    find = ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"]
    missing = (f"commit {commit} is not in the history of the clone at {repo}, nor in its "
               "origin's: build from a clone of the repository that has it")  # fmt: skip
    found = subprocess.run(find, capture_output=True, text=True, check=False)
    if found.returncode != 0:
        shallow = _run(["git", "-C", str(repo), "rev-parse", "--is-shallow-repository"],
                       step="git rev-parse --is-shallow-repository").strip()  # fmt: skip
        if shallow != "true":
            raise ImageBuildError(missing)
        log(f"commit {commit[:12]} not in this shallow clone: fetching its history")
        _run(["git", "-C", str(repo), "fetch", "--quiet", "--unshallow"], step="git fetch",
             missing=missing)  # fmt: skip
        return _run(find, step=f"find commit {commit}", missing=missing).strip()
    return found.stdout.strip()


def earlier_image(cache: Path | None = None) -> tuple[str, Path]:
    """The pdserve image of EARLIER_COMMIT (the operator-upgrade test starts from it): its
    name and docker archive."""
    name = f"ghcr.io/pdserve/pdserve:earlier-{EARLIER_COMMIT[:12]}"
    directory = cache or image_cache()
    directory.mkdir(parents=True, exist_ok=True)
    return name, Builder(directory).revision(EARLIER_COMMIT, "pdserve", name)


def main(argv: list[str] | None = None) -> int:
    """`make node-images`: build what is missing, print the archives; `--earlier`: the image
    of EARLIER_COMMIT instead (`make earlier-image`)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        archives = [earlier_image()[1]] if args == ["--earlier"] else build_images().archives
    except ImageBuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for path in archives:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
