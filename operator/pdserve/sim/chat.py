"""Chat templates (Jinja, as vLLM loads them) and the reasoning / tool-call parsers that split
generated text into content, reasoning and tool_calls the way vLLM's qwen3 / deepseek_r1 and
hermes parsers do."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML with Hermes-style tools, like Qwen3's template: earlier assistant turns lose their
# <think>...</think> (so a reasoning conversation's next prompt no longer extends the previous
# turn's tokens), and enable_thinking=false pre-fills an empty think block.
QWEN3_TEMPLATE = """
{%- if tools %}
<|im_start|>system
{{ messages[0].content if messages and messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object with function name and arguments within <tool_call></tool_call> tags.<|im_end|>
{% elif messages and messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}
<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}
<|im_start|>assistant
{{ (m.content or '').split('</think>')[-1].lstrip('\\n') if strip_reasoning else (m.content or '') }}
{%- for call in m.tool_calls %}<tool_call>{{ call | tojson }}</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif %}
"""

BUILTIN_TEMPLATES = {
    "qwen3": QWEN3_TEMPLATE,
    # The same ChatML without history stripping: a different template, different prompts.
    "chatml": QWEN3_TEMPLATE.replace("if strip_reasoning else", "if false else"),
}


class ChatError(ValueError):
    """A request the template or parsers cannot handle; the message names the field."""


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ChatError(f"{where}[{index}]: only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ChatError(f"{where}: must be a string or a list of content parts")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages: must be a non-empty list")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in (
            "system", "user", "assistant", "tool", "developer",
        ):  # fmt: skip
            raise ChatError(f"messages[{index}].role: must be system, user, assistant or tool")
        role = "system" if message["role"] == "developer" else message["role"]
        calls = []
        for number, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function", {}) if isinstance(call, Mapping) else {}
            try:
                arguments = json.loads(function.get("arguments") or "{}")
            except (TypeError, json.JSONDecodeError):
                raise ChatError(
                    f"messages[{index}].tool_calls[{number}].function.arguments: not valid JSON"
                ) from None
            calls.append({"name": function.get("name"), "arguments": arguments})
        out.append({
            "role": role,
            "content": _text(message.get("content"), f"messages[{index}].content"),
            "tool_calls": calls,
        })  # fmt: skip
    return out


@dataclass
class ChatTemplate:
    source: str
    default_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(self.source)

    def render(
        self,
        messages: Any,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        variables = {"strip_reasoning": True, **self.default_kwargs, **(kwargs or {})}
        return self._template.render(
            messages=normalize_messages(messages),
            tools=[t.get("function", t) for t in tools or []],
            add_generation_prompt=add_generation_prompt,
            **variables,
        ).lstrip("\n")


# ---- parsers ---------------------------------------------------------------------------------
@dataclass
class Parsed:
    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    tools_pending: bool = False  # an unclosed <tool_call> is being generated


class ReasoningParser:
    """qwen3: reasoning inside <think>...</think>; deepseek_r1: everything up to </think>
    (its template opens the block, so the output may not contain <think>)."""

    def __init__(self, name: str) -> None:
        if name not in ("qwen3", "deepseek_r1"):
            raise ChatError(f"--reasoning-parser: {name!r} is not one of qwen3, deepseek_r1")
        self.name = name

    def split(self, text: str, *, final: bool) -> tuple[str | None, str]:
        start, end = "<think>", "</think>"
        # Nothing is stripped, as vLLM 0.32's qwen3 parser: the newlines around the reasoning and
        # the answer stay (the sum of a stream's deltas equals the final text then, too).
        if end in text:
            before, after = text.split(end, 1)
            return before.split(start, 1)[-1] or None, after
        if start in text:
            return text.split(start, 1)[1] or None, ""
        if self.name == "deepseek_r1" and not final:
            return text or None, ""  # still thinking: the template opened the block
        return None, text


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ToolParser:
    """hermes: each <tool_call>{"name": ..., "arguments": {...}}</tool_call> becomes a call."""

    def __init__(self, name: str) -> None:
        if name != "hermes":
            raise ChatError(f"--tool-call-parser: {name!r} is not supported (hermes)")
        self.name = name

    def split(self, text: str, call_ids: list[str]) -> tuple[str, list[dict[str, Any]], bool]:
        calls: list[dict[str, Any]] = []
        for match in TOOL_CALL.finditer(text):
            try:
                body = json.loads(match.group(1).strip())
                name, arguments = body["name"], body.get("arguments", {})
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # vLLM leaves malformed calls out
            while len(call_ids) <= len(calls):
                call_ids.append(f"chatcmpl-tool-{secrets.token_hex(8)}")
            calls.append({
                "id": call_ids[len(calls)], "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            })  # fmt: skip
        # Content is what comes before the first call, unstripped, as vLLM 0.32's hermes parser
        # has it; text after the calls is dropped.
        pending = "<tool_call>" in TOOL_CALL.sub("", text)
        return text.split("<tool_call>", 1)[0], calls, pending


@dataclass
class OutputParser:
    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None

    @property
    def configured(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def parse(
        self, text: str, *, final: bool, tools_requested: bool, call_ids: list[str]
    ) -> Parsed:
        reasoning: str | None = None
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, final=final)
        calls: list[dict[str, Any]] = []
        pending = False
        if self.tools is not None and tools_requested:
            content, calls, pending = self.tools.split(content, call_ids)
        if calls:
            # No stop token in the content before a call (vLLM skips special tokens).
            content = content.replace("<|im_end|>", "").replace("<|endoftext|>", "")
        return Parsed(content=content or None, reasoning=reasoning, tool_calls=calls,
                      tools_pending=pending)  # fmt: skip
