"""An OpenAI engine on a raw loopback socket whose framing the test controls: it answers each
chat completion with the request's own words echoed (so a client can tell its answer from
another's), then misbehaves as a broken engine or a hostile proxy in front of one would:
`forged_after`, a complete forged answer written a moment later on the same kept-alive
connection, unasked; `bad_chunk`, a chunked answer (or event stream) whose framing breaks after
its first chunk, then the connection closed; `junk_error`, a 500 whose body is another
request's answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

FORGED = "FORGED ANSWER"
OTHER_REQUEST = "chatcmpl-another-clients-request-7"
"""What `junk_error` answers carry: a client must never read it."""
BEHAVIOURS = ("forged_after", "bad_chunk", "junk_error")


def answer(content: str) -> bytes:
    """A whole chat completion answer, with an exact Content-Length, kept alive."""
    body = json.dumps(
        {
            "id": "chatcmpl-hostile",
            "object": "chat.completion",
            "created": 0,
            "model": "qwen",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()
    head = (
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
    )
    return head.encode() + body


def broken_chunks(content: str, stream: bool) -> bytes:
    """A chunked answer's head and first chunk; the next chunk's size line is not a number."""
    first = (
        f'data: {{"id":"c","object":"chat.completion.chunk","created":0,"model":"qwen",'
        f'"choices":[{{"index":0,"delta":{{"content":"{content}"}},"finish_reason":null}}]}}\n\n'
        if stream
        else '{"id": "chatcmpl-hostile", "object": '
    ).encode()
    kind = "text/event-stream" if stream else "application/json"
    head = f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head.encode() + f"{len(first):x}\r\n".encode() + first + b"\r\n"


def junk_error() -> bytes:
    body = answer(f"{OTHER_REQUEST}: {FORGED}").split(b"\r\n\r\n", 1)[1]
    head = f"HTTP/1.1 500 Internal Server Error\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def echoed(body: bytes) -> str:
    """What the engine answers a request: its last message's words, echoed."""
    messages = json.loads(body).get("messages") or [{"content": ""}]
    return f"echo: {messages[-1]['content']}"


@dataclass
class HostileEngine:
    behaviour: str = "forged_after"
    """One of BEHAVIOURS."""
    trailing_after: float = 0.05
    """Seconds between an answer's first part and what follows it (the engine's pacing)."""
    requests: int = 0
    connections: int = 0
    forged_sent: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()  # each connection's loop ends on its reader's end
        await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), 10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                self.requests += 1
                if not head.startswith(b"POST "):
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    continue
                if self.behaviour == "junk_error":
                    writer.write(junk_error())
                    continue
                if self.behaviour == "bad_chunk":
                    stream = json.loads(body).get("stream") is True
                    writer.write(broken_chunks(echoed(body), stream))
                    await writer.drain()
                    await asyncio.sleep(self.trailing_after)  # the engine's own pacing
                    writer.write(b"zz\r\nnot a chunk\r\n")
                    return  # ... and closes
                writer.write(answer(echoed(body)))
                await writer.drain()
                await asyncio.sleep(self.trailing_after)  # the engine's own pacing
                writer.write(answer(FORGED))
                self.forged_sent += 1
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            self._tasks.discard(task)
            self._writers.discard(writer)
