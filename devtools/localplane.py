"""A real, local Kubernetes control plane for tests and demos, with no Docker engine.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler of one Kubernetes release are
built from the Go module proxy by ``bin-src/build.sh``; kwok simulates nodes and drives pods to
Running/Ready, so the real controllers create pods and the real scheduler binds them.

Everything listens on free loopback ports and lives in one work directory: certificates, the
etcd data, logs, the audit log and one kubeconfig per user. ``python -m devtools.localplane
up`` keeps a plane running for interactive use; ``down`` stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import yaml

from devtools import credentials, planecommands
from devtools.procs import raise_if_exited, spawn_component, terminate
from pdserve.ports import free_port as free_port  # re-exported: the tests start processes with it

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "bin-src" / "build.sh"

ADMIN_USER = "admin"
OPERATOR_USER = "pdserve-operator"


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started or reached."""


class ComponentExited(ControlPlaneError):
    """A component process died: waiting longer cannot help."""


@dataclass(frozen=True)
class Binaries:
    directory: Path

    def path(self, name: str) -> Path:
        return self.directory / name


def build_binaries(*, quiet: bool = False, lws: bool = False) -> Binaries:
    """Build (or find cached) control-plane binaries; progress goes to stderr. With ``lws``
    only the LeaderWorkerSet manager and its CRD (``lws-manager``, ``lws-crd.yaml``: make
    lws-build), into the same directory."""
    if override := os.environ.get("PDSERVE_K8S_BIN_DIR"):
        return Binaries(Path(override))
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT), *(["lws"] if lws else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else None,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise ControlPlaneError(
            f"building the control plane failed (exit {proc.returncode}); rerun "
            f"`bash {BUILD_SCRIPT}` to see the Go error"
        )
    return Binaries(Path(proc.stdout.strip().splitlines()[-1]))


AUDIT_EVENT_START = b'{"kind":"Event"'


def audit_log_events(log: bytes) -> list[dict[str, Any]]:
    """The events of an audit log the API server is appending to: its last line is skipped
    while unterminated (a write in progress), and a line holding a cut event followed by a
    whole one yields the whole one (seen once in the log of a CI run under load)."""
    events = []
    for line in log.split(b"\n")[:-1]:
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
            continue
        except ValueError:
            pass
        for fragment in line.split(AUDIT_EVENT_START)[1:]:
            try:
                events.append(json.loads(AUDIT_EVENT_START + fragment))
            except ValueError:
                continue
    return events


def wait_until(
    what: str, probe: Callable[[], bool], *, timeout: float, interval: float = 0.2
) -> None:
    """Poll ``probe`` until it returns True; raise with ``what`` named when the deadline passes."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if probe():
                return
        except ComponentExited:
            raise
        except Exception as exc:  # a probe failing is the normal "not yet"
            last_error = exc
        time.sleep(interval)
    detail = f" (last error: {last_error})" if last_error else ""
    raise ControlPlaneError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")


class Components:
    """What the plane and the real node (realnode.py) share: processes of their own, each logging
    to <workdir>/logs/<name>.log, waited for while they start and stopped by process group.

    The dataclasses that use it declare ``workdir``, ``pids`` and ``_procs`` as their fields.
    """

    workdir: Path
    # Every component's process id, also saved for a `down` from another process.
    pids: dict[str, int]
    _procs: dict[str, subprocess.Popen[bytes]]
    # What check_alive raises: the node's own subclass, so its errors name the node.
    _exited: ClassVar[type[ComponentExited]] = ComponentExited

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    def check_alive(self) -> None:
        """Raise naming the component (and its log) if any process has exited."""
        raise_if_exited(self._procs, self.logs, self._exited)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        proc = spawn_component(name, args, logs=self.logs, cwd=self.workdir, env=env)
        self._procs[name] = proc
        self.pids[name] = proc.pid

    def _wait_healthy(self, name: str, url: str, timeout: float, **client: Any) -> None:
        """Until ``url`` answers 200; at once if a component died meanwhile."""

        def probe() -> bool:
            self.check_alive()
            response = httpx.get(url, timeout=2.0, **client)
            return response.status_code == 200

        wait_until(f"{name} at {url}", probe, timeout=timeout)

    def _stop_component(self, name: str) -> None:
        if (pid := self.pids.pop(name, None)) is not None:
            terminate(pid, self._procs.pop(name, None))


@dataclass
class Ports:
    etcd_client: int = field(default_factory=free_port)
    etcd_peer: int = field(default_factory=free_port)
    apiserver: int = field(default_factory=free_port)
    controller_manager: int = field(default_factory=free_port)
    scheduler: int = field(default_factory=free_port)
    kwok: int = field(default_factory=free_port)


@dataclass
class ControlPlane(Components):
    """One local control plane rooted at ``workdir``."""

    workdir: Path
    binaries: Binaries
    ports: Ports = field(default_factory=Ports)
    users: Sequence[str] = (ADMIN_USER, OPERATOR_USER)
    # Where the API server listens and what it advertises as the `kubernetes` Service's
    # endpoint. Loopback serves clients on this machine only; a real node's pods need an
    # address of its bridge (see realnode.py), where the API server then also reaches webhooks
    # and aggregated APIs through endpoints rather than Service names.
    address: str = "127.0.0.1"
    tokens: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    # ---- paths -------------------------------------------------------------------------------
    @property
    def server(self) -> str:
        return f"https://{self.address}:{self.ports.apiserver}"

    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    @property
    def ca_file(self) -> Path:
        return self.pki / "ca.crt"

    @property
    def audit_log(self) -> Path:
        return self.logs / "audit.log"

    def kubeconfig(self, user: str = ADMIN_USER) -> Path:
        return self.workdir / f"kubeconfig-{user}"

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self, *, timeout: float = 120.0) -> None:
        """Start every component and wait (with a deadline) until each is serving."""
        for directory in (self.workdir, self.pki, self.logs):
            directory.mkdir(parents=True, exist_ok=True)
        try:
            self._write_credentials()
            self._start_etcd(timeout)
            self._start_apiserver(timeout)
            for user in self.users:
                credentials.write_kubeconfig(
                    self.kubeconfig(user), server=self.server, ca_file=self.ca_file, user=user,
                    token=self.tokens[user],
                )  # fmt: skip
            self._start_controller_manager(timeout)
            self._start_scheduler(timeout)
            self._start_kwok(timeout)
            self._start_pod_finisher(timeout)
        except BaseException:
            self.stop()
            raise
        self._save_state()

    def stop(self) -> None:
        """Stop every component, newest first; never raises for an already-gone process."""
        for name in reversed(list(self.pids)):
            self._stop_component(name)
        self._procs.clear()
        with contextlib.suppress(FileNotFoundError):
            (self.workdir / "state.json").unlink()

    # ---- clients -----------------------------------------------------------------------------
    def http(self, user: str = ADMIN_USER) -> httpx.Client:
        """A plain HTTP client authenticated as ``user``, for raw API calls and probes."""
        return httpx.Client(
            base_url=self.server,
            headers={"Authorization": f"Bearer {self.tokens[user]}"},
            verify=ssl.create_default_context(cafile=self.ca_file),
            timeout=10.0,
        )

    def audit_events(
        self, *, user: str | None = None, writes_only: bool = True
    ) -> list[dict[str, Any]]:
        """Write requests seen by the API server so far (optionally by one user); with
        `writes_only=False` also the operator user's reads (get, list, watch)."""
        if not self.audit_log.exists():
            return []
        events = []
        for event in audit_log_events(self.audit_log.read_bytes()):
            if writes_only and event.get("verb") not in planecommands.WRITE_VERBS:
                continue
            if user is None or event.get("user", {}).get("username") == user:
                events.append(event)
        return events

    # ---- internals ---------------------------------------------------------------------------
    def _write_credentials(self) -> None:
        if not (self.pki / "apiserver.crt").exists():
            _write_pki(self.pki, extra_sans=(f"IP:{self.address}",))
        for user in self.users:
            self.tokens.setdefault(user, secrets.token_hex(16))
        credentials.write_token_file(self.pki / "tokens.csv", self.tokens)
        policy = planecommands.audit_policy([OPERATOR_USER])
        (self.workdir / "audit-policy.yaml").write_text(yaml.safe_dump(policy))

    def _start_etcd(self, timeout: float) -> None:
        client = f"http://127.0.0.1:{self.ports.etcd_client}"
        peer = f"http://127.0.0.1:{self.ports.etcd_peer}"
        data_dir = self.workdir / "etcd-data"
        args = planecommands.etcd(
            self.binaries.path("etcd"), data_dir=data_dir, client_url=client, peer_url=peer
        )
        self._spawn("etcd", args)
        self._wait_healthy("etcd", f"{client}/health", timeout)

    def _start_apiserver(self, timeout: float) -> None:
        self._spawn(
            "kube-apiserver",
            planecommands.kube_apiserver(
                self.binaries.path("kube-apiserver"), etcd_port=self.ports.etcd_client,
                address=self.address, port=self.ports.apiserver, pki=self.pki,
                ca_file=self.ca_file, audit_policy=self.workdir / "audit-policy.yaml",
                audit_log=self.audit_log,
            ),
        )  # fmt: skip

        def ready() -> bool:
            self.check_alive()
            with self.http() as http:
                return http.get("/readyz").status_code == 200

        wait_until(f"kube-apiserver at {self.server}/readyz", ready, timeout=timeout)

    def _start_controller_manager(self, timeout: float) -> None:
        port = self.ports.controller_manager
        self._spawn(
            "kube-controller-manager",
            planecommands.kube_controller_manager(
                self.binaries.path("kube-controller-manager"),
                kubeconfig=self.kubeconfig(ADMIN_USER), port=port, pki=self.pki,
                ca_file=self.ca_file,
            ),
        )  # fmt: skip
        url = f"https://127.0.0.1:{port}/healthz"
        self._wait_healthy("kube-controller-manager", url, timeout, verify=False)

        # Healthy is not working: pods in a namespace need its default ServiceAccount, which the
        # controller-manager's serviceaccount controller creates.
        def default_service_account() -> bool:
            self.check_alive()
            with self.http() as http:
                return http.get("/api/v1/namespaces/default/serviceaccounts/default").is_success

        wait_until("the default ServiceAccount", default_service_account, timeout=timeout)

    def _start_scheduler(self, timeout: float) -> None:
        port = self.ports.scheduler
        binary, kubeconfig = self.binaries.path("kube-scheduler"), self.kubeconfig(ADMIN_USER)
        self._spawn(
            "kube-scheduler", planecommands.kube_scheduler(binary, kubeconfig=kubeconfig, port=port)
        )
        url = f"https://127.0.0.1:{port}/healthz"
        self._wait_healthy("kube-scheduler", url, timeout, verify=False)

    def _start_kwok(self, timeout: float) -> None:
        port = self.ports.kwok
        binary, kubeconfig = self.binaries.path("kwok"), self.kubeconfig(ADMIN_USER)
        self._spawn("kwok", planecommands.kwok(binary, kubeconfig=kubeconfig, port=port))
        self._wait_healthy("kwok", f"http://127.0.0.1:{port}/healthz", timeout)

    def _start_pod_finisher(self, timeout: float) -> None:
        ready = self.workdir / "pod-finisher.ready"
        ready.unlink(missing_ok=True)
        command = planecommands.pod_finisher(
            sys.executable, kubeconfig=self.kubeconfig(ADMIN_USER), ready_file=ready
        )
        # It runs in the plane's workdir like every component; devtools comes from this checkout.
        self._spawn("pod-finisher", command, env={"PYTHONPATH": str(HERE.parent)})

        def watching() -> bool:
            self.check_alive()
            return ready.exists()

        wait_until("the pod finisher watching", watching, timeout=timeout)

    def _save_state(self) -> None:
        state = {
            "server": self.server,
            "pids": self.pids,
            "ports": self.ports.__dict__,
            "tokens": self.tokens,
            "kubeconfig": str(self.kubeconfig(ADMIN_USER)),
        }
        (self.workdir / "state.json").write_text(json.dumps(state, indent=2))


# ---- certificates ---------------------------------------------------------------------------
# Here rather than in a module of their own: issue_serving_cert is this plane's API (tests sign
# webhook certificates with the plane's CA), and both raise the plane's error.

# Every name the API server is reached by: loopback for us, the service names for pods.
APISERVER_SANS = (
    "IP:127.0.0.1", "IP:10.96.0.1", "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local",
)  # fmt: skip


def _write_pki(pki: Path, extra_sans: Sequence[str] = ()) -> None:
    """A CA, an API server serving cert signed by it, and the service-account key pair."""
    # fmt: off
    _run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
          "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"),
          "-subj", "/CN=pdserve-local-ca",
          "-addext", "basicConstraints=critical,CA:TRUE",
          "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
    # fmt: on
    sans = [*APISERVER_SANS, *(san for san in extra_sans if san not in APISERVER_SANS)]
    issue_serving_cert(pki, "apiserver", "kube-apiserver", sans)
    _run(["openssl", "genrsa", "-out", str(pki / "sa.key"), "2048"])
    _run(["openssl", "rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub")])


