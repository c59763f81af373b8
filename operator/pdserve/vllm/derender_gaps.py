"""Where vLLM's derender (0.32) answers differently from `vllm serve` for the same tokens, and
how the render route closes each gap, so a client cannot tell the two apart
(tests/vllm compares them on real vLLM). The simulated render server has the same gaps and its
simulated `vllm serve` closes them here too:

- the stop token that ended a choice (EOS or a stop_token_ids hit) is kept in the engine's
  token ids and derender decodes it into the content: the gateway drops it before derender;
- a stop string is applied by the engine on the token that completes it, and derender decodes
  that whole token: the gateway cuts the text where the stop string starts, and in a stream
  holds back the tail that may begin one, as vLLM's detokenizer does (StreamStop);
- a whole (not streamed) chat answer whose tool calls were parsed keeps finish_reason "stop";
  `vllm serve` says "tool_calls" unless the request named the function;
- a whole answer's usage is counted from the token ids derender was given: the engine's own
  usage (the stop token counted, as `vllm serve` does) replaces it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any

from pdserve.vllm.protocol import ends_on_stop_token, stop_string_of


def without_stop_tokens(answer: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """A whole generate answer with each choice's ending stop token dropped (usage unchanged:
    vLLM counts it as generated)."""
    trimmed = copy.deepcopy(dict(answer))
    for choice in trimmed.get("choices") or []:
        if ends_on_stop_token(choice, params):
            choice["token_ids"] = list(choice["token_ids"])[:-1]
    return trimmed


def match_vllm_serve(
    result: MutableMapping[str, Any],
    answer: Mapping[str, Any],
    params: Mapping[str, Any],
    request: Mapping[str, Any],
    *,
    chat: bool,
) -> None:
    """Correct a whole derendered answer in place (`answer`: the engine's, for stop reasons)."""
    if isinstance(answer.get("usage"), Mapping):
        result["usage"] = dict(answer["usage"])
    engine_choices = {c.get("index", 0): c for c in answer.get("choices") or []}
    for choice in result.get("choices") or []:
        engine_choice = engine_choices.get(choice.get("index", 0), {})
        stop = stop_string_of(engine_choice, params)
        if chat:
            message = choice.get("message") or {}
            if stop is not None:
                cut_message(message, stop)
            if (
                message.get("tool_calls")
                and choice.get("finish_reason") == "stop"
                and not isinstance(request.get("tool_choice"), Mapping)
            ):
                choice["finish_reason"] = "tool_calls"
        elif stop is not None and isinstance(choice.get("text"), str):
            choice["text"] = cut_text(choice["text"], stop)


def cut_message(message: MutableMapping[str, Any], stop: str) -> None:
    """End the generated text where the stop string starts: in the reasoning (then there is no
    content) or in the content."""
    reasoning = message.get("reasoning")
    if isinstance(reasoning, str) and stop in reasoning:
        message["reasoning"] = cut_text(reasoning, stop)
        message["content"] = None
        return
    content = message.get("content")
    if isinstance(content, str):
        message["content"] = cut_text(content, stop)


def cut_text(text: str, stop: str) -> str:
    at = text.find(stop)
    return text if at < 0 else text[:at]


class StreamStop:
    """Stop strings in a streamed choice, as vLLM 0.32 streams them (v1/engine/detokenizer.py
    get_next_output_text): while the choice goes on, the last `longest - 1` characters of its
    text (the request's longest stop string) are held back, since they may begin a stop string;
    its last chunk sends them, cut where the stop string that ended it starts. Held text spans
    the text fields in the order derender gave them (reasoning, then content)."""

    def __init__(self, request: Mapping[str, Any]) -> None:
        stops = request.get("stop")
        listed = [stops] if isinstance(stops, str) else stops if isinstance(stops, list) else []
        longest = max((len(s) for s in listed if isinstance(s, str)), default=0)
        self.hold = 0 if request.get("include_stop_str_in_output") else max(0, longest - 1)
        self.held: list[tuple[str, str]] = []

    def correct(self, choice: MutableMapping[str, Any], stop: str | None, *, final: bool) -> None:
        """Rewrite a derendered choice's text to what vLLM would stream: `stop`, the stop string
        that ended it (None when none did); `final`, its last chunk."""
        if not self.hold and stop is None:
            return
        fields = _texts(choice)
        pending = [*self.held, *((f, t) for f, t in fields if t)]
        if final:
            self.held = []
            joined = "".join(t for _, t in pending)
            at = joined.find(stop) if stop else -1
            released = _split(pending, at)[0] if at >= 0 else pending
        else:
            total = sum(len(t) for _, t in pending)
            released, self.held = _split(pending, max(0, total - self.hold))
        by_field: dict[str, str] = {}
        for field, text in released:
            by_field[field] = by_field.get(field, "") + text
        for field, _ in fields:
            _set_text(choice, field, by_field.pop(field, ""))
        for field, text in by_field.items():  # released from a field this chunk does not carry
            _set_text(choice, field, text)


def _split(
    segments: list[tuple[str, str]], count: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The first `count` characters of the segments, and the rest."""
    first: list[tuple[str, str]] = []
    rest: list[tuple[str, str]] = []
    for field, text in segments:
        if count >= len(text):
            first.append((field, text))
            count -= len(text)
        elif count > 0:
            first.append((field, text[:count]))
            rest.append((field, text[count:]))
            count = 0
        else:
            rest.append((field, text))
    return first, rest


def _texts(choice: Mapping[str, Any]) -> list[tuple[str, str]]:
    delta = choice.get("delta")
    if isinstance(delta, Mapping):
        return [(f, delta[f]) for f in ("reasoning", "content") if isinstance(delta.get(f), str)]
    text = choice.get("text")
    return [("text", text)] if isinstance(text, str) else []


def _set_text(choice: MutableMapping[str, Any], field: str, text: str) -> None:
    if field == "text":
        choice["text"] = text
    else:
        choice.setdefault("delta", {})[field] = text
