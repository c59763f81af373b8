"""An OpenAI engine on a raw loopback socket whose framing the test controls: it answers each
chat completion with the request's own words echoed (so a client can tell its answer from
another's), and can then write more on the same kept-alive connection, unasked (a complete
forged answer a moment later), as a broken engine or a hostile proxy in front of one would."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

FORGED = "FORGED ANSWER"


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


def echoed(body: bytes) -> str:
    """What the engine answers a request: its last message's words, echoed."""
    messages = json.loads(body).get("messages") or [{"content": ""}]
    return f"echo: {messages[-1]['content']}"


@dataclass
class HostileEngine:
    trailing_after: float | None = 0.05
    """Seconds after each answer to write a forged one on the same connection; None: never."""
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
                writer.write(answer(echoed(body)))
                await writer.drain()
                if self.trailing_after is not None:
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
