"""The LeaderWorkerSet controller (sigs.k8s.io/lws v0.7.0) beside the local plane, as a cluster
with LWS installed runs it: its manager process, its CRD and its admission webhooks.

Built by ``bin-src/build.sh lws`` (make lws-build) into the plane's binary directory:
``lws-manager`` and the CRD its module ships, ``lws-crd.yaml``. The manager runs on the host
with the plane's admin kubeconfig (the plane's users are system:masters: no RBAC objects), its
webhook server on loopback with a certificate the plane's CA signs. The API server calls the
webhooks by URL, so no Service, endpoints or kube-proxy are involved; upstream's in-cluster
certificate rotator (which assumes a Service) is off. Without its pod webhook LWS does not work
at all (no group-index, no LWS_* env: docs/design/multinode.md, section 4).
"""

from __future__ import annotations

import base64
import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from devtools.localplane import (
    ADMIN_USER,
    Binaries,
    Components,
    ControlPlane,
    ControlPlaneError,
    free_port,
    issue_serving_cert,
    wait_until,
)
from devtools.resources import server_side_apply

# The API and the labels LWS's pod webhook writes (pkg/webhooks/pod_webhook.go; NAME_LABEL its
# controller), as the operator's builders name them: re-exported for the tests.
from pdserve.builders.leaderworkerset import API_VERSION as API_VERSION
from pdserve.builders.leaderworkerset import GROUP_INDEX_LABEL as GROUP_INDEX_LABEL
from pdserve.builders.leaderworkerset import GROUP_KEY_LABEL as GROUP_KEY_LABEL
from pdserve.builders.leaderworkerset import NAME_LABEL as NAME_LABEL
from pdserve.builders.leaderworkerset import WORKER_INDEX_LABEL as WORKER_INDEX_LABEL

CRD_NAME = "leaderworkersets.leaderworkerset.x-k8s.io"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
ADMISSION = "/apis/admissionregistration.k8s.io/v1"
FIELD_MANAGER = "pdserve-devtools-lws"
MUTATING = "lws-mutating-webhook-configuration"
VALIDATING = "lws-validating-webhook-configuration"


def lws_path(namespace: str, name: str = "") -> str:
    """The API path of a namespace's LeaderWorkerSets, or of one of them."""
    base = f"/apis/{API_VERSION}/namespaces/{namespace}/leaderworkersets"
    return f"{base}/{name}" if name else base


