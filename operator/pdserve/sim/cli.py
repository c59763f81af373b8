"""`pdserve sim render|engine|vllm ...`: run a simulated vLLM server.

The simulators take vLLM's own flags, so the exact command lines pdserve's operator builds work
unchanged: `pdserve sim vllm serve MODEL --enable-scale-out --kv-transfer-config ...` and
`pdserve sim vllm launch render MODEL ...` (the simulator image installs this as `vllm`).
vLLM flags the simulator has no use for are accepted and listed on startup."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.sim.chat import BUILTIN_TEMPLATES, ChatError
from pdserve.sim.data_parallel import DataParallelFlags, local_ranks
from pdserve.sim.engine_config import EngineConfig, TransferConfig
from pdserve.sim.engine_core import SchedulerConfig
from pdserve.sim.engine_server import EngineServer
from pdserve.sim.generation import ModelBehaviour
from pdserve.sim.http import run
from pdserve.sim.lora import adapters_of, add_lora_flags, any_model_name
from pdserve.sim.render_server import RenderConfig, RenderServer

log = logging.getLogger("pdserve.sim")
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
ENGINE_APIS = {"--tokens-only": "tokens", "--enable-scale-out": "scale_out", "": "openai"}
"""vLLM's flag -> the simulated engine's API (EngineConfig.api)."""


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="sim-model", help="model name, as for vLLM")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument(
        "--chat-template",
        help=f"a Jinja file, or a built-in name ({', '.join(BUILTIN_TEMPLATES)}); default qwen3",
    )
    parser.add_argument("--default-chat-template-kwargs", type=_json_object, default={})
    parser.add_argument("--reasoning-parser")
    parser.add_argument("--tool-call-parser")
    parser.add_argument("--enable-auto-tool-choice", action="store_true")


def render_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve sim render", add_help=True)
    _common(parser)
    parser.add_argument("--renderer-num-workers", type=int, default=1)
    return parser


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve sim engine", add_help=True)
    _common(parser)
    parser.add_argument(
        "--tokens-only", action="store_true", help="the generate API only, no tokenizer"
    )
    parser.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="the generate API besides the OpenAI routes, with a tokenizer",
    )
    parser.add_argument("--kv-transfer-config", type=_json_object)
    add_lora_flags(parser)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    _data_parallel(parser)
    sim = parser.add_argument_group("simulator (not vLLM flags)")
    sim.add_argument(
        "--role",
        choices=["prefill", "decode", "both"],
        help="KV role; default: from --kv-transfer-config kv_role, else both",
    )
    sim.add_argument(
        "--api",
        choices=list(ENGINE_APIS.values()),
        help="tokens (= --tokens-only), scale_out (= --enable-scale-out) or openai (plain "
        "vllm serve); default: from those flags, openai without either",
    )
    # Env defaults let a pod running the operator's exact vLLM command line be tuned.
    sim.add_argument(
        "--sim-time-scale",
        type=float,
        default=float(os.environ.get("PDSERVE_SIM_TIME_SCALE", "1.0")),
        help="real seconds per simulated second (0.1 = ten times faster); env "
        "PDSERVE_SIM_TIME_SCALE",
    )
    sim.add_argument(
        "--sim-reasoning",
        action="store_true",
        default=os.environ.get("PDSERVE_SIM_REASONING") == "1",
        help="think in <think> first; env PDSERVE_SIM_REASONING=1",
    )
    sim.add_argument("--sim-step-base-ms", type=float, default=20.0)
    sim.add_argument("--sim-per-prefill-token-ms", type=float, default=0.07)
    sim.add_argument(
        "--sim-faults",
        type=_json_object,
        default=None,
        help='faults from the start, as POST /sim/faults takes them, e.g. {"http_5xx": 2}',
    )
    sim.add_argument("--sim-per-decode-seq-ms", type=float, default=0.1)
    sim.add_argument("--sim-per-decode-context-token-us", type=float, default=0.05)
    sim.add_argument("--sim-num-gpu-blocks", type=int, default=20000)
    sim.add_argument("--sim-kv-bytes-per-token", type=int, default=56 * 1024)
    sim.add_argument("--sim-kv-bandwidth-gb-s", type=float, default=0.4)
    sim.add_argument("--sim-kv-overhead-ms", type=float, default=100.0)
    return parser


def _data_parallel(parser: argparse.ArgumentParser) -> None:
    """vLLM's data-parallel flags (vllm/engine/arg_utils.py L1138-1256): the server runs its
    node's ranks (data_parallel.local_ranks). The parallel sizes within a rank only enter that
    arithmetic; the address and RPC port are accepted and unused (one process, no peers)."""
    group = parser.add_argument_group("data parallelism (vLLM's flags)")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    group.add_argument("--data-parallel-size-local", "-dpl", type=int)
    group.add_argument("--data-parallel-start-rank", "-dpr", type=int)
    group.add_argument("--data-parallel-hybrid-lb", "-dph", action="store_true")
    group.add_argument("--data-parallel-address", "-dpa")
    group.add_argument("--data-parallel-rpc-port", "-dpp", type=int)
    group.add_argument("--nnodes", "-n", type=int, default=1)
    group.add_argument("--node-rank", "-r", type=int, default=0)
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    group.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1)


USAGE = """usage: pdserve sim {render,engine,vllm} ...

  render MODEL [flags]          simulated `vllm launch render` (render/derender)
  engine MODEL [flags]          simulated `vllm serve` (generate, KV handoff, faults, metrics)
  vllm serve|launch render ...  the same, from a vLLM command line (the sim image's `vllm`)
  experiment article            the seed article's DP=2 vs 1P1D experiment on simulated engines

`pdserve sim render --help` and `pdserve sim engine --help` list the flags."""


def _template(name: str | None) -> str:
    if not name:
        return BUILTIN_TEMPLATES["qwen3"]
    return BUILTIN_TEMPLATES.get(name) or Path(name).read_text()


def _render_config(
    args: argparse.Namespace, adapters: Mapping[str, str] | None = None
) -> RenderConfig:
    """`vllm launch render`'s (no adapters: it ignores the LoRA flags), or a `vllm serve`
    engine's own for its OpenAI routes, with the engine's LoRA `adapters`."""
    return RenderConfig(
        adapters=dict(adapters or {}),
        any_model=any_model_name(),
        model=args.model,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        chat_template=_template(args.chat_template),
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
    )


def _api_of_flags(args: argparse.Namespace) -> str:
    # --tokens-only registers the scale-out API too: with both, no tokenizer still wins.
    if args.tokens_only:
        return ENGINE_APIS["--tokens-only"]
    return ENGINE_APIS["--enable-scale-out" if args.enable_scale_out else ""]


def _data_parallel_flags(args: argparse.Namespace) -> DataParallelFlags:
    return DataParallelFlags(
        size=args.data_parallel_size,
        size_local=args.data_parallel_size_local,
        start_rank=args.data_parallel_start_rank,
        hybrid_lb=args.data_parallel_hybrid_lb,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        world_size_within_dp=args.tensor_parallel_size
        * args.pipeline_parallel_size
        * args.prefill_context_parallel_size,
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The simulated engine's configuration; ValueError where vLLM refuses the flags."""
    kv = args.kv_transfer_config or {}
    role = args.role or ROLES.get(kv.get("kv_role", "kv_both"))
    if role is None:
        raise ValueError(
            f"--kv-transfer-config: kv_role {kv.get('kv_role')!r} is not one of {', '.join(ROLES)}"
        )
    extra = kv.get("kv_connector_extra_config") or {}
    ranks = local_ranks(_data_parallel_flags(args))
    render = _render_config(args, adapters_of(args))
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        adapters=render.adapters,
        role=role,
        api=args.api or _api_of_flags(args),
        max_model_len=args.max_model_len,
        advertise_host=os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1"),
        port=args.port,
        # vLLM's KVTransferConfig.engine_id: the configured one, else a fresh uuid4.
        engine_id=str(kv.get("engine_id") or uuid.uuid4().hex),
        data_parallel_size=args.data_parallel_size,
        data_parallel_size_local=ranks.size_local,
        data_parallel_start_rank=ranks.start_rank,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_chunked_prefill=args.enable_chunked_prefill,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            block_size=args.block_size,
            num_gpu_blocks=args.sim_num_gpu_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
            step_base_ms=args.sim_step_base_ms,
            per_prefill_token_ms=args.sim_per_prefill_token_ms,
            per_decode_seq_ms=args.sim_per_decode_seq_ms,
            per_decode_context_token_us=args.sim_per_decode_context_token_us,
            time_scale=args.sim_time_scale,
        ),
        transfer=TransferConfig(
            bytes_per_token=args.sim_kv_bytes_per_token,
            bandwidth_gb_s=args.sim_kv_bandwidth_gb_s,
            overhead_ms=args.sim_kv_overhead_ms,
            lease_seconds=float(extra.get("kv_lease_duration", 30)),
            load_failure_policy=kv.get("kv_load_failure_policy", "fail"),
            bidirectional=bool(extra.get("bidirectional_kv_xfer", False)),
            decoder_kv_ttl_seconds=float(extra.get("decoder_kv_blocks_ttl", 480)),
        ),
        behaviour=ModelBehaviour(reasoning=args.sim_reasoning),
        render=render,
    )


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    args, ignored = parser.parse_known_args(argv)
    if ignored:
        log.warning("simulator ignores these vLLM arguments: %s", " ".join(ignored))
    return args


