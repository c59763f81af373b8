"""LoRA adapters as `vllm serve` takes them (--enable-lora, --lora-modules, --max-lora-rank,
--max-loras, --max-cpu-loras) and refuses them at start, for the simulated engine: an adapter is
served under its name, listed by /v1/models with the served model as its parent, and changes
what the model says (the simulator mixes its name into the answer's seed). vLLM 0.32's wording
and checks: vllm/entrypoints/openai/cli_args.py (LoRAParserAction), vllm/config/lora.py,
vllm/lora/peft_helper.py."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.vllm.lora import DEFAULT_MAX_LORA_RANK, LORA_RANKS, SKIP_MODEL_NAME_CHECK


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str


def lora_module(text: str) -> LoraModule:
    """One --lora-modules value: `name=path`, or a JSON object with name and path (vLLM reads a
    value holding a comma as JSON)."""
    if "=" in text and "," not in text:
        name, path = text.split("=", 1)
        return LoraModule(name, path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"Invalid JSON format for --lora-modules: {text}"
        ) from None
    if not isinstance(value, dict) or not {"name", "path"} <= set(value):
        raise argparse.ArgumentTypeError(f"Invalid fields for --lora-modules: {text}")
    return LoraModule(str(value["name"]), str(value["path"]))


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--lora-modules", nargs="+", type=lora_module, default=[])
    parser.add_argument(
        "--max-lora-rank", type=int, choices=LORA_RANKS, default=DEFAULT_MAX_LORA_RANK
    )
    parser.add_argument("--max-loras", type=int, default=1)
    parser.add_argument("--max-cpu-loras", type=int)


def adapters_of(args: argparse.Namespace) -> dict[str, str]:
    """The adapters served, name -> path; ValueError where vLLM exits at start."""
    if args.max_loras < 1:
        raise ValueError(f"max_loras ({args.max_loras}) must be >= 1")
    cpu = args.max_cpu_loras if args.max_cpu_loras is not None else args.max_loras
    if cpu < args.max_loras:
        raise ValueError(f"max_cpu_loras ({cpu}) must be >= max_loras ({args.max_loras})")
    adapters: dict[str, str] = {}
    for module in args.lora_modules:
        if not args.enable_lora:
            raise ValueError(
                "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to "
                "enable LoRA."
            )
        rank = adapter_rank(module)
        if rank > args.max_lora_rank:
            raise ValueError(
                f"Loading lora {module.name} failed: LoRA rank {rank} is greater than "
                f"max_lora_rank {args.max_lora_rank}."
            )
        adapters[module.name] = module.path
    return adapters


def adapter_rank(module: LoraModule) -> int:
    """The adapter's rank (`r`) from its adapter_config.json, which must be there."""
    config = Path(module.path) / "adapter_config.json"
    try:
        rank = json.loads(config.read_text())["r"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(
            f"Loading lora {module.name} failed: No adapter found for {module.path}"
        ) from None
    if not isinstance(rank, int):
        raise ValueError(f"Loading lora {module.name} failed: r must be an integer")
    return rank


def any_model_name() -> bool:
    return os.environ.get(SKIP_MODEL_NAME_CHECK, "0").strip().lower() in ("1", "true")
