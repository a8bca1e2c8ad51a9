"""`python -m tests.authserver.die_after_commit --config FILE`: the authorization server of
`portcullis-authserver run` in every respect but one, for the crash tests. It kills itself
with SIGKILL right after a refresh rotation has committed, before its response is written:
the moment at which a crash used to log users out.

The product holds no hook for this. The wrapper lives here and reaches the server through
the one place that names a concrete store, the composition root's `open_store`, replaced in
this process before the server is built.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from authserver import __main__ as cli
from authserver import app
from authserver.protocol.lifecycle import Move
from authserver.store.base import Issuance, PoolLimits, Store, StoreObserver, unobserved

open_real_store = app.open_store


class DiesAfterRotation:
    """The real store, except that a committed rotation kills the process."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def rotate_refresh(
        self, token_hash: bytes, move: Move, issuance: Issuance, successor_sealed: bytes
    ) -> bool:
        committed = await self._store.rotate_refresh(token_hash, move, issuance, successor_sealed)
        if committed:
            os.kill(os.getpid(), signal.SIGKILL)
        return committed


def open_store(
    url: str, pool: PoolLimits | None = None, observe: StoreObserver = unobserved
) -> Store:
    return DiesAfterRotation(open_real_store(url, pool, observe))  # type: ignore[return-value]


if __name__ == "__main__":
    app.open_store = open_store  # type: ignore[assignment]
    sys.exit(cli.main(["run", *sys.argv[1:]]))
