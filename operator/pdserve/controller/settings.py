"""Operator settings: flags win over environment variables, which win over these defaults."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdserve.api.images import DEFAULT_GATEWAY_IMAGE
from pdserve.builders.network import NetworkPolicyOptions, check_peer

NAMESPACE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
TRUE, FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class OperatorSettings:
    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty = the whole cluster."""
    resync_seconds: float = 60.0
    """How often every resource is reconciled even without events (drift repair)."""
    log_format: str = "plain"
    """plain or json."""
    log_level: str = "INFO"
    """DEBUG also logs every reconcile that found nothing to do."""
    kubeconfig: str | None = None
    """Kubeconfig path; default: in-cluster service account, else KUBECONFIG/~/.kube/config."""
    liveness_endpoint: str | None = None
    """e.g. http://0.0.0.0:8080/healthz"""
    retry_max_seconds: float = 60.0
    """Cap of the exponential backoff after a failed reconcile."""
    webhook: WebhookSettings | None = None
    """The validating admission webhook; None: not served."""
    network_policies: NetworkPolicyOptions | None = None
    """Give every model NetworkPolicies; None: none (and those made earlier are pruned)."""
    engine_metrics_seconds: float = 15.0
    """How often decode engines' NIXL metrics are scraped for TransportHealthy; 0: never."""
    autoscale_seconds: float = 15.0
    """How often the Builtin autoscaler scrapes pools and decides; 0: Builtin pools keep their
    replicas."""
    metrics_port: int | None = None
    """Serve the operator's Prometheus metrics (scaling decisions) on this port; None: not."""
    operator_namespace: str | None = None
    """The operator's own namespace, which keeps the gateways' peer master key (env
    PDSERVE_OPERATOR_NAMESPACE, else the in-cluster service account's); None: unknown, and
    models with API keys cannot be served, and the gateway replicas of others cannot share the
    long-prefill limit."""
    leader_election: LeaderElectionSettings | None = None
    """Reconcile only while holding the leader Lease (several replicas); None: always (one
    replica)."""
    gateway_image: str = DEFAULT_GATEWAY_IMAGE
    """The gateway image of every model whose spec.image.gateway names none: the operator's own
    (env PDSERVE_GATEWAY_IMAGE; the chart sets it to the operator's image), so an operator
    upgrade moves those gateways with it."""


@dataclass(frozen=True)
class LeaderElectionSettings:
    identity: str
    """This replica's holderIdentity: env POD_NAME (the chart sets it from the downward API),
    else the host name (a pod's host name is its name too)."""
    lease_seconds: float = 15.0
    """leaseDurationSeconds: how long a Lease not renewed keeps others from taking over."""


