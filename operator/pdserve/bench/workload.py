"""What the benchmark sends, and when: a deterministic plan of requests from a seed.

Two workloads:
- fixed: every prompt and answer the same length (`vllm bench serve --dataset-name random`);
- the collision mix of the chunked-prefill article: a chat stream (short context, short answers)
  plus a document stream whose lengths are heavy-tailed across groups (typical RAG contexts and
  large documents), each stream with its own arrival process.
Prompts are random words or a neutral filler sentence behind a unique random head (so no two
prompts share a cached prefix); every word is one token of the simulator's tokenizer and about
one token of a BPE tokenizer. Arrivals are Poisson (burstiness 1) or gamma; the same seed gives
the same prompts at every rate and the same arrival pattern, only stretched."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pdserve.sim.tokenizer import WORDS

PromptKind = Literal["random", "filler"]
FILLER_TEXT = (
    "first the model can take the request and make a good answer then it will check each fact "
    "note the result and start again"
)
FILLER = FILLER_TEXT.split(" ")
UNIQUE_HEAD_WORDS = 8


@dataclass(frozen=True)
class Lengths:
    """Token counts drawn uniformly (or log-uniformly: a heavy tail) from low..high."""

    low: int
    high: int
    log: bool = False

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"lengths {self.low}-{self.high}: need 1 <= low <= high")

    @classmethod
    def parse(cls, text: str, *, log: bool = False) -> Lengths:
        """'8000' or '200-600'."""
        low, _, high = text.partition("-")
        try:
            return cls(int(low), int(high or low), log)
        except ValueError as error:
            raise ValueError(f"length {text!r}: expected N or LOW-HIGH ({error})") from None

    def draw(self, rng: random.Random) -> int:
        if self.low == self.high:
            return self.low
        if self.log:
            return round(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass(frozen=True)
class Group:
    name: str
    request_class: str
    weight: float
    input: Lengths
    output: Lengths


@dataclass(frozen=True)
class Stream:
    share: float
    """Share of the offered rate."""
    groups: tuple[Group, ...]
    burstiness: float = 1.0
    """Gamma shape of the inter-arrival times: 1 is Poisson, < 1 burstier, > 1 steadier."""


@dataclass(frozen=True)
class Workload:
    name: str
    streams: tuple[Stream, ...]
    prompt: PromptKind = "random"

    def describe(self) -> str:
        parts = []
        for stream in self.streams:
            groups = ", ".join(
                f"{g.name} {g.weight:g}: in {g.input}{' log' if g.input.log else ''} / "
                f"out {g.output}"
                for g in stream.groups
            )
            share = f"{stream.share:.0%} of the rate, burstiness {stream.burstiness:g}"
            parts.append(f"{share}: {groups}")
        return f"{self.name} ({self.prompt} prompts): " + "; ".join(parts)


def fixed(
    input_len: int, output_len: int, *, prompt: PromptKind = "random", burstiness: float = 1.0
) -> Workload:
    lengths = Lengths(input_len, input_len), Lengths(output_len, output_len)
    group = Group("fixed", "fixed", 1.0, *lengths)
    return Workload("fixed", (Stream(1.0, (group,), burstiness),), prompt)


DOCUMENT_GROUPS = (
    Group("rag", "document", 0.7, Lengths(1500, 6000, log=True), Lengths(64, 128)),
    Group("large", "document", 0.3, Lengths(12000, 30000, log=True), Lengths(64, 128)),
)


def collision_mix(
    *,
    chat_share: float = 0.7,
    chat_input: Lengths = Lengths(200, 600),
    chat_output: Lengths = Lengths(100, 200),
    documents: Sequence[Group] = DOCUMENT_GROUPS,
    chat_burstiness: float = 1.0,
    document_burstiness: float = 1.0,
    prompt: PromptKind = "random",
) -> Workload:
    """The chunked-prefill article's collision: chats plus a heavy-tailed document stream."""
    if not 0 < chat_share < 1:
        raise ValueError("chat share must be between 0 and 1 (exclusive)")
    chat = Group("chat", "chat", 1.0, chat_input, chat_output)
    return Workload(
        "mix",
        (
            Stream(chat_share, (chat,), chat_burstiness),
            Stream(1 - chat_share, tuple(documents), document_burstiness),
        ),
        prompt,
    )


