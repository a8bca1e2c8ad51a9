"""How much of the gateway one client can hold, so that a few clients cannot starve the rest.

- `Slots`: the upstream connections. A request takes a slot before it takes a pooled
  connection and gives it back when its exchange is over; who finds none free waits in line,
  but only for `upstream.pool_timeout` (then 503): the connection pool itself would let a
  request wait for ever behind clients that hold every connection.
- `BodiesInFlight`: request bodies still arriving, counted per client address and capped
  (`limits.max_bodies_per_client`), so one address cannot hold many connections open by
  sending bodies slowly.

The connection limit of the listener itself is in `app.py`, where the server is built.
Pure asyncio: no aiohttp, no clock beyond the event loop's timers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class Slots:
    """At most `limit` holders at once; the others wait in the order they came."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def try_take(self) -> bool:
        """Take a slot when one is free and nobody is waiting for one (no await, the common
        case). A request that arrives after others started waiting queues behind them."""
        if self.held < self.limit and not self._waiters:
            self.held += 1
            return True
        return False

    async def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a slot; True when one was taken."""
        if self.try_take():
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
            return True
        except TimeoutError:
            # A slot handed over just as the time ran out is this request's: keep it.
            return _handed_over(waiter)
        except BaseException:
            # Cancelled (the client left): a slot handed over meanwhile goes to the next one.
            if _handed_over(waiter):
                self.give_back()
            raise
        finally:
            if not _handed_over(waiter):
                waiter.cancel()
                # `give_back` may have dropped it already, passing over it as cancelled.
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)

    def give_back(self) -> None:
        """Hand the slot to the first request still waiting, else free it."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot changes hands: `held` stays the same
                return
        self.held -= 1


def _handed_over(waiter: asyncio.Future[None]) -> bool:
    return waiter.done() and not waiter.cancelled()


class BodiesInFlight:
    """Request bodies still arriving, per client address; `limit` 0 means no cap.

    Only addresses with a body under way have an entry, so the table is as large as the
    number of bodies arriving at once, never more.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._counts: dict[str, int] = {}

    def enter(self, client: str) -> bool:
        """Count one more body from `client`; False (and nothing counted) over the cap."""
        count = self._counts.get(client, 0)
        if self.limit and count >= self.limit:
            return False
        self._counts[client] = count + 1
        return True

    def leave(self, client: str) -> None:
        count = self._counts[client] - 1
        if count:
            self._counts[client] = count
        else:
            del self._counts[client]

    def count(self, client: str) -> int:
        """Bodies from `client` under way."""
        return self._counts.get(client, 0)

    def __len__(self) -> int:
        return len(self._counts)
