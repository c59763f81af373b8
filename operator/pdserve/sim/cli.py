"""`pdserve sim render|engine ...`: run a simulated vLLM server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from aiohttp import web

from pdserve.sim.chat import BUILTIN_TEMPLATES, ChatError
from pdserve.sim.render_server import RenderConfig, RenderServer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sim_command", metavar="SERVER", required=True)
    render = sub.add_parser("render", help="simulated `vllm launch render` (render/derender)")
    render.add_argument("model", nargs="?", default="sim-model", help="model name (as vLLM's)")
    render.add_argument("--host", default="0.0.0.0")
    render.add_argument("--port", type=int, default=8000)
    render.add_argument("--served-model-name")
    render.add_argument("--max-model-len", type=int, default=32768)
    render.add_argument(
        "--chat-template",
        help=f"a Jinja file, or a built-in name ({', '.join(BUILTIN_TEMPLATES)}); default qwen3",
    )
    render.add_argument("--default-chat-template-kwargs", type=json.loads, default={})
    render.add_argument("--reasoning-parser")
    render.add_argument("--tool-call-parser")
    render.add_argument("--enable-auto-tool-choice", action="store_true")
    render.add_argument("--renderer-num-workers", type=int, default=1, help="accepted, unused")


def run(args: argparse.Namespace) -> int:
    if args.sim_command == "render":
        template = BUILTIN_TEMPLATES["qwen3"]
        if args.chat_template:
            template = (
                BUILTIN_TEMPLATES.get(args.chat_template) or Path(args.chat_template).read_text()
            )
        try:
            server = RenderServer(RenderConfig(
                model=args.model, served_model_name=args.served_model_name,
                max_model_len=args.max_model_len, chat_template=template,
                default_chat_template_kwargs=args.default_chat_template_kwargs,
                reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                enable_auto_tool_choice=args.enable_auto_tool_choice,
            ))  # fmt: skip
        except ChatError as error:
            print(f"error: {error}")
            return 2
        web.run_app(server.app(), host=args.host, port=args.port, print=None)
        return 0
    return 2
