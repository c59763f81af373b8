"""The simulated engine takes LoRA flags as `vllm serve` does and refuses them at start where it
does, in its words (vLLM 0.32: LoRAParserAction, LoRAConfig, the adapter's load)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.sim.cli import engine_config, engine_parser
from pdserve.sim.lora import LoraModule, lora_module


def adapter(tmp_path: Path, name: str, rank: int = 8) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16}))
    return str(path)


def configured(*argv: str) -> dict[str, str]:
    args, _ = engine_parser().parse_known_args(["m", *argv])
    return dict(engine_config(args).adapters)


def test_both_forms_of_lora_modules_are_read(tmp_path: Path) -> None:
    sql, chat = adapter(tmp_path, "sql"), adapter(tmp_path, "chat")
    served = configured("--enable-lora", "--lora-modules", f"sql={sql}",
                        json.dumps({"name": "chat", "path": chat}))  # fmt: skip
    assert served == {"sql": sql, "chat": chat}
    assert lora_module("a=/p") == LoraModule("a", "/p")
    with pytest.raises(argparse.ArgumentTypeError, match="Invalid JSON format"):
        lora_module("a=/p,q")  # a comma: read as JSON, as vLLM does
    with pytest.raises(argparse.ArgumentTypeError, match="Invalid fields"):
        lora_module(json.dumps([{"name": "a", "path": "/p"}]))  # the list form vLLM refuses


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ([], "LoRA is not enabled. Use --enable-lora to enable LoRA."),
        (["--enable-lora", "--max-lora-rank", "8", "RANK16"], "LoRA rank 16 is greater than "
         "max_lora_rank 8"),
        (["--enable-lora", "MISSING"], "No adapter found for"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"],
         "max_cpu_loras (2) must be >= max_loras (4)"),
    ],
)  # fmt: skip
def test_what_vllm_refuses_at_start_stops_the_engine_in_its_words(
    tmp_path: Path, flags: list[str], words: str
) -> None:
    module = f"sql={adapter(tmp_path, 'sql')}"
    if "RANK16" in flags:
        flags, module = flags[:-1], f"sql16={adapter(tmp_path, 'sql16', rank=16)}"
    if "MISSING" in flags:
        flags, module = flags[:-1], f"gone={tmp_path / 'gone'}"
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        configured(*flags, "--lora-modules", module)
