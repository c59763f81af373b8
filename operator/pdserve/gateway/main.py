"""`pdserve gateway`: serve the OpenAI API for one DisaggregatedModel."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

from kubernetes.config import ConfigException

from pdserve.contract.names import GATEWAY_DRAIN_SECONDS, GATEWAY_SHUTDOWN_SECONDS
from pdserve.contract.routing import ConfigError, load_config
from pdserve.gateway import server
from pdserve.gateway.app import Gateway
from pdserve.gateway.dataplane import build_binary
from pdserve.gateway.settings import GatewaySettings
from pdserve.gobuild import GoUnavailable
from pdserve.kube.client import Kube
from pdserve.kube.credentials import load_credentials
from pdserve.kube.exec_credentials import ExecCredentialError
from pdserve.logsetup import configure_logging
from pdserve.ports import listening_socket


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        required=True,
        help="routing.json written by the operator (or by hand, with endpoints)",
    )
    parser.add_argument(
        "--kubeconfig",
        help="for pod discovery outside a cluster; default: in-cluster, else KUBECONFIG",
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument(
        "--request-log",
        type=Path,
        help="append one JSON line per finished request (TTFT/ITL analysis)",
    )
    parser.add_argument("--log-format", choices=["plain", "json"], default="plain")
    parser.add_argument(
        "--no-derender-pipelining",
        dest="pipelining",
        action="store_false",
        help="one derender call per engine event (for comparison only)",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--drain-seconds",
        type=drain_seconds,
        default=GATEWAY_DRAIN_SECONDS,
        help="after SIGTERM, keep serving this long, each answer closing its connection so "
        "kept-alive clients move to another replica, before stopping (default %(default)s; "
        "0: none)",
    )
    parser.add_argument(
        "--max-inflight", type=int, default=256, help="requests in flight before 429 + Retry-After"
    )
    parser.add_argument(
        "--max-tokens-cap", type=int, help="largest max_tokens a client may ask for"
    )
    parser.add_argument(
        "--endpoint-wait-seconds",
        type=float,
        default=GatewaySettings.endpoint_wait_seconds,
        help="how long a request waits for a complete set of render/prefill/decode endpoints "
        "of one parity hash (a rollout or restart) before 503 (default %(default)s; 0: none)",
    )
    for flag, field, what in TIMEOUT_FLAGS:
        parser.add_argument(
            flag,
            dest=field,
            type=seconds,
            default=getattr(GatewaySettings, field),
            help=f"{what} (default %(default)s)",
        )
    parser.add_argument(
        "--data-plane",
        metavar="PATH|build",
        help="serve clients through the compiled data plane (pdserve/dataplane, Go) on --host "
        "and --port, this gateway behind it on loopback: PATH to its binary, or `build` to "
        "build it here with Go (cached); docs/gateway.md#the-compiled-data-plane",
    )
    parser.add_argument(
        "--api-key-file",
        type=Path,
        help="file with one API key per line (default: env PDSERVE_API_KEY)",
    )
    parser.add_argument(
        "--peer-key-file",
        type=Path,
        help="file with the key the gateway replicas call each other's admission endpoints "
        "with, one per line, the first one sent (default: env PDSERVE_PEER_KEY; none: the API key)",
    )


class KeyConfigError(ValueError):
    """A key flag or variable that is set but gives no usable key."""


def load_keys(path: Path | None, flag: str, variable: str) -> tuple[str, ...]:
    """The keys in `path` (one a line), else in the environment `variable`; none when neither is
    set. Set but empty or only whitespace is an error: serving everyone is never the fallback
    of a key that failed to arrive (an empty Secret, a file mounted wrong)."""
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise KeyConfigError(f"{flag} {path}: not UTF-8 text") from None
        except OSError as error:
            raise KeyConfigError(f"{flag} {path}: {error.strerror or error}") from None
        keys = tuple(line.strip() for line in text.splitlines() if line.strip())
        if not keys:
            raise KeyConfigError(
                f"{flag} {path} holds no key (empty or only whitespace): write one key per "
                f"line, or leave {flag} out to serve without one"
            )
        return keys
    value = os.environ.get(variable)
    if value is None:
        return ()
    if not value.strip():
        raise KeyConfigError(
            f"{variable} is set but empty (or only whitespace): set it to the key, or unset it "
            "to serve without one"
        )
    return (value.strip(),)


# Every wait of a request, bounded: docs/gateway.md#timeouts.
TIMEOUT_FLAGS = (
    ("--connect-timeout-seconds", "connect_timeout", "opening a connection to an engine"),
    (
        "--first-byte-timeout-seconds",
        "first_byte_timeout",
        "an upstream call's first response byte, a stream's first event (a prefill)",
    ),
    ("--idle-timeout-seconds", "idle_timeout", "between two events of an engine stream"),
    ("--body-timeout-seconds", "body_timeout", "receiving a client's request body (then 408)"),
    (
        "--keepalive-timeout-seconds",
        "keepalive_timeout",
        "a client connection idle, or its next request's head incomplete (then closed)",
    ),
    (
        "--request-timeout-seconds",
        "request_timeout",
        "a whole request (then 504, or an error event in a stream)",
    ),
)


def seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def drain_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive number of seconds, not {text}")
    return value


def api_keys(path: Path | None) -> tuple[str, ...]:
    return load_keys(path, "--api-key-file", "PDSERVE_API_KEY")


def peer_keys(path: Path | None) -> tuple[str, ...]:
    return load_keys(path, "--peer-key-file", "PDSERVE_PEER_KEY")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        config = load_config(args.config)
        settings = GatewaySettings(
            max_inflight=args.max_inflight,
            max_tokens_cap=args.max_tokens_cap,
            endpoint_wait_seconds=args.endpoint_wait_seconds,
            **{field: getattr(args, field) for _, field, _ in TIMEOUT_FLAGS},
            api_keys=api_keys(args.api_key_file),
            peer_keys=peer_keys(args.peer_key_file),
            derender_pipelining=args.pipelining,
            request_log=args.request_log,
        )
    except (ConfigError, KeyConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    gateway = Gateway(config, settings)
    if config.endpoints is None:
        try:
            credentials = load_credentials(args.kubeconfig)
        except (ConfigException, ExecCredentialError, OSError) as error:
            print(
                f"error: {args.config} has no `endpoints`, so the gateway discovers pods and "
                f"needs cluster credentials (in a pod: its service account; else --kubeconfig "
                f"or KUBECONFIG): {error}",
                file=sys.stderr,
            )
            return 2
        # POD_NAME (set by the operator): not its own peer in the shared prefill limit.
        gateway.discover_pods(Kube(credentials), own_pod=os.environ.get("POD_NAME"))
    host, port = args.host, args.port
    listener: socket.socket | None = None
    if args.data_plane is not None:
        try:
            binary = build_binary() if args.data_plane == "build" else Path(args.data_plane)
        except GoUnavailable as error:
            print(f"error: --data-plane build: {error}", file=sys.stderr)
            return 2
        if not binary.is_file():
            print(f"error: --data-plane {binary}: no such file (or pass `build`)", file=sys.stderr)
            return 2
        listener = behind_data_plane(gateway, binary, args.host, args.port)
        host, port = listener.getsockname()[:2]
    server.run(
        gateway.app(),
        host,
        port,
        shutdown_timeout=GATEWAY_SHUTDOWN_SECONDS,
        drain_seconds=args.drain_seconds,
        front=gateway.data_plane,
        sock=listener,
    )
    return 0


def behind_data_plane(gateway: Gateway, binary: Path, host: str, port: int) -> socket.socket:
    """Put the compiled data plane (`binary`) at host:port in front of `gateway`, which serves
    behind it on loopback, on the socket returned: listening before the data plane is told its
    address, so nothing can take the port in between."""
    listener = listening_socket()
    loopback, behind = listener.getsockname()[:2]
    gateway.use_data_plane(binary, f"{host}:{port}", f"http://{loopback}:{behind}")
    return listener