def install_lws_crd(plane: ControlPlane, binaries: Binaries, *, timeout: float = 60.0) -> None:
    """The LeaderWorkerSet CRD of the pinned version, applied and Established."""
    crd = yaml.safe_load(binaries.path("lws-crd.yaml").read_text())
    with plane.http() as http:
        response = server_side_apply(http, f"{CRDS}/{CRD_NAME}", crd, FIELD_MANAGER, force=True)
        if not response.is_success:
            raise ControlPlaneError(f"applying the LeaderWorkerSet CRD: {response.text}")

        def established() -> bool:
            found = http.get(f"{CRDS}/{CRD_NAME}").json()
            conditions = (found.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        wait_until("the LeaderWorkerSet CRD to be Established", established, timeout=timeout)


@dataclass
class LwsManager(Components):
    """The LWS controller manager with its webhook server on 127.0.0.1:``webhook_port``;
    config, certificates and logs under ``workdir``."""

    workdir: Path
    binaries: Binaries
    plane: ControlPlane
    webhook_port: int = field(default_factory=free_port)
    health_port: int = field(default_factory=free_port)
    pids: dict[str, int] = field(default_factory=dict)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    @property
    def webhook_url(self) -> str:
        return f"https://127.0.0.1:{self.webhook_port}"

    def start(self, *, timeout: float = 60.0) -> None:
        """The CRD Established, the manager healthy, then its webhooks registered."""
        for directory in (self.workdir, self.logs):
            directory.mkdir(parents=True, exist_ok=True)
        try:
            install_lws_crd(self.plane, self.binaries, timeout=timeout)
            config = self._write_config()
            args = [str(self.binaries.path("lws-manager")), f"--config={config}",
                    f"--kubeconfig={self.plane.kubeconfig(ADMIN_USER)}",
                    "--zap-devel=false"]  # fmt: skip
            self._spawn("lws-manager", args)
            # controller-runtime's healthz answers once the manager (webhook server included)
            # has started.
            url = f"http://127.0.0.1:{self.health_port}/healthz"
            self._wait_healthy("lws-manager", url, timeout)
            self._register_webhooks()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Unregister the webhooks first (a Fail-policy hook with no server would refuse every
        LWS and LWS pod the plane is asked for later), then stop the manager."""
        with self.plane.http() as http:
            for kind, name in (("mutating", MUTATING), ("validating", VALIDATING)):
                http.delete(f"{ADMISSION}/{kind}webhookconfigurations/{name}")
        self._stop_component("lws-manager")

    # ---- internals ---------------------------------------------------------------------------
    def _write_config(self) -> Path:
        certificate, key = issue_serving_cert(
            self.plane.pki, "lws-webhook", "lws-webhook", ["IP:127.0.0.1"]
        )
        cert_dir = self.workdir / "certs"
        cert_dir.mkdir(exist_ok=True)
        # controller-runtime's webhook server reads <certDir>/tls.crt and tls.key.
        shutil.copyfile(certificate, cert_dir / "tls.crt")
        shutil.copyfile(key, cert_dir / "tls.key")
        config = {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"host": "127.0.0.1", "port": self.webhook_port, "certDir": str(cert_dir)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
        }
        path = self.workdir / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def _hook(self, name: str, path: str, resource: str, operations: list[str]) -> dict[str, Any]:
        """One webhook as upstream's config/webhook/manifests.yaml declares it, called by URL."""
        group = "" if resource == "pods" else "leaderworkerset.x-k8s.io"
        hook: dict[str, Any] = {
            "name": name,
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "clientConfig": {
                "url": f"{self.webhook_url}{path}",
                "caBundle": base64.b64encode(self.plane.ca_file.read_bytes()).decode(),
            },
            "rules": [
                {
                    "apiGroups": [group],
                    "apiVersions": ["v1"],
                    "operations": operations,
                    "resources": [resource],
                }
            ],
        }
        if resource == "pods":
            # Upstream's mutating-patch.yaml: only LWS pods depend on the manager.
            hook["objectSelector"] = {
                "matchExpressions": [{"key": NAME_LABEL, "operator": "Exists"}]
            }
        return hook

    def _register_webhooks(self) -> None:
        lws_hook = "-leaderworkerset-x-k8s-io-v1-leaderworkerset"
        mutating: dict[str, Any] = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": MUTATING},
            "webhooks": [
                self._hook("mleaderworkerset.kb.io", f"/mutate{lws_hook}", "leaderworkersets",
                           ["CREATE", "UPDATE"]),
                self._hook("mpod.kb.io", "/mutate--v1-pod", "pods", ["CREATE"]),
            ],
        }  # fmt: skip
        validating: dict[str, Any] = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": VALIDATING},
            "webhooks": [
                self._hook("vleaderworkerset.kb.io", f"/validate{lws_hook}", "leaderworkersets",
                           ["CREATE", "UPDATE"]),
                self._hook("vpod.kb.io", "/validate--v1-pod", "pods", ["CREATE", "UPDATE"]),
            ],
        }  # fmt: skip
        with self.plane.http() as http:
            for kind, body in (("mutating", mutating), ("validating", validating)):
                path = f"{ADMISSION}/{kind}webhookconfigurations/{body['metadata']['name']}"
                response = server_side_apply(http, path, body, FIELD_MANAGER, force=True)
                if not response.is_success:
                    raise ControlPlaneError(f"registering the LWS {kind} webhooks: {response.text}")


@contextlib.contextmanager
def running_lws(plane: ControlPlane, workdir: Path, binaries: Binaries) -> Iterator[LwsManager]:
    """A started LWS manager with its CRD and webhooks; on exit the webhooks are unregistered
    and the manager stopped, even when the body fails. The CRD stays (and with it any
    LeaderWorkerSet left behind, which then nobody reconciles)."""
    manager = LwsManager(workdir=workdir, binaries=binaries, plane=plane)
    manager.start()
    try:
        yield manager
    finally:
        manager.stop()