def issue_serving_cert(
    pki: Path, name: str, common_name: str, sans: Sequence[str]
) -> tuple[Path, Path]:
    """<name>.crt/<name>.key for a TLS server, signed by the plane's CA in `pki`."""
    key, csr, crt = pki / f"{name}.key", pki / f"{name}.csr", pki / f"{name}.crt"
    extensions = pki / f"{name}.ext"
    extensions.write_text(
        f"subjectAltName={','.join(sans)}\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    )
    # fmt: off
    _run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
          "-subj", f"/CN={common_name}"])
    _run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"),
          "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "3650",
          "-extfile", str(extensions), "-out", str(crt)])
    # fmt: on
    return crt, key


def _run(args: list[str]) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ControlPlaneError(f"{' '.join(args)} failed: {proc.stderr.strip()}")


@contextlib.contextmanager
def running_control_plane(
    workdir: Path, *, timeout: float = 120.0, address: str = "127.0.0.1",
    users: Sequence[str] = (ADMIN_USER, OPERATOR_USER),
) -> Iterator[ControlPlane]:  # fmt: skip
    """Build if needed, start, yield, and always stop the plane."""
    plane = ControlPlane(workdir=workdir, binaries=build_binaries(), address=address, users=users)
    plane.start(timeout=timeout)
    try:
        yield plane
    finally:
        plane.stop()


if __name__ == "__main__":
    # The command line is planecli.py's; it imports this module, so only run as a script can
    # this module import it without a cycle.
    from devtools.planecli import main

    sys.exit(main())
