"""An upstream that records every byte each connection brings and reads it with h11.

h11 is an HTTP/1.1 implementation that shares no code with the gateway's parsers (aiohttp's
on the listener, llhttp in the upstream client): what it reads out of the bytes the gateway
sent is what a strict upstream would serve. Each request names how it is to be answered in
its `X-Answer` field:

- `echo` (the default): 200 with a JSON body describing the request as h11 read it.
- `extra`: the same, followed in the same write by a second answer nobody asked for.
- `early`: 200 as soon as the head is read, before the body, and the connection closed.
- `silent`: no answer (the gateway times out).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import h11

EXTRA_ANSWER = (
    b"HTTP/1.1 302 Found\r\nLocation: http://attacker.invalid/\r\n"
    b"Set-Cookie: session=attacker\r\nContent-Length: 0\r\n\r\n"
)


@dataclass
class Seen:
    """A request as the upstream read it."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes = b""
    complete: bool = False

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name.lower()]

    def describe(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "target": self.target,
            "sha256": hashlib.sha256(self.body).hexdigest(),
            "length": len(self.body),
            "marker": (self.header("x-marker") or [None])[0],
        }


@dataclass
class Recorded:
    """One connection: its bytes, and what h11 made of them."""

    stream: bytearray = field(default_factory=bytearray)
    requests: list[Seen] = field(default_factory=list)
    error: str | None = None  # h11's complaint, when the bytes were not HTTP/1.1
    open: bool = True


class RecordingUpstream:
    def __init__(self) -> None:
        self.connections: list[Recorded] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def requests(self) -> list[Seen]:
        return [seen for connection in self.connections for seen in connection.requests]

    @property
    def errors(self) -> list[str]:
        return [c.error for c in self.connections if c.error is not None]

    def clear(self) -> None:
        """Forget what was read so far; connections still open are recorded on from here."""
        self.connections = [c for c in self.connections if c.open and c.error is None]
        for connection in self.connections:
            connection.requests = [r for r in connection.requests if not r.complete]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        recorded = Recorded()
        self.connections.append(recorded)
        try:
            await self._read(reader, writer, recorded)
        except h11.RemoteProtocolError as exc:
            recorded.error = str(exc)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            recorded.open = False
            self._tasks.discard(task)
            writer.transport.abort()

    async def _read(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, recorded: Recorded
    ) -> None:
        connection = h11.Connection(h11.SERVER)
        current: Seen | None = None
        answer = "echo"
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                recorded.stream += data
                connection.receive_data(data)
                continue
            if isinstance(event, h11.ConnectionClosed):
                return
            if isinstance(event, h11.Request):
                current = Seen(
                    event.method.decode(),
                    event.target.decode("latin-1"),
                    [(k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers],
                )
                recorded.requests.append(current)
                answer = (current.header("x-answer") or ["echo"])[0]
                if answer == "early":
                    writer.write(_answer(connection, b"early", close=True))
                    await writer.drain()
                    return
            elif isinstance(event, h11.Data):
                assert current is not None
                current.body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                assert current is not None
                current.complete = True
                if answer == "silent":
                    await reader.read()  # until the gateway gives up and closes
                    return
                body = json.dumps(current.describe()).encode()
                writer.write(_answer(connection, body))
                if answer == "extra":
                    writer.write(EXTRA_ANSWER)
                    await writer.drain()
                    await reader.read()  # the gateway must close this connection
                    return
                await writer.drain()
                if connection.our_state is h11.MUST_CLOSE:
                    return
                connection.start_next_cycle()


def _answer(connection: h11.Connection, body: bytes, *, close: bool = False) -> bytes:
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    if close:
        headers.append(("Connection", "close"))
    return b"".join(
        (
            connection.send(h11.Response(status_code=200, headers=headers)) or b"",
            connection.send(h11.Data(data=body)) or b"",
            connection.send(h11.EndOfMessage()) or b"",
        )
    )