def main(argv: Sequence[str]) -> int:
    """`pdserve sim ARGV...` (argv without `pdserve sim`)."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if argv[:1] == ["experiment"]:
        if argv[1:2] != ["article"]:
            print("usage: pdserve sim experiment article [flags]", file=sys.stderr)
            return 2
        from pdserve.sim.experiment import main as experiment

        return experiment(argv[2:])
    if not argv or argv[0] not in ("render", "engine", "vllm"):
        asked = list(argv[:1]) in (["-h"], ["--help"])
        print(USAGE, file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    command, argv = argv[0], list(argv[1:])
    if command == "vllm":
        if argv[:1] == ["serve"]:
            command, argv = "engine", argv[1:]
        elif argv[:2] == ["launch", "render"]:
            command, argv = "render", argv[2:]
        else:
            print("error: expected `vllm serve ...` or `vllm launch render ...`", file=sys.stderr)
            return 2
    try:
        if command == "render":
            render_args = _parse(render_parser(), argv)
            app = RenderServer(_render_config(render_args)).app()
            host, port = render_args.host, render_args.port
        else:
            engine_args = _parse(engine_parser(), argv)
            server = EngineServer(engine_config(engine_args))
            server.set_faults_from(engine_args.sim_faults or {})
            app = server.app()
            host, port = engine_args.host, engine_args.port
    except (ChatError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    log.info("pdserve sim %s listening on %s:%s", command, host, port)
    run(app, host, port)
    return 0
