"""Token signatures checked in batches, one batch per turn of the event loop.

A signature check is the dearest step of a fresh token (an ES256 verification is about
three quarters of HAProxy's whole request), and most of its cost beyond the arithmetic is
memory: the curve's precomputed tables and OpenSSL's code must come back into the CPU's
caches, which the rest of a request's Python work has pushed out. Checked one after another
at the end of a turn, the signatures of every fresh token that arrived in it find them warm,
and each costs less CPU than when checked on its own (the fresh-token bench, bench/README.md).
A request waits at most for the checks of its own turn; under light load a batch holds one
signature.

The result of each check is what `jose.verify_signature` gives for it alone: the batch only
changes when the checks run, never what they decide. A caller that stops waiting (its
request cancelled) has its check skipped.
"""

from __future__ import annotations

import asyncio
from typing import Any

from portcullis.jose import verify_signature

_Check = tuple[asyncio.Future[bool], str, Any, bytes, bytes]


class SignatureBatch:
    """The signatures waiting for the end of the current turn of the event loop."""

    def __init__(self) -> None:
        self._waiting: list[_Check] = []
        self.batches = 0  # batches run (for tests)

    def verify(
        self, alg: str, key: Any, signing_input: bytes, signature: bytes
    ) -> asyncio.Future[bool]:
        """A future of `jose.verify_signature(alg, key, signing_input, signature)`, set at the
        end of this turn of the running loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        if not self._waiting:
            loop.call_soon(self._run)
        self._waiting.append((future, alg, key, signing_input, signature))
        return future

    def _run(self) -> None:
        waiting, self._waiting = self._waiting, []
        self.batches += 1
        for future, alg, key, signing_input, signature in waiting:
            if future.done():  # its request was cancelled meanwhile
                continue
            try:
                future.set_result(verify_signature(alg, key, signing_input, signature))
            except Exception as exc:  # each caller gets its own failure
                future.set_exception(exc)
