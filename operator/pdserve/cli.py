"""The ``pdserve`` command line. Subcommands are added as the product grows (operator,
gateway, manifests, crd, sim, bench); each parses its own arguments and returns an exit code."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve import __version__
from pdserve.api import SpecError
from pdserve.api.crd import render_crd, write_crds
from pdserve.controller.settings import add_arguments as add_operator_arguments
from pdserve.controller.settings import add_network_arguments, network_settings
from pdserve.controller.settings import from_arguments as operator_settings
from pdserve.gateway.main import add_arguments as add_gateway_arguments
from pdserve.manifests import load_resources, render_manifests


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
        help="write crds/ and the chart's templates/crds.yaml under REPO_ROOT instead of printing",
    )
    manifests = sub.add_parser(
        "manifests", help="print every child object of DisaggregatedModel files as YAML"
    )
    manifests.add_argument(
        "-f", "--filename", dest="files", metavar="FILE", type=Path, action="append",
        required=True, help="a YAML file with one or more DisaggregatedModels (repeatable)",
    )  # fmt: skip
    manifests.add_argument(
        "-n", "--namespace", help="namespace for resources (default: theirs, else 'default')"
    )
    add_network_arguments(manifests)
    sub.add_parser("sim", help="run a simulated vLLM server: pdserve sim {render,engine,vllm} ...")
    sub.add_parser(
        "bench",
        help="measure TTFT, ITL, goodput and fairness: pdserve bench {run,scenario,overhead} ...",
    )
    gateway = sub.add_parser("gateway", help="serve the OpenAI API over the model's pools")
    add_gateway_arguments(gateway)
    operator = sub.add_parser("operator", help="run the operator (kopf) against the cluster")
    add_operator_arguments(operator)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:  # the simulators parse vLLM's own command lines
        from pdserve.sim.cli import main as sim_main

        return sim_main(argv[1:])
    if argv[:1] == ["bench"]:  # its own subcommands and flags
        from pdserve.bench.cli import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "version":
        print(__version__)
        return 0
    if args.command == "operator":
        try:
            settings = operator_settings(args)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        from pdserve.controller.main import main as run_operator

        return run_operator(settings)
    if args.command == "gateway":
        from pdserve.gateway.main import run as run_gateway

        return run_gateway(args)
    if args.command == "crd":
        if args.write is None:
            sys.stdout.write(render_crd())
        else:
            for path in write_crds(args.write):
                print(f"wrote {path}")
        return 0
    if args.command == "manifests":
        try:
            network = network_settings(args, {})
            resources = [dm for f in args.files for dm in load_resources(f, args.namespace)]
        except SpecError as error:
            for problem in error.problems:
                print(f"error: {problem}", file=sys.stderr)
            return 2
        except ValueError as error:  # a NetworkPolicy flag
            print(f"error: {error}", file=sys.stderr)
            return 2
        if not resources:
            print("error: no DisaggregatedModel found in the given files", file=sys.stderr)
            return 2
        sys.stdout.write(render_manifests(resources, network=network))
        return 0
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
