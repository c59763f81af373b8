"""What each replica really runs, checked before it takes traffic: a spec hash cannot see a
render server started with another reasoning parser, an image whose tokenizer files differ or a
hand-edited pod, and any of those silently returns wrong answers.

Every render replica renders a fixed conversation (with a tool, tool_choice auto; none where the
server has no tool parser and refuses auto), tokenizes a fixed completion holding reasoning and
a tool call, and derenders those tokens; every engine reports its vLLM
version and its served model (root, max_model_len). Replicas that should agree (render: one
parity hash; engines: one parity hash and KV-compatibility digest, prefill and decode together)
are grouped by what they answered, once every replica of a group has answered (or failed a
try). The largest group takes traffic (a tie: the group answered first, so a replica added to a
serving one never displaces it); any other replica is kept out of routing, named with the
fields that differ, and reported (log, metric, `/status`, an Event on its pod).

A replica waits out of routing until its first check ends. One that does not serve a check's
route (404: an older vLLM) takes traffic unchecked, as does one whose checks keep failing (it
is likely down for traffic too, and the gateway's own retries cover it): a check never takes
the whole model down."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import aiohttp

from pdserve import wirejson
from pdserve.contract.names import (
    REPLICA_MISMATCH_REASON,
    REPLICA_UNCHECKED_REASON,
    REPLICA_VERIFIED_REASON,
)
from pdserve.gateway.endpoints import Endpoint, Endpoints
from pdserve.vllm.protocol import derender_body, derender_path, render_path

log = logging.getLogger("pdserve.gateway.contract")

CHECK_TIMEOUT_SECONDS = 10.0  # one check call
RENDER_POOL = "render"
ENGINE_POOLS = ("prefill", "decode")
# A conversation that exercises the chat template's system, user and tool sections.
CANARY_TOOL = {
    "type": "function",
    "function": {
        "name": "pdserve_canary_lookup",
        "description": "Look a word up.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string"}},
            "required": ["word"],
        },
    },
}
CANARY_MESSAGES = [
    {"role": "system", "content": "You are the pdserve replica check."},
    {"role": "user", "content": "Look up the word 'parity', then say what it means."},
]
# A completion in the markup of the most common reasoning (<think>) and tool-call (hermes)
# parsers: replicas whose parsers differ split it differently.
CANARY_COMPLETION = (
    "<think>\nThe user wants a lookup.\n</think>\n\nLooking it up.\n"
    '<tool_call>\n{"name": "pdserve_canary_lookup", "arguments": {"word": "parity"}}\n</tool_call>'
)


class Verdict(StrEnum):
    pending = "Pending"  # not checked yet: out of routing
    verified = "Verified"  # agrees with its group
    mismatch = "Mismatch"  # disagrees: out of routing
    unchecked = "Unchecked"  # no check route, or checks kept failing: routed unchecked


ROUTED = frozenset({Verdict.verified, Verdict.unchecked})
# A field the replica's server does not serve (404): compared as such.
NOT_SERVED = "<not served>"


class CheckFailed(Exception):
    """A check call failed (transport, timeout, 5xx or an answer of the wrong shape)."""


@dataclass
class ReplicaCheck:
    endpoint: Endpoint
    pool: str
    verdict: Verdict = Verdict.pending
    answers: dict[str, Any] | None = None  # field -> value, in check order
    reason: str = ""
    previous: Verdict = Verdict.pending  # the verdict before the last change
    tried: bool = False  # a check call failed once (it is being retried)
    order: int = 0  # when its answers came: a tie goes to the group answered first


Fetch = Callable[[str, str, Mapping[str, Any] | None], Awaitable[tuple[int, Any]]]
Report = Callable[[ReplicaCheck], None]


def render_answers_of(render: Any, tokenized: Any, derendered: Any) -> dict[str, Any]:
    """The fields render replicas must agree on, from their three answers."""
    try:
        message = derendered["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        return {
            "render token ids": list(render["token_ids"]),
            "tokenize token ids": list(tokenized["tokens"]),
            "derender content": message.get("content"),
            # vLLM 0.32 names it `reasoning`; older ones `reasoning_content`.
            "derender reasoning": message.get("reasoning", message.get("reasoning_content")),
            # Call ids are random: the name and arguments are what a parser decides.
            "derender tool_calls": [
                (c["function"]["name"], c["function"]["arguments"]) for c in calls
            ],
        }
    except (KeyError, IndexError, TypeError, AttributeError) as error:
        raise CheckFailed(f"an answer of an unexpected shape ({error!r})") from None


def engine_answers_of(model: str, version: Any, models: Any) -> dict[str, Any]:
    answers: dict[str, Any] = {"vLLM version": NOT_SERVED, "served model": NOT_SERVED}
    if version is not None:
        answers["vLLM version"] = version.get("version") if isinstance(version, dict) else None
    if models is not None:
        try:
            served = [m for m in models["data"] if m.get("id") == model]
        except (KeyError, TypeError, AttributeError) as error:
            raise CheckFailed(f"/v1/models answered an unexpected shape ({error!r})") from None
        answers["served model"] = (
            {"root": served[0].get("root"), "max_model_len": served[0].get("max_model_len")}
            if served
            else f"{model} is not among its models"
        )
        # LoRA adapters, where they are mounted included: engines that would run one request
        # under different adapters (or none) must not be paired.
        answers["adapters"] = sorted(
            (str(m.get("id")), str(m.get("root"))) for m in models["data"] if m.get("id") != model
        )
    return answers


def differences(answers: Mapping[str, Any], reference: Mapping[str, Any]) -> list[str]:
    """The fields whose values differ, in check order."""
    return [name for name in reference if answers.get(name) != reference[name]]


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def judge(checks: Iterable[ReplicaCheck]) -> list[ReplicaCheck]:
    """Settle one group of replicas that should agree; the checks whose verdict changed."""
    answered = [c for c in checks if c.answers is not None]
    groups: dict[str, list[ReplicaCheck]] = {}
    for check in sorted(answered, key=lambda c: c.order):
        groups.setdefault(wirejson.dumps(check.answers).decode(), []).append(check)
    if not groups:
        return []
    # The largest group wins; max() keeps the first (answered earliest) of equal ones.
    winners = max(groups.values(), key=len)
    reference = winners[0].answers
    assert reference is not None
    changed = []
    for check in answered:
        if check in winners:
            verdict, reason = Verdict.verified, ""
        else:
            assert check.answers is not None
            names = differences(check.answers, reference)
            verdict = Verdict.mismatch
            reason = (
                f"{', '.join(names)} {'differs' if len(names) == 1 else 'differ'} from "
                f"{len(winners)} other replica(s) of its {check.pool} group ({names[0]}: this "
                f"replica {_short(check.answers.get(names[0]))}, they "
                f"{_short(reference.get(names[0]))})"
            )
        if (verdict, reason) != (check.verdict, check.reason):
            check.previous, check.verdict, check.reason = check.verdict, verdict, reason
            changed.append(check)
    return changed


@dataclass
class ReplicaContract:
    """Runs the checks of every replica discovery adds, and keeps `Endpoint.routable` of each
    equal to its verdict."""

    endpoints: Endpoints
    model: str
    fetch: Fetch
    report: Report = lambda check: None
    attempts: int = 4
    retry_seconds: float = 1.0
    # id(endpoint.replica) -> check: one per pod, however many data-parallel ranks it serves
    # (each rank a routing target): a wide pod gets one vote in its group, not one per rank.
    checks: dict[int, ReplicaCheck] = field(default_factory=dict)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def start(self) -> None:
        """Check the replicas there are now, and every one discovery adds from now on."""
        self.endpoints.on_change = self.sync
        self.sync()

    def sync(self) -> None:
        current: dict[int, tuple[str, Endpoint]] = {}
        for pool, found in self.endpoints.pools.items():
            for e in found:
                current.setdefault(id(e.replica), (pool, e))
        for gone in self.checks.keys() - current.keys():
            del self.checks[gone]
        for key, (pool, endpoint) in current.items():
            if key in self.checks:
                continue
            check = ReplicaCheck(endpoint, pool)
            endpoint.routable = False
            self.checks[key] = check
            task = asyncio.get_running_loop().create_task(self._run(check))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._settle()

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _run(self, check: ReplicaCheck) -> None:
        problem = ""
        for attempt in range(self.attempts):
            try:
                answers = await self._ask(check)
            except NotServed as error:
                self._route_unchecked(check, f"it does not serve {error} (404)")
                return
            except CheckFailed as error:
                problem = str(error)
                if not check.tried:
                    check.tried = True
                    self._settle()  # its group no longer waits for it
                if attempt + 1 < self.attempts:
                    # Backoff between tries of one replica, not synchronization.
                    await asyncio.sleep(self.retry_seconds * 2**attempt)
                continue
            if id(check.endpoint.replica) in self.checks:  # not gone meanwhile
                check.answers, check.order = answers, next(self._order)
                self._settle()
            return
        self._route_unchecked(check, f"its checks kept failing: {problem}")

    def _route_unchecked(self, check: ReplicaCheck, reason: str) -> None:
        check.previous, check.verdict, check.reason = check.verdict, Verdict.unchecked, reason
        check.endpoint.routable = True
        self.report(check)
        self.endpoints.changed()

    async def _ask(self, check: ReplicaCheck) -> dict[str, Any]:
        url = check.endpoint.url
        if check.pool == RENDER_POOL:
            request: dict[str, Any] = {
                "model": self.model, "messages": CANARY_MESSAGES, "tools": [CANARY_TOOL],
                "tool_choice": "auto",
            }  # fmt: skip
            try:
                render = await self._answer(url, render_path(True), request)
            except Refused:
                # A render server without a tool parser refuses tool_choice auto (400): the
                # same conversation with tool_choice none checks what it does run.
                request["tool_choice"] = "none"
                render = await self._answer(url, render_path(True), request)
            tokenized = await self._answer(
                url, "/tokenize",
                {"model": self.model, "prompt": CANARY_COMPLETION, "add_special_tokens": False},
            )  # fmt: skip
            try:
                prompt_ids, completion_ids = list(render["token_ids"]), list(tokenized["tokens"])
            except (KeyError, TypeError) as error:
                raise CheckFailed(f"an answer of an unexpected shape ({error!r})") from None
            generated = {
                "request_id": "pdserve-replica-check",
                "choices": [
                    {"index": 0, "token_ids": completion_ids, "finish_reason": "stop",
                     "logprobs": None}
                ],
            }  # fmt: skip
            body = derender_body(self.model, generated, prompt_ids, request, chat=True)
            derendered = await self._answer(url, derender_path(True), body)
            answers = render_answers_of(render, tokenized, derendered)
            return {**answers, "tool choice": request["tool_choice"]}
        version = await self._answer(url, "/version", None, missing_ok=True)
        models = await self._answer(url, "/v1/models", None, missing_ok=True)
        return engine_answers_of(self.model, version, models)

    async def _answer(
        self, url: str, path: str, body: Mapping[str, Any] | None, *, missing_ok: bool = False
    ) -> Any:
        try:
            status, answer = await self.fetch(url, path, body)
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            raise CheckFailed(f"{path}: {error!r}") from None
        if status == 404:
            if missing_ok:
                return None
            raise NotServed(path)
        if status == 400:
            raise Refused(f"{path} answered 400")
        if status != 200:
            raise CheckFailed(f"{path} answered {status}")
        return answer

    def _settle(self) -> None:
        groups: dict[tuple[str, str | None, str | None], list[ReplicaCheck]] = {}
        for check in self.checks.values():
            e = check.endpoint
            if check.pool == RENDER_POOL:
                groups.setdefault((RENDER_POOL, e.parity_hash, None), []).append(check)
            else:
                groups.setdefault(("engines", e.parity_hash, e.kv_compat), []).append(check)
        for group in groups.values():
            if any(c.answers is None and c.verdict is Verdict.pending and not c.tried
                   for c in group):  # fmt: skip
                # Judged once every replica has answered (or failed a try): the first to
                # answer must not take traffic a majority answering just after would deny it.
                continue
            for check in judge(group):
                check.endpoint.routable = check.verdict in ROUTED
                self.report(check)
        self.endpoints.changed()

    def status(self) -> dict[str, dict[str, dict[str, str]]]:
        """Per pool, each replica's verdict and why (what `/status` shows)."""
        pools: dict[str, dict[str, dict[str, str]]] = {}
        for check in self.checks.values():
            entry = {"verdict": check.verdict.value}
            if check.reason:
                entry["reason"] = check.reason
            pools.setdefault(check.pool, {})[check.endpoint.label] = entry
        return pools


