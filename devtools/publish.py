"""pdserve's images pushed to a registry of the user's, for clusters that cannot use
``ghcr.io/pdserve`` (no release is published there yet, or the cluster pulls only from its own
registry): ``make push-images REGISTRY=registry.example.com/team``.

The images are those the tests run (devtools/images.py: buildah, no Docker engine); each is
pushed under its version tag and referred to by the digest the registry stored, so that what the
chart and the example install is exactly what was pushed. Credentials are buildah's own
(``buildah login``, or REGISTRY_AUTH_FILE); a registry with a private CA is trusted with
``--cert-dir`` (a directory of ``*.crt``, as /etc/containers/certs.d/<host>/ holds).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from devtools.images import Builder, ImageBuildError, build_images, image_cache

SIM_EXAMPLE = "examples/sim-qwen3.yaml"


@dataclass(frozen=True)
class Pushed:
    """One image in the registry: ``repository`` (host/path/name), its tag and stored digest."""

    source: str  # the local name it was built under
    repository: str
    tag: str
    digest: str  # sha256:...

    @property
    def reference(self) -> str:
        """By digest: what a pod spec should name, immune to a tag pushed over."""
        return f"{self.repository}@{self.digest}"


@dataclass(frozen=True)
class Published:
    pdserve: Pushed
    sim: Pushed

    def helm_values(self) -> list[str]:
        """`helm install/upgrade` arguments that run the operator (and, through it, every
        gateway) from the pushed pdserve image."""
        return ["--set", f"image.repository={self.pdserve.repository}",
                "--set", f"image.tag={self.pdserve.tag}",
                "--set", f"image.digest={self.pdserve.digest}"]  # fmt: skip


def push(
    builder: Builder,
    source: str,
    archive: Path,
    repository: str,
    *,
    cert_dir: Path | None,
    tls_verify: bool,
) -> Pushed:
    """``source`` to ``repository``:<its tag>; from its cached ``archive`` when the builder's
    storage no longer holds it."""
    tag = source.rsplit(":", 1)[1]
    if not builder.has_image(source):
        builder.buildah("pull", f"docker-archive:{archive}", step=f"load {archive.name}")
    options = [f"--tls-verify={'true' if tls_verify else 'false'}"]
    if cert_dir is not None:
        options += ["--cert-dir", str(cert_dir)]
    with tempfile.TemporaryDirectory() as work:
        digest_file = Path(work) / "digest"
        builder.buildah("push", *options, "--digestfile", str(digest_file), source,
                        f"docker://{repository}:{tag}", step=f"push {source} to {repository}",
                        timeout=1800)  # fmt: skip
        digest = digest_file.read_text().strip()
    if not digest.startswith("sha256:"):
        raise ImageBuildError(f"the registry gave {repository}:{tag} no sha256 digest: {digest!r}")
    return Pushed(source=source, repository=repository, tag=tag, digest=digest)


def publish(registry: str, *, cert_dir: Path | None = None, tls_verify: bool = True) -> Published:
    """Build (or find cached) pdserve's images and push them under ``registry`` (host[/path])."""
    registry = registry.rstrip("/")
    if not registry or "://" in registry or registry.count(":") > 1:
        raise ImageBuildError(
            f"REGISTRY={registry!r} is not a registry prefix: give host[:port][/path], e.g. "
            "registry.example.com/team (no scheme: the images go there as <prefix>/pdserve)"
        )
    images = build_images()
    builder = Builder(image_cache())
    _, pdserve_archive, sim_archive = images.archives
    return Published(
        pdserve=push(builder, images.pdserve, pdserve_archive, f"{registry}/pdserve",
                     cert_dir=cert_dir, tls_verify=tls_verify),
        sim=push(builder, images.sim, sim_archive, f"{registry}/pdserve-sim",
                 cert_dir=cert_dir, tls_verify=tls_verify),
    )  # fmt: skip


def instructions(published: Published) -> str:
    """What to run next, with the pushed references filled in."""
    values = " ".join(published.helm_values())
    sim = published.sim
    return "\n".join([
        f"pushed {published.pdserve.source} -> {published.pdserve.reference}",
        f"pushed {sim.source} -> {sim.reference}",
        "",
        "install the chart from them:",
        f"  helm install pdserve charts/pdserve -n pdserve-system --create-namespace {values}",
        "and the simulator example with its engines from the pushed image:",
        f"  sed 's|{sim.source}|{sim.reference}|' {SIM_EXAMPLE} | kubectl apply -f -",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make push-images", description=__doc__)
    parser.add_argument("registry", help="host[:port][/path] the images are pushed under")
    parser.add_argument("--cert-dir", type=Path, help="directory of CA certificates (*.crt)")
    parser.add_argument("--no-tls-verify", action="store_true",
                        help="push over plain HTTP or to an unverified certificate")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        published = publish(args.registry, cert_dir=args.cert_dir,
                            tls_verify=not args.no_tls_verify)  # fmt: skip
    except ImageBuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(instructions(published))
    return 0


if __name__ == "__main__":
    sys.exit(main())
