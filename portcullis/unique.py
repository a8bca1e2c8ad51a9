"""Random bytes for values that must be unique but need not be secret. Pure but for the
operating system's generator."""

from __future__ import annotations

import os
import threading


class UniqueBytes:
    """Random bytes for values that must be unique but are not secret: a token's `jti`, an
    AES-GCM nonce, a request or trace id. Drawn from the operating system's generator a
    block at a time: each os.urandom call lets go of the interpreter lock for its system
    call, and a thread waiting for it (a store's worker, say) then often takes it, so a draw
    per value cost a thread switch. A forked child starts with a block of its own, never its
    parent's. Never for secrets (refresh tokens, codes, client secrets): those come from
    `secrets`."""

    BLOCK = 4096

    def __init__(self) -> None:
        self._block = b""
        self._at = 0
        self._lock = threading.Lock()  # no two callers, on any thread, get the same bytes
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._block, self._at = b"", 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bytes:
        with self._lock:
            at = self._at
            if at + n > len(self._block):
                self._block, at = os.urandom(max(self.BLOCK, n)), 0
            self._at = at + n
            return self._block[at : at + n]