def parse_groups(text: str, output: Lengths) -> tuple[Group, ...]:
    """'rag:0.7:1500-6000,large:0.3:12000-30000' (log-uniform lengths: a heavy tail)."""
    groups = []
    for item in text.split(","):
        try:
            name, weight, lengths = item.strip().split(":")
            groups.append(
                Group(name, "document", float(weight), Lengths.parse(lengths, log=True), output)
            )
        except ValueError as error:
            raise ValueError(
                f"document group {item!r}: expected NAME:WEIGHT:LOW-HIGH ({error})"
            ) from None
    if not groups:
        raise ValueError("at least one document group is needed")
    return tuple(groups)


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    """Arrival order."""
    request_id: str
    request_class: str
    group: str
    prompt: str
    prompt_tokens: int
    """As the simulator's tokenizer counts it (the server's usage wins when it reports one)."""
    output_tokens: int
    offset: float
    """Seconds after the start (simulated) at which it is sent; 0 for closed-loop runs."""
    warmup: bool = False


@dataclass
class _Content:
    stream: Stream
    rng: random.Random
    drawn: int = 0
    words: list[str] = field(default_factory=lambda: list(WORDS))

    def next(self, kind: PromptKind) -> tuple[Group, str, int, int]:
        self.drawn += 1
        rng = self.rng
        group = rng.choices(self.stream.groups, [g.weight for g in self.stream.groups])[0]
        prompt_tokens = group.input.draw(rng)
        output_tokens = group.output.draw(rng)
        head = min(prompt_tokens, UNIQUE_HEAD_WORDS if kind == "filler" else prompt_tokens)
        words = [rng.choice(self.words) for _ in range(head)]
        words += itertools.islice(itertools.cycle(FILLER), prompt_tokens - head)
        return group, " ".join(words), prompt_tokens, output_tokens


def _unit_gaps(rng: random.Random, burstiness: float) -> Iterator[float]:
    """Inter-arrival times with mean 1 (divide by the rate)."""
    while True:
        yield rng.gammavariate(burstiness, 1 / burstiness)


def plan(
    workload: Workload,
    count: int,
    *,
    rate: float | None,
    seed: int = 0,
    warmup: int = 0,
    id_prefix: str = "bench",
) -> list[PlannedRequest]:
    """`count` requests (the first `warmup` of them flagged) in arrival order. rate None or
    inf: offsets are 0 (closed loop, or everything at once); the order is the same either way."""
    if count < 1:
        raise ValueError("the number of requests must be at least 1")
    arrivals: list[tuple[float, int]] = []
    for index, stream in enumerate(workload.streams):
        gaps = _unit_gaps(random.Random(f"{seed}:arrivals:{index}"), stream.burstiness)
        moment = 0.0
        for _ in range(count):
            moment += next(gaps) / stream.share  # unit total rate: stretched below
            arrivals.append((moment, index))
    arrivals.sort()
    contents = [
        _Content(stream, random.Random(f"{seed}:content:{index}"))
        for index, stream in enumerate(workload.streams)
    ]
    first = arrivals[0][0]
    scale = 0.0 if rate is None or math.isinf(rate) else 1 / rate
    out = []
    for order, (moment, stream_index) in enumerate(arrivals[:count]):
        group, prompt, prompt_tokens, output_tokens = contents[stream_index].next(workload.prompt)
        out.append(
            PlannedRequest(
                index=order,
                request_id=f"{id_prefix}-{group.request_class}-{order:05d}",
                request_class=group.request_class,
                group=group.name,
                prompt=prompt,
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                offset=(moment - first) * scale,
                warmup=order < warmup,
            )
        )
    return out