@dataclass(frozen=True)
class WebhookSettings:
    port: int
    """Port the HTTPS webhook server listens on."""
    cert_file: str
    key_file: str
    listen: str = "0.0.0.0"
    """Address to listen on."""
    host: str | None = None
    """Host name or IP the API server reaches the webhook by (needed with manage)."""
    ca_file: str | None = None
    """CA bundle the API server verifies the webhook with (default: the certificate itself)."""
    manage: bool = False
    """Create/patch the ValidatingWebhookConfiguration `validate.pdserve.io` at startup."""
    cert_secret: str | None = None
    """Keep the certificate in this Secret of the operator's namespace, made at start-up when
    missing, and write it to cert_file/key_file (controller/webhook_cert.py); None: the files
    exist (cert-manager, or a test's own)."""
    service_names: tuple[str, ...] = ()
    """DNS names the API server calls the webhook by (its Service's): the made certificate's."""
    configuration: str | None = None
    """The ValidatingWebhookConfiguration whose webhooks get the CA as caBundle."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n", "--namespace", dest="namespaces", action="append", metavar="NS",
        help="watch this namespace (repeatable; env PDSERVE_NAMESPACES=a,b). Default: all",
    )  # fmt: skip
    parser.add_argument(
        "--resync-seconds", type=float,
        help="reconcile every resource this often to repair drift (env PDSERVE_RESYNC_SECONDS, "
        "default 60)",
    )  # fmt: skip
    parser.add_argument(
        "--log-format", choices=["plain", "json"], help="env PDSERVE_LOG_FORMAT, default plain"
    )
    parser.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING"],
        help="env PDSERVE_LOG_LEVEL, default INFO",
    )
    parser.add_argument("--kubeconfig", help="default: in-cluster, else KUBECONFIG")
    parser.add_argument("--liveness", metavar="URL", help="e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument(
        "--engine-metrics-seconds", type=float,
        help="scrape decode engines' NIXL metrics this often for condition TransportHealthy; "
        "0 turns it off (env PDSERVE_ENGINE_METRICS_SECONDS, default 15)",
    )  # fmt: skip
    parser.add_argument(
        "--autoscale-seconds", type=float,
        help="scrape Builtin-autoscaled pools and decide their replicas this often; 0 turns the "
        "Builtin engine off (env PDSERVE_AUTOSCALE_SECONDS, default 15)",
    )  # fmt: skip
    parser.add_argument(
        "--metrics-port", type=int,
        help="serve the operator's Prometheus metrics (pdserve_operator_autoscale_*) on this "
        "port at /metrics (env PDSERVE_METRICS_PORT; default: not served)",
    )  # fmt: skip
    add_network_arguments(parser)
    election = parser.add_argument_group("leader election (several operator replicas)")
    election.add_argument(
        "--leader-election", action=argparse.BooleanOptionalAction, default=None,
        help="reconcile only while holding the Lease pdserve-operator-leader in the operator's "
        "namespace, so that several replicas can run (all serve the webhook); needs "
        "PDSERVE_OPERATOR_NAMESPACE. Identity: env POD_NAME, else the host name (env "
        "PDSERVE_LEADER_ELECTION=true|false, default false; the chart turns it on)",
    )  # fmt: skip
    election.add_argument(
        "--leader-election-lease-seconds", type=float,
        help="lease duration: a leader that stopped renewing is replaced after it (env "
        "PDSERVE_LEADER_ELECTION_LEASE_SECONDS, default 15)",
    )  # fmt: skip
    hook = parser.add_argument_group("validating admission webhook")
    hook.add_argument("--webhook-port", type=int, help="serve the webhook on this port (HTTPS)")
    hook.add_argument("--webhook-cert", help="TLS certificate file of the webhook server")
    hook.add_argument("--webhook-key", help="TLS private key file of the webhook server")
    hook.add_argument("--webhook-listen", default="0.0.0.0", help="listen address (0.0.0.0)")
    hook.add_argument("--webhook-host", help="host the API server reaches the webhook by")
    hook.add_argument("--webhook-ca", help="CA file for the webhook configuration's caBundle")
    hook.add_argument(
        "--webhook-cert-secret", metavar="NAME",
        help="keep the webhook's certificate in this Secret of the operator's namespace, made "
        "at start-up when missing, and write it to --webhook-cert-dir (the Helm chart's default)",
    )  # fmt: skip
    hook.add_argument(
        "--webhook-cert-dir", default="/tmp/pdserve-webhook",
        help="where --webhook-cert-secret's certificate is written (/tmp/pdserve-webhook)",
    )  # fmt: skip
    hook.add_argument(
        "--webhook-service-name", dest="webhook_service_names", action="append", metavar="DNS",
        help="a DNS name the API server calls the webhook by (repeatable): the certificate's",
    )  # fmt: skip
    hook.add_argument(
        "--webhook-configuration", metavar="NAME",
        help="ValidatingWebhookConfiguration whose webhooks get the certificate's CA as caBundle",
    )  # fmt: skip
    hook.add_argument(
        "--webhook-manage", action="store_true",
        help="create/patch ValidatingWebhookConfiguration validate.pdserve.io at startup "
        "(otherwise the Helm chart owns it)",
    )  # fmt: skip


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    """The NetworkPolicy flags (`pdserve operator` and `pdserve manifests`)."""
    parser.add_argument(
        "--gateway-image", metavar="IMAGE",
        help="the gateway image of models whose spec.image.gateway names none: the operator's "
        f"own (env PDSERVE_GATEWAY_IMAGE; default {DEFAULT_GATEWAY_IMAGE})",
    )  # fmt: skip
    net = parser.add_argument_group("NetworkPolicies per model")
    net.add_argument(
        "--network-policies", action=argparse.BooleanOptionalAction, default=None,
        help="give every model NetworkPolicies: only its gateway reaches its engines and render "
        "pods, only its prefill/decode pods reach each other's NIXL ports; --no-network-policies "
        "deletes those made earlier (env PDSERVE_NETWORK_POLICIES=true|false, default false)",
    )  # fmt: skip
    net.add_argument(
        "--network-policy-metrics-namespace", dest="metrics_namespaces", action="append",
        metavar="NS", help="pods in this namespace may scrape /metrics of every pool (repeatable; "
        "env PDSERVE_NETWORK_POLICY_METRICS_NAMESPACES=a,b)",
    )  # fmt: skip
    net.add_argument(
        "--network-policy-gateway-from", dest="gateway_from", metavar="JSON",
        help="JSON list of NetworkPolicyPeers allowed to reach the gateway (env "
        "PDSERVE_NETWORK_POLICY_GATEWAY_FROM); default: anyone",
    )  # fmt: skip


def seconds(flag_value: float | None, env: Mapping[str, str], flag: str, default: str) -> float:
    """A duration from --<flag>, else env PDSERVE_<FLAG>, else the default."""
    if flag_value is not None:
        return float(flag_value)
    name = "PDSERVE_" + flag.upper().replace("-", "_")
    text = env.get(name, default)
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None


SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def operator_namespace(
    env: Mapping[str, str], service_account: Path = SERVICE_ACCOUNT_NAMESPACE
) -> str | None:
    """Where the operator runs: the chart sets the variable from the downward API; the service
    account's file covers a Deployment made by hand."""
    name = env.get("PDSERVE_OPERATOR_NAMESPACE", "").strip()
    if not name and service_account.is_file():
        name = service_account.read_text().strip()
    if name and not NAMESPACE_NAME.match(name):
        raise ValueError(f"PDSERVE_OPERATOR_NAMESPACE={name!r} is not a namespace name")
    return name or None


