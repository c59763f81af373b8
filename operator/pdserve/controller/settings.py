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
    return OperatorSettings(
        namespaces=tuple(sorted(set(namespaces))),
        resync_seconds=resync,
        log_format=log_format,
        log_level=log_level,
        kubeconfig=args.kubeconfig or env.get("PDSERVE_KUBECONFIG"),
        liveness_endpoint=args.liveness,
    )
