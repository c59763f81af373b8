"""The ``pdserve`` command line. Subcommands are added as the product grows (operator,
gateway, manifests, crd, sim, bench); each parses its own arguments and returns an exit code."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve import __version__
from pdserve.api.crd import render_crd, write_crds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated prefill/decode/render vLLM serving on Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("version", help="print the pdserve version")
    crd = sub.add_parser(
        "crd", help="print the DisaggregatedModel CRD generated from the API models"
    )
    crd.add_argument(
        "--write",
        metavar="REPO_ROOT",
        type=Path,
        help="write crds/ and charts/pdserve/crds/ under REPO_ROOT instead of printing",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "version":
        print(__version__)
        return 0
    if args.command == "crd":
        if args.write is None:
            sys.stdout.write(render_crd())
        else:
            for path in write_crds(args.write):
                print(f"wrote {path}")
        return 0
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