def from_arguments(
    args: argparse.Namespace, env: Mapping[str, str] = os.environ
) -> OperatorSettings:
    """Settings from parsed flags and the environment; ValueError names the bad setting."""
    namespaces = args.namespaces or [n for n in env.get("PDSERVE_NAMESPACES", "").split(",") if n]
    resync = seconds(args.resync_seconds, env, "resync-seconds", "60")
    if resync <= 0:
        raise ValueError(f"--resync-seconds must be > 0, got {resync}")
    engine_metrics = seconds(args.engine_metrics_seconds, env, "engine-metrics-seconds", "15")
    if engine_metrics < 0:
        raise ValueError(f"--engine-metrics-seconds must be >= 0, got {engine_metrics}")
    autoscale = seconds(args.autoscale_seconds, env, "autoscale-seconds", "15")
    if autoscale < 0:
        raise ValueError(f"--autoscale-seconds must be >= 0, got {autoscale}")
    port_text = (
        args.metrics_port if args.metrics_port is not None else env.get("PDSERVE_METRICS_PORT")
    )
    metrics_port = None
    if port_text not in (None, ""):
        try:
            metrics_port = int(port_text)
        except ValueError:
            raise ValueError(f"PDSERVE_METRICS_PORT={port_text!r} is not a port") from None
        if not 1 <= metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 1-65535, got {metrics_port}")
    log_format = args.log_format or env.get("PDSERVE_LOG_FORMAT", "plain")
    if log_format not in ("plain", "json"):
        raise ValueError(f"PDSERVE_LOG_FORMAT must be plain or json, got {log_format!r}")
    log_level = (args.log_level or env.get("PDSERVE_LOG_LEVEL", "INFO")).upper()
    if log_level not in ("DEBUG", "INFO", "WARNING"):
        raise ValueError(f"PDSERVE_LOG_LEVEL must be DEBUG, INFO or WARNING, got {log_level!r}")
    webhook = None
    namespace = operator_namespace(env)
    if args.webhook_port is not None:
        cert, key = args.webhook_cert, args.webhook_key
        if args.webhook_cert_secret:
            if cert or key:
                raise ValueError("--webhook-cert-secret writes the certificate itself: drop "
                                 "--webhook-cert and --webhook-key")  # fmt: skip
            if not args.webhook_service_names:
                raise ValueError("--webhook-cert-secret needs --webhook-service-name: the DNS "
                                 "name the API server calls the webhook by")  # fmt: skip
            if namespace is None:
                raise ValueError("--webhook-cert-secret needs the operator's namespace: set "
                                 "PDSERVE_OPERATOR_NAMESPACE")  # fmt: skip
            cert = f"{args.webhook_cert_dir}/tls.crt"
            key = f"{args.webhook_cert_dir}/tls.key"
        elif not (cert and key):
            raise ValueError(
                "--webhook-port needs --webhook-cert and --webhook-key, or --webhook-cert-secret "
                "(TLS is required)"
            )
        if args.webhook_manage and not args.webhook_host:
            raise ValueError(
                "--webhook-manage needs --webhook-host: the address the API server uses"
            )
        webhook = WebhookSettings(
            port=args.webhook_port, cert_file=cert, key_file=key,
            listen=args.webhook_listen, host=args.webhook_host, ca_file=args.webhook_ca,
            manage=args.webhook_manage, cert_secret=args.webhook_cert_secret,
            service_names=tuple(args.webhook_service_names or ()),
            configuration=args.webhook_configuration,
        )  # fmt: skip
    return OperatorSettings(
        operator_namespace=namespace,
        leader_election=leader_election_settings(args, env, namespace),
        webhook=webhook,
        network_policies=network_settings(args, env, namespace),
        namespaces=tuple(sorted(set(namespaces))),
        resync_seconds=resync,
        engine_metrics_seconds=engine_metrics,
        autoscale_seconds=autoscale,
        metrics_port=metrics_port,
        log_format=log_format,
        log_level=log_level,
        kubeconfig=args.kubeconfig or env.get("PDSERVE_KUBECONFIG"),
        liveness_endpoint=args.liveness,
        gateway_image=args.gateway_image
        or env.get("PDSERVE_GATEWAY_IMAGE")
        or DEFAULT_GATEWAY_IMAGE,
    )


