"""JSON objects written a line each to stderr, stdout or a file, in batches: the writer both
services' access logs (and the authorization server's audit events) append to. The request
path only appends to one growing buffer (holding each line as its own bytes object until the
flush costs several times more than serialising it); a full disk or a closed stream never
takes a request down."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import IO, Any

import orjson

_MILLISECONDS = tuple(f".{ms:03d}Z" for ms in range(1000))
_MAX_WAITING = 256 * 1024  # bytes of lines held before writing at once


class JsonLines:
    """JSON objects written a line each to stderr, stdout or a file, in batches: every
    `interval` seconds, or at the end of the event loop's turn when it is zero (what
    requests served in one turn wrote goes out in one write). The caller only appends to a
    buffer. Without a running event loop a line is written at once."""

    def __init__(self, output: str, interval: float) -> None:
        self.output = output
        self._interval = interval
        self._buffer = bytearray()
        self._file: IO[bytes] | None = None
        if output not in ("stderr", "stdout"):
            self._file = open(output, "ab")  # noqa: SIM115 - closed by close()
        self._flush_handle: asyncio.Handle | None = None
        self._second = -1
        self._second_text = ""
        # Wall-clock time from the monotonic clock requests are timed with: one addition
        # instead of a second clock read per line.
        self._clock_offset = time.time() - time.perf_counter()

    def write(self, entry: dict[str, Any]) -> None:
        self._buffer += orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE, default=str)
        if len(self._buffer) >= _MAX_WAITING:
            self.flush()
        elif self._flush_handle is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._flush_handle = (
                loop.call_later(self._interval, self.flush)
                if self._interval > 0
                else loop.call_soon(self.flush)
            )

    def time_of(self, counter: float) -> str:
        """ISO 8601 UTC, to the millisecond, of a time.perf_counter() value."""
        now = counter + self._clock_offset
        second = int(now)
        if second != self._second:
            self._second = second
            self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return self._second_text + _MILLISECONDS[min(999, int((now - second) * 1000))]

    def flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if not self._buffer:
            return
        data = bytes(self._buffer)
        self._buffer.clear()
        try:
            if self._file is not None:
                self._file.write(data)
                self._file.flush()
            else:
                stream = sys.stdout if self.output == "stdout" else sys.stderr
                stream.write(data.decode())
                stream.flush()
        except (OSError, ValueError):
            pass  # a full disk or a closed stream must not take requests down with it

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
