"""A real OCI registry on this machine: the CNCF distribution registry (built from the Go module
proxy with the control plane, ``bin-src/build.sh``), serving TLS with a certificate the local
plane's CA signs, as a team's private registry does with its own CA.

The end-to-end tests push pdserve's images there (devtools/publish.py, what `make push-images`
runs for users) and the real node's containerd pulls them, trusting that CA through a
hosts.toml (RealNode.trust_registry), as /etc/containerd/certs.d does on a real node.
"""

from __future__ import annotations

import contextlib
import re
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from devtools.localplane import Binaries, Components, ControlPlane, free_port, issue_serving_cert


@dataclass
class Registry(Components):
    """One registry listening on ``address``, its storage and logs under ``workdir``."""

    workdir: Path
    binaries: Binaries
    plane: ControlPlane  # whose CA signs the serving certificate
    address: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    pids: dict[str, int] = field(default_factory=dict)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    @property
    def host(self) -> str:
        """host:port, as image references and containerd's hosts directory name it."""
        return f"{self.address}:{self.port}"

    @property
    def ca_file(self) -> Path:
        return self.plane.ca_file

    def client_cert_dir(self) -> Path:
        """A directory holding the CA as ``ca.crt``: what buildah's --cert-dir (and
        /etc/containers/certs.d/<host>/) expects of a client that pushes here."""
        directory = self.workdir / "client-certs"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "ca.crt").write_bytes(self.ca_file.read_bytes())
        return directory

    def start(self, *, timeout: float = 60.0) -> None:
        for directory in (self.workdir, self.logs):
            directory.mkdir(parents=True, exist_ok=True)
        certificate, key = issue_serving_cert(
            self.plane.pki, "registry", "pdserve-registry", [f"IP:{self.address}"]
        )
        config = {
            "version": 0.1,
            "log": {"level": "info", "accesslog": {"disabled": False}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.workdir / "storage")},
                "delete": {"enabled": True},
            },
            "http": {
                "addr": self.host,
                "tls": {"certificate": str(certificate), "key": str(key)},
            },
        }
        path = self.workdir / "config.yml"
        path.write_text(yaml.safe_dump(config))
        try:
            self._spawn("registry", [str(self.binaries.path("registry")), "serve", str(path)])
            # The distribution API's base endpoint answers 200 once the registry serves.
            trust = ssl.create_default_context(cafile=self.ca_file)
            self._wait_healthy("registry", f"https://{self.host}/v2/", timeout, verify=trust)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self._stop_component("registry")

    def pulled_by_containerd(self) -> set[str]:
        """The repositories whose manifests a containerd fetched, from the access log."""
        log = (self.logs / "registry.log").read_text(errors="replace")
        return set(_CONTAINERD_MANIFEST_GET.findall(log))


# The access log's combined format: "GET /v2/<name>/manifests/<ref> HTTP/1.1" 200 ... "<agent>"
_CONTAINERD_MANIFEST_GET = re.compile(
    r'"GET /v2/(\S+?)/manifests/\S+ HTTP/[\d.]+" 200 \d+ "[^"]*" "containerd/'
)


@contextlib.contextmanager
def running_registry(workdir: Path, binaries: Binaries, plane: ControlPlane) -> Iterator[Registry]:
    """A started registry, stopped even when the body fails."""
    registry = Registry(workdir=workdir, binaries=binaries, plane=plane)
    registry.start()
    try:
        yield registry
    finally:
        registry.stop()