def switch(flag: bool | None, env: Mapping[str, str], variable: str) -> bool:
    """An on/off setting: its flag when given, else its environment variable (default off);
    ValueError names the variable."""
    if flag is not None:
        return flag
    text = env.get(variable, "false").strip().lower()
    if text not in TRUE + FALSE:
        raise ValueError(f"{variable} must be true or false, got {text!r}")
    return text in TRUE


def leader_election_settings(
    args: argparse.Namespace, env: Mapping[str, str], namespace: str | None
) -> LeaderElectionSettings | None:
    """--leader-election and its lease duration; ValueError names the flag or variable."""
    enabled = switch(args.leader_election, env, "PDSERVE_LEADER_ELECTION")
    lease = seconds(args.leader_election_lease_seconds, env,
                    "leader-election-lease-seconds", "15")  # fmt: skip
    if not enabled:
        return None
    if lease < 3:
        # Renewed every third of it: a shorter lease renews faster than API latency allows.
        raise ValueError(f"--leader-election-lease-seconds must be >= 3, got {lease}")
    if namespace is None:
        raise ValueError(
            "--leader-election needs the operator's namespace for its Lease: set "
            "PDSERVE_OPERATOR_NAMESPACE (the chart does)"
        )
    identity = env.get("POD_NAME", "").strip() or socket.gethostname()
    if not identity:
        raise ValueError("--leader-election needs an identity: set POD_NAME")
    return LeaderElectionSettings(identity=identity, lease_seconds=lease)


def network_settings(
    args: argparse.Namespace, env: Mapping[str, str], operator_namespace: str | None = None
) -> NetworkPolicyOptions | None:
    """--network-policies and its options; ValueError names the flag or variable. The
    operator's own namespace may always scrape /metrics: the operator reads the engines' NIXL
    metrics (TransportHealthy) and the Builtin autoscaler's signals there."""
    enabled = switch(args.network_policies, env, "PDSERVE_NETWORK_POLICIES")
    if not enabled:
        return None
    namespaces = args.metrics_namespaces or [
        n.strip()
        for n in env.get("PDSERVE_NETWORK_POLICY_METRICS_NAMESPACES", "").split(",")
        if n.strip()
    ]
    for namespace in namespaces:
        if not NAMESPACE_NAME.match(namespace):
            raise ValueError(
                f"--network-policy-metrics-namespace {namespace!r} is not a namespace name"
            )
    text = args.gateway_from or env.get("PDSERVE_NETWORK_POLICY_GATEWAY_FROM", "").strip() or "[]"
    try:
        peers = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--network-policy-gateway-from is not JSON: {error}") from None
    if not isinstance(peers, list):
        raise ValueError(f"--network-policy-gateway-from must be a JSON list, got {peers!r}")
    if operator_namespace is not None:
        namespaces = [*namespaces, operator_namespace]
    return NetworkPolicyOptions(
        metrics_namespaces=tuple(sorted(set(namespaces))),
        gateway_from=tuple(check_peer(i, peer) for i, peer in enumerate(peers)),
    )
