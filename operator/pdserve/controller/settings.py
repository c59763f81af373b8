"""Operator settings: flags win over environment variables, which win over these defaults."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass


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
    hook = parser.add_argument_group("validating admission webhook")
    hook.add_argument("--webhook-port", type=int, help="serve the webhook on this port (HTTPS)")
    hook.add_argument("--webhook-cert", help="TLS certificate file of the webhook server")
    hook.add_argument("--webhook-key", help="TLS private key file of the webhook server")
    hook.add_argument("--webhook-listen", default="0.0.0.0", help="listen address (0.0.0.0)")
    hook.add_argument("--webhook-host", help="host the API server reaches the webhook by")
    hook.add_argument("--webhook-ca", help="CA file for the webhook configuration's caBundle")
    hook.add_argument(
        "--webhook-manage", action="store_true",
        help="create/patch ValidatingWebhookConfiguration validate.pdserve.io at startup "
        "(otherwise the Helm chart owns it)",
    )  # fmt: skip


def from_arguments(
    args: argparse.Namespace, env: Mapping[str, str] = os.environ
) -> OperatorSettings:
    """Settings from parsed flags and the environment; ValueError names the bad setting."""
    namespaces = args.namespaces or [n for n in env.get("PDSERVE_NAMESPACES", "").split(",") if n]
    resync_text = (
        args.resync_seconds
        if args.resync_seconds is not None
        else env.get("PDSERVE_RESYNC_SECONDS", "60")
    )
    try:
        resync = float(resync_text)
    except ValueError:
        raise ValueError(
            f"PDSERVE_RESYNC_SECONDS={resync_text!r} is not a number of seconds"
        ) from None
    if resync <= 0:
        raise ValueError(f"--resync-seconds must be > 0, got {resync}")
    log_format = args.log_format or env.get("PDSERVE_LOG_FORMAT", "plain")
    if log_format not in ("plain", "json"):
        raise ValueError(f"PDSERVE_LOG_FORMAT must be plain or json, got {log_format!r}")
    log_level = (args.log_level or env.get("PDSERVE_LOG_LEVEL", "INFO")).upper()
    if log_level not in ("DEBUG", "INFO", "WARNING"):
        raise ValueError(f"PDSERVE_LOG_LEVEL must be DEBUG, INFO or WARNING, got {log_level!r}")
    webhook = None
    if args.webhook_port is not None:
        if not (args.webhook_cert and args.webhook_key):
            raise ValueError(
                "--webhook-port needs --webhook-cert and --webhook-key (TLS is required)"
            )
        if args.webhook_manage and not args.webhook_host:
            raise ValueError(
                "--webhook-manage needs --webhook-host: the address the API server uses"
            )
        webhook = WebhookSettings(
            port=args.webhook_port, cert_file=args.webhook_cert, key_file=args.webhook_key,
            listen=args.webhook_listen, host=args.webhook_host, ca_file=args.webhook_ca,
            manage=args.webhook_manage,
        )  # fmt: skip
    return OperatorSettings(
        webhook=webhook,
        namespaces=tuple(sorted(set(namespaces))),
        resync_seconds=resync,
        log_format=log_format,
        log_level=log_level,
        kubeconfig=args.kubeconfig or env.get("PDSERVE_KUBECONFIG"),
        liveness_endpoint=args.liveness,
    )
