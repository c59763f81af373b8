"""The ``pdserve`` command line. Subcommands are added as the product grows (operator,
gateway, manifests, crd, sim, bench); each parses its own arguments and returns an exit code."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pdserve import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated prefill/decode/render vLLM serving on Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("version", help="print the pdserve version")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "version":
        print(__version__)
        return 0
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