def event_of(check: ReplicaCheck, gateway: str | None) -> tuple[str, str, str] | None:
    """The Event a verdict change posts on the pod (type, reason, message): a replica kept out
    of routing or routed unchecked, and one that rejoins its group; None for the others."""
    if check.verdict is Verdict.mismatch:
        return (
            "Warning",
            REPLICA_MISMATCH_REASON,
            f"kept out of routing by gateway {gateway}: {check.reason}",
        )
    if check.verdict is Verdict.unchecked:
        return (
            "Warning",
            REPLICA_UNCHECKED_REASON,
            f"routed unchecked by gateway {gateway}: {check.reason}",
        )
    if check.verdict is Verdict.verified and check.previous is Verdict.mismatch:
        return (
            "Normal",
            REPLICA_VERIFIED_REASON,
            f"agrees with its group now: routed by gateway {gateway}",
        )
    return None


class NotServed(CheckFailed):
    """The replica does not serve a check route (404)."""


class Refused(CheckFailed):
    """The replica refused a check's request (400): a server started without what the request
    asks of it."""


def session_fetch(session: Callable[[], aiohttp.ClientSession]) -> Fetch:
    """Check calls on the gateway's upstream session: GET without a body, else POST JSON; the
    status, and the JSON answer of a 200."""

    async def fetch(url: str, path: str, body: Mapping[str, Any] | None) -> tuple[int, Any]:
        timeout = aiohttp.ClientTimeout(total=CHECK_TIMEOUT_SECONDS)
        if body is None:
            call = session().get(url + path, timeout=timeout)
        else:
            headers = {"Content-Type": "application/json"}
            call = session().post(url + path, data=wirejson.dumps(body), headers=headers,
                                  timeout=timeout)  # fmt: skip
        async with call as response:
            raw = await response.read()
            if response.status != 200:
                return response.status, None
            return 200, wirejson.loads_trusted(raw)

    return fetch
