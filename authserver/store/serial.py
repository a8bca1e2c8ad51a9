"""One worker thread that runs blocking calls one at a time, in submission order, and hands
their results back to the event loop in batches.

Why not `loop.run_in_executor` per call: each such call wakes the thread, and each result
wakes the loop, one thread switch each way per call. Under load most of a short call's cost
was that. Here a call is queued; a worker that is idle is woken once, then runs every call
queued by then, and gives their results back to the loop in one callback. It is woken when
the loop has run the callbacks that were ready with the first call, so the calls of every
request in hand then share its batch: woken at the first call, it would take the core from
the loop (the loop and the worker share one on a busy server) and answer that call alone.
A worker that is busy picks new calls up when it is done with the ones it holds, without
being woken. So the order and the one-at-a-time of a single-thread executor hold, and while
calls keep coming the switches are paid once per batch, not once per call.

Cancellation is that of `run_in_executor`: a call whose caller was cancelled before the
worker reached it is not run; one already running runs to its end, and its result is
dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# A call as queued: what to run, the loop that waits, and the future it waits on.
_Queued = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]
# A result as handed back: the future, and its value or the exception the call raised.
_Outcome = tuple["asyncio.Future[Any]", Any, BaseException | None]


class SerialWorker:
    """Calls run one at a time on `executor`'s thread (an executor of one worker, whose
    other jobs, such as opening a connection, keep their place in its queue)."""

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self._executor = executor
        self._queue: deque[_Queued] = deque()
        self._lock = threading.Lock()
        self._running = False  # a drain is due, submitted or running; guarded by _lock
        self.batches = 0  # results handed back, one count per callback (for tests)

    async def call(self, operation: Callable[[], T]) -> T:
        """The result of `operation()`, run on the worker thread."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            self._queue.append((operation, loop, future))
            idle = not self._running
            self._running = True
        if idle:
            # Started once the loop has run what is ready now: the calls the other requests
            # in hand make meanwhile join this one's batch, and the worker is woken once
            # for them all, not once each.
            loop.call_soon(self._start)
        return await future

    def _start(self) -> None:
        """On the loop: hand the queue to the worker thread."""
        try:
            self._executor.submit(self._drain)
        except RuntimeError as exc:  # the executor was shut down: the store is closed
            with self._lock:
                refused = list(self._queue)
                self._queue.clear()
                self._running = False
            for _, loop, future in refused:
                # Each caller gets an error of its own; a loop that is closed has nobody
                # waiting any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_refuse, future, RuntimeError(*exc.args))

    def _drain(self) -> None:
        """On the worker: run what is queued, hand the results back, until nothing is."""
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                batch = list(self._queue)
                self._queue.clear()
            outcomes: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
            for operation, loop, future in batch:
                # Read across threads: a cancellation that lands just after this check
                # finds the call running, as with run_in_executor.
                if future.cancelled():
                    continue
                try:
                    outcome: _Outcome = (future, operation(), None)
                except BaseException as exc:  # handed to the caller, who raises it
                    outcome = (future, None, exc)
                outcomes.setdefault(loop, []).append(outcome)
            for loop, results in outcomes.items():
                # A loop that is closed has nobody waiting for these any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._settle, results)

    def _settle(self, results: list[_Outcome]) -> None:
        """On the loop: each caller gets its result (unless it stopped waiting)."""
        self.batches += 1
        for future, value, error in results:
            if future.done():
                continue
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)


def _refuse(future: asyncio.Future[Any], error: BaseException) -> None:
    """On the loop: a call the worker will never run fails (unless its caller stopped
    waiting)."""
    if not future.done():
        future.set_exception(error)
