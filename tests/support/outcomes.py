"""How the adversarial suite judges one answer of the gateway, and the tally it prints.

Every request ends in one of five ways: answered (a 200 with a well-formed OpenAI body, or a
stream whose every choice has its finish_reason, then `[DONE]`), a clear error (an
OpenAI-shaped JSON error, or a stream's error event, then `[DONE]`), a hang (no end within the
hang detector's deadline), truncated (the connection or stream cut without an error), or
corrupted (anything else: text/plain, not JSON, the wrong shape, an internal address in the
message, a 5xx for the client's own mistake...). Only the first two are acceptable."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import aiohttp

from pdserve.gateway.app import Gateway
from tests.support.sim_gateway import Stack, until

ERROR_FIELDS = {"message", "type", "param", "code"}


class Outcome(Enum):
    ANSWERED = "answered"
    CLEAR_ERROR = "clear error"
    HANG = "hang"
    TRUNCATED = "truncated"
    CORRUPTED = "corrupted"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    status: int | None = None
    """The HTTP status, or a stream's error event's code."""
    why: str = ""
    streamed: bool = False
    """A 200 event stream (whatever its end)."""
    error: Mapping[str, Any] | None = None
    events: tuple[Any, ...] = ()

    @property
    def acceptable(self) -> bool:
        return self.outcome in (Outcome.ANSWERED, Outcome.CLEAR_ERROR)

    @property
    def metrics_outcome(self) -> str:
        """The pdserve_gateway_requests_total outcome an honest gateway counts it under."""
        if self.outcome is Outcome.ANSWERED:
            return "ok"
        if self.status == 429:
            return "rejected"
        return f"error_{self.status}"


def _error_problem(
    error: Any, status: int | None, leaks: Iterable[str], sent: bytes = b""
) -> str | None:
    """Why an `{"error": ...}` object is not a clear OpenAI error, or None when it is."""
    if not isinstance(error, dict) or set(error) != ERROR_FIELDS:
        return f"error is not OpenAI-shaped: {error!r:.200}"
    message = error["message"]
    if not isinstance(message, str) or not message or not isinstance(error["type"], str):
        return f"error message or type missing: {error!r:.200}"
    if status is not None and error["code"] != status:
        return f"error code {error['code']!r} is not the status {status}"
    for leak in ("Traceback", "127.0.0.1", *leaks):
        if leak in message and leak.encode() not in sent:  # the client's own text may echo
            return f"error message gives away {leak!r}: {message:.200}"
    return None


def judge_json(
    status: int,
    content_type: str,
    payload: bytes,
    *,
    chat: bool,
    leaks: Iterable[str] = (),
    sent: bytes = b"",
) -> Verdict:
    """A whole (non-streamed) answer, or an error answered before a stream started."""
    if content_type != "application/json":
        return Verdict(Outcome.CORRUPTED, status, f"{content_type or 'no'} content type")
    try:
        body = json.loads(payload)
    except ValueError:
        return Verdict(Outcome.CORRUPTED, status, f"not JSON: {payload[:200]!r}")
    if not isinstance(body, dict):
        return Verdict(Outcome.CORRUPTED, status, f"not an object: {payload[:200]!r}")
    if status == 200:
        problem = _answer_problem(body, chat=chat)
        if problem:
            return Verdict(Outcome.CORRUPTED, status, problem)
        return Verdict(Outcome.ANSWERED, status)
    if set(body) != {"error"}:
        return Verdict(Outcome.CORRUPTED, status, f"an error with extras: {payload[:200]!r}")
    problem = _error_problem(body["error"], status, leaks, sent)
    if problem:
        return Verdict(Outcome.CORRUPTED, status, problem)
    return Verdict(Outcome.CLEAR_ERROR, status, error=body["error"])


def _answer_problem(body: Mapping[str, Any], *, chat: bool) -> str | None:
    choices = body.get("choices")
    if not isinstance(body.get("id"), str) or not isinstance(body.get("model"), str):
        return f"answer without id or model: {json.dumps(body)[:200]}"
    if not isinstance(choices, list) or not choices:
        return f"answer without choices: {json.dumps(body)[:200]}"
    for choice in choices:
        if not isinstance(choice, dict) or not isinstance(choice.get("index"), int):
            return f"a choice without its index: {choice!r:.200}"
        if chat and not isinstance(choice.get("message"), dict):
            return f"a chat choice without a message: {choice!r:.200}"
        if not chat and not isinstance(choice.get("text"), str):
            return f"a completion choice without text: {choice!r:.200}"
        if choice.get("finish_reason") is None:
            return f"a choice without its finish_reason: {choice!r:.200}"
    return None


def judge_stream(payload: bytes, *, leaks: Iterable[str] = ()) -> Verdict:
    """A 200 text/event-stream answer, read to its end."""
    events: list[Any] = []
    for line in payload.decode(errors="replace").splitlines():
        if not line.startswith("data: "):
            if line and not line.startswith(":"):
                return Verdict(Outcome.CORRUPTED, 200, f"not an SSE line: {line[:200]!r}")
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            events.append(data)
            continue
        try:
            events.append(json.loads(data))
        except ValueError:
            return Verdict(Outcome.CORRUPTED, 200, f"an event that is not JSON: {data[:200]!r}")
    kept = tuple(events)
    if events.count("[DONE]") > 1 or ("[DONE]" in events and events[-1] != "[DONE]"):
        return Verdict(Outcome.CORRUPTED, 200, "events after [DONE]", True, events=kept)
    errors = [i for i, e in enumerate(events) if isinstance(e, dict) and "error" in e]
    if not events or events[-1] != "[DONE]":
        why = "a stream cut without [DONE]" + (" (after an error event)" if errors else "")
        return Verdict(Outcome.TRUNCATED, 200, why, True, events=kept)
    if errors:
        if errors != [len(events) - 2]:
            return Verdict(
                Outcome.CORRUPTED, 200, "events after the error event", True, events=kept
            )
        error = events[-2]["error"]
        code = error.get("code") if isinstance(error, dict) else None
        problem = _error_problem(error, None, leaks)
        if problem or not isinstance(code, int) or code < 400:
            why = problem or f"an error event without a 4xx/5xx code: {error!r:.200}"
            return Verdict(Outcome.CORRUPTED, 200, why, True, events=kept)
        return Verdict(Outcome.CLEAR_ERROR, code, "", True, error, kept)
    finishes: dict[int, bool] = {}
    for event in events[:-1]:
        if not isinstance(event, dict) or not isinstance(event.get("choices"), list):
            return Verdict(
                Outcome.CORRUPTED, 200, f"an odd event: {event!r:.200}", True, events=kept
            )
        for choice in event["choices"]:
            index = choice.get("index") if isinstance(choice, dict) else None
            if not isinstance(index, int):
                return Verdict(Outcome.CORRUPTED, 200, f"an odd choice: {choice!r:.200}", True)
            finished = choice.get("finish_reason") is not None
            finishes[index] = finishes.get(index, False) or finished
    if not finishes or not all(finishes.values()):
        why = "[DONE] before every choice's finish_reason, with no error event"
        return Verdict(Outcome.TRUNCATED, 200, why, True, events=kept)
    return Verdict(Outcome.ANSWERED, 200, "", True, events=kept)


async def exchange(
    session: aiohttp.ClientSession,
    url: str,
    data: bytes,
    headers: Mapping[str, str],
    *,
    chat: bool,
    deadline: float,
    leaks: Iterable[str] = (),
) -> Verdict:
    """POST one request and judge what comes back; `deadline` (seconds) detects a hang."""

    async def send() -> Verdict:
        async with session.post(url, data=data, headers=dict(headers)) as response:
            payload = await response.read()
            content_type = response.content_type
            if response.status == 200 and content_type == "text/event-stream":
                return judge_stream(payload, leaks=leaks)
            return judge_json(
                response.status, content_type, payload, chat=chat, leaks=leaks, sent=data
            )

    return await judged(send(), deadline)


async def judged(answer: Awaitable[Verdict], deadline: float) -> Verdict:
    """A verdict, or hang / truncated when it never came whole."""
    try:
        return await asyncio.wait_for(answer, deadline)
    except TimeoutError:
        return Verdict(Outcome.HANG, None, f"no end within {deadline:g} s")
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as error:
        return Verdict(Outcome.TRUNCATED, None, f"connection cut: {type(error).__name__}")


def requests_by_outcome(gateway: Gateway) -> dict[str, float]:
    counts: dict[str, float] = {}
    for metric in gateway.metrics.requests.collect():
        for sample in metric.samples:
            if sample.name == "pdserve_gateway_requests_total" and sample.value:
                outcome = sample.labels["outcome"]
                counts[outcome] = counts.get(outcome, 0) + sample.value
    return counts


async def counted_as(gateway: Gateway, expected: Mapping[str, float], deadline: float) -> None:
    """The gateway's requests by outcome come to `expected` (behind the data plane its counts
    are folded in about once a second); else fails naming what was counted."""
    with suppress(TimeoutError):
        await until(lambda: requests_by_outcome(gateway) == expected, deadline)
    assert requests_by_outcome(gateway) == expected


def settled(stack: Stack, gateway: Gateway) -> bool:
    """Nothing left running: no request in flight on the gateway, no derender pipeline, no
    sequence on any engine."""
    pipelines = [
        t
        for t in asyncio.all_tasks()
        if not t.done() and "DerenderPipeline" in getattr(t.get_coro(), "__qualname__", "")
    ]
    engines_idle = all(
        not server.core.running and not server.core.waiting for server in stack.engines.values()
    )
    return gateway.metrics.inflight._value.get() == 0 and not pipelines and engines_idle


@dataclass
class Tally:
    """Outcomes per case class, across the suite's tests (printed at the end of the run)."""

    counts: dict[str, Counter[Outcome]] = field(default_factory=dict)

    def add(self, case_class: str, verdict: Verdict) -> None:
        self.counts.setdefault(case_class, Counter())[verdict.outcome] += 1

    def table(self) -> str:
        columns = list(Outcome)
        head = ["case class", "requests", *(c.value for c in columns)]
        rows = [
            [name, str(sum(counter.values())), *(str(counter[c]) for c in columns)]
            for name, counter in sorted(self.counts.items())
        ]
        total: Counter[Outcome] = Counter()
        for counter in self.counts.values():
            total.update(counter)
        rows.append(["all", str(sum(total.values())), *(str(total[c]) for c in columns)])
        lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)


TALLY = Tally()
"""The suite's one tally: tests add to it, the adversarial conftest prints it."""
