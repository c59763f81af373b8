"""One record per request, in the chunked-prefill article's JSON Lines shape:

    {"request_id": "chat-00421", "class": "chat", "prompt_tokens": 420,
     "requested_output_tokens": 160, "sent_at_ms": 1730000000000,
     "first_token_at_ms": 1730000000840, "finished_at_ms": 1730000006420,
     "output_tokens": 147, "inter_token_ms_p95": 54, "error": null, ...}

plus the group (chat, rag, large, fixed), every inter-token gap, and whether the request was
warm-up (excluded from summaries) or cancelled by Ctrl-C. Times are milliseconds on the run's
clock: wall-clock epoch milliseconds at time scale 1; against simulated engines run with a
time scale, the epoch at the start plus *simulated* milliseconds since (wall time / scale)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.stats import percentile


@dataclass
class RequestRecord:
    request_id: str
    request_class: str
    group: str
    prompt_tokens: int
    requested_output_tokens: int
    sent_at_ms: float
    first_token_at_ms: float | None = None
    finished_at_ms: float | None = None
    output_tokens: int = 0
    inter_token_ms: list[float] = field(default_factory=list)
    error: str | None = None
    warmup: bool = False
    cancelled: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.finished_at_ms is not None

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_at_ms is None:
            return None
        return self.first_token_at_ms - self.sent_at_ms

    @property
    def e2e_ms(self) -> float | None:
        if self.finished_at_ms is None:
            return None
        return self.finished_at_ms - self.sent_at_ms

    @property
    def tpot_ms(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1), as `vllm bench serve` defines it."""
        if self.ttft_ms is None or self.e2e_ms is None or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        gaps = self.inter_token_ms
        return {
            "request_id": self.request_id,
            "class": self.request_class,
            "group": self.group,
            "prompt_tokens": self.prompt_tokens,
            "requested_output_tokens": self.requested_output_tokens,
            "sent_at_ms": round(self.sent_at_ms, 2),
            "first_token_at_ms": _round(self.first_token_at_ms),
            "finished_at_ms": _round(self.finished_at_ms),
            "output_tokens": self.output_tokens,
            "inter_token_ms_p95": round(percentile(gaps, 95), 2) if gaps else None,
            "error": self.error,
            "warmup": self.warmup,
            "cancelled": self.cancelled,
            "inter_token_ms": [round(g, 3) for g in gaps],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(
            request_id=data["request_id"],
            request_class=data["class"],
            group=data.get("group", data["class"]),
            prompt_tokens=data["prompt_tokens"],
            requested_output_tokens=data["requested_output_tokens"],
            sent_at_ms=data["sent_at_ms"],
            first_token_at_ms=data.get("first_token_at_ms"),
            finished_at_ms=data.get("finished_at_ms"),
            output_tokens=data.get("output_tokens") or 0,
            inter_token_ms=list(data.get("inter_token_ms") or []),
            error=data.get("error"),
            warmup=bool(data.get("warmup")),
            cancelled=bool(data.get("cancelled")),
        )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def write_jsonl(path: Path, records: Iterable[RequestRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record.to_json()) + "\n")


def read_jsonl(path: Path) -> list[RequestRecord]:
    return [
        RequestRecord.from_json(json.loads(line))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
