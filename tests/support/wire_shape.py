"""The shape of a JSON answer (keys and value types, not values) and the differences between two
shapes, path by path: what the simulator's contract with real vLLM is checked on. Token ids,
texts and timings differ between a simulated and a real model; the fields a client or the
gateway reads, their types and the SSE framing must not."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

Shape = Any


def shape(value: Any) -> Shape:
    """dict -> {key: shape}, list -> [the merged shape of its items], scalar -> its JSON type."""
    if isinstance(value, Mapping):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        merged: Shape = None
        for item in value:
            merged = _merge(merged, shape(item))
        return [merged] if value else []
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return "string"


def _merge(a: Shape, b: Shape) -> Shape:
    """The items of one list: dicts merge key by key (a key some items lack stays), other
    differences keep the first item's shape unless it was null."""
    if a is None or a == "null":
        return b
    if isinstance(a, dict) and isinstance(b, dict):
        return {**b, **{key: _merge(a[key], b.get(key)) for key in a}}
    return a


def differences(real: Shape, sim: Shape, path: str = "") -> list[str]:
    """Every path where the shapes disagree: `only in vLLM: x`, `only in sim: x`,
    `x: vLLM string, sim number`. A null on one side matches any type on the other (vLLM
    leaves optional fields null), an empty list any list, and a field one side leaves out
    matches null, [] or {} on the other."""
    if real == sim or "null" in (real, sim) or [] in (real, sim) or None in (real, sim):
        return []
    if isinstance(real, dict) and isinstance(sim, dict):
        found: list[str] = []
        for key in sorted(set(real) | set(sim)):
            where = f"{path}.{key}" if path else key
            if key not in sim:
                if not _empty(real[key]):
                    found.append(f"only in vLLM: {where}")
            elif key not in real:
                if not _empty(sim[key]):
                    found.append(f"only in sim: {where}")
            else:
                found += differences(real[key], sim[key], where)
        return found
    if isinstance(real, list) and isinstance(sim, list):
        return differences(real[0], sim[0], f"{path}[]")
    return [f"{path}: vLLM {_name(real)}, sim {_name(sim)}"]


def _empty(node: Shape) -> bool:
    """A field a client reads the same whether it is absent or this: null, [], {}."""
    return node in ("null", [], {}, None)


def _name(node: Shape) -> str:
    if isinstance(node, dict):
        return "object"
    if isinstance(node, list):
        return "array"
    return str(node)


def sse_events(text: str) -> list[Any]:
    """The data of each SSE event in a body, `[DONE]` as the string; a line that is neither a
    data line nor blank is kept as `("not data", line)` so a framing difference shows."""
    events: list[Any] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line.startswith("data: "):
            events.append(("not data", line))
            continue
        data = line.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream_parts(events: Sequence[Any]) -> tuple[dict[str, Any], list[Any]]:
    """A stream's framing as values (how it ends, lines that are not data, whether a usage chunk
    without choices closes it) and its chunks with choices, whose shape is compared."""
    chunks = [event for event in events if isinstance(event, dict)]
    trailer = [chunk for chunk in chunks if not chunk.get("choices")]
    framing = {
        "ends_with_done": bool(events) and events[-1] == "[DONE]",
        "not_data_lines": [event for event in events if isinstance(event, tuple)],
        "usage_chunk_last": bool(trailer) and trailer[-1] is chunks[-1] and "usage" in trailer[-1],
    }
    return framing, [chunk for chunk in chunks if chunk.get("choices")] + trailer
