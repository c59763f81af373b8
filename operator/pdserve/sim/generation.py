"""Deterministic model output: the same prompt ids and seed always give the same tokens, on any
engine, so P/D, aggregated and recomputed paths can be compared token for token.

With tools in the prompt the model answers with a Hermes <tool_call>; a reasoning model first
thinks inside <think>...</think>. Otherwise it writes words and ends its turn with <|im_end|>."""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass

from pdserve.sim.tokenizer import SimTokenizer

TOOLS_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.DOTALL)


@dataclass(frozen=True)
class ModelBehaviour:
    reasoning: bool = False
    """Think inside <think>...</think> before answering (qwen3 / deepseek_r1 style)."""
    min_words: int = 12
    max_words: int = 48


def _rng(prompt_ids: list[int], seed: int | None, adapter: str | None = None) -> random.Random:
    # A LoRA adapter changes what the model says; the base model's answers stay as they were.
    key = [prompt_ids, seed] if adapter is None else [prompt_ids, seed, adapter]
    digest = hashlib.sha256(json.dumps(key).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _first_tool(prompt_text: str) -> dict[str, object] | None:
    match = TOOLS_BLOCK.search(prompt_text)
    if not match:
        return None
    for line in match.group(1).splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                tool = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(tool, dict) and "name" in tool:
                return tool
    return None


def model_output(
    tokenizer: SimTokenizer,
    prompt_ids: list[int],
    *,
    seed: int | None,
    behaviour: ModelBehaviour,
    adapter: str | None = None,
) -> list[int]:
    """The full answer this prompt gets (callers cut it at max_tokens), under LoRA `adapter`
    (None: the base model)."""
    rng = _rng(prompt_ids, seed, adapter)
    words = tokenizer.word_ids()
    prompt_text = tokenizer.decode(prompt_ids)
    out: list[int] = []
    thinking_prefilled = prompt_text.rstrip().endswith("</think>")
    if behaviour.reasoning and not thinking_prefilled:
        out += tokenizer.encode("<think>\n")
        out += [rng.choice(words) for _ in range(rng.randint(8, 24))]
        out += tokenizer.encode("\n</think>\n\n")
    tool = _first_tool(prompt_text)
    if tool is not None:
        parameters = tool.get("parameters")
        properties = parameters.get("properties", {}) if isinstance(parameters, dict) else {}
        arguments = {name: tokenizer.decode([rng.choice(words)]).strip() for name in properties}
        call = json.dumps({"name": tool["name"], "arguments": arguments})
        out += tokenizer.encode(f"<tool_call>{call}</tool_call>")
    else:
        out += [
            rng.choice(words) for _ in range(rng.randint(behaviour.min_words, behaviour.max_words))
        ]
        out += tokenizer.encode(".")
    out.append(tokenizer.im_end_token_id)
    return out


def filler(
    tokenizer: SimTokenizer, prompt_ids: list[int], seed: int | None, count: int
) -> list[int]:
    """Deterministic words past the natural end (ignore_eos benchmarks ask for exact lengths)."""
    rng = _rng([*prompt_ids, -1], seed)
    words = tokenizer.word_ids()
    return [rng.choice(words) for _ in range(count)]
