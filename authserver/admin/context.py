"""What the admin API's resources are given: the store, the clock, what the configuration
in force says of scopes and signing algorithms, the password-hashing pool, and the audit log
they write every change to."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

from .. import audit
from ..audit import Event
from ..clock import Clock
from ..events import Revocations
from ..keys import SigningRing
from ..metrics import Metrics
from ..store.base import Store
from ..users import PasswordHasher
from .access import Caller


@dataclass(frozen=True)
class Context:
    store: Store
    clock: Clock
    known_scopes: frozenset[str]  # every scope a client may be registered with
    signing_algs: tuple[str, ...]  # every algorithm the server signs with
    access_token_alg: str  # what signs access tokens: a new key's algorithm by default
    hasher: PasswordHasher
    keyring: SigningRing
    base_url: str  # {issuer}/admin/v1
    # The one way to cut a client or a user off: revokes, records the event (events.py).
    revocations: Revocations
    metrics: Metrics | None = None  # counts the second factors removed here

    def location(self, collection: str, item_id: str) -> str:
        return f"{self.base_url}/{collection}/{quote(item_id, safe='')}"

    def audit(
        self,
        caller: Caller,
        event: Event,
        *,
        client_id: str | None = None,
        subject: str | None = None,
        grant_id: str | None = None,
        kid: str | None = None,
        factor: str | None = None,
    ) -> None:
        """One audit event per change (audit.py): who (the token's client and user), what,
        and the id of what changed (`client_id`, `subject`, `grant_id` or `kid`; `factor`,
        the kind of a second factor removed). Never a secret or a password: callers pass
        ids only."""
        audit.record(
            event,
            audit.admin(caller.client_id, caller.subject),
            client_id=client_id,
            subject=subject,
            grant_id=grant_id,
            kid=kid,
            factor=factor,
        )
