"""The key ring kept in the store, for several replicas of the server on one database.

Every replica holds the ring in memory (keys.SigningRing) and reads it again from the store
every `keys.reload_every`: a cheap query for the ring's version, and the keys themselves
only when it changed. A change (a first start, a due transition, an automatic rotation,
`keys rotate`) reads the ring, decides with keys.py's functions, and writes the whole ring
back under a compare-and-set on the version it read (Store.replace_signing_keys). When
another replica changed it first, the write does nothing and the change starts again from a
new read: two replicas starting on an empty ring make one key per algorithm between them,
and two timers finding one transition due write it once.

Private keys are sealed before they reach the store, with AES-256-GCM (`KeyCipher`) under
`keys.encryption_key`: a fresh random 96-bit nonce for each key (each is sealed once), and
the kid as associated data, so that a sealed key moved onto another row does not open.
A wrong encryption key is found at start, when the first key fails to open.

Falling behind. A replica cut off from the store keeps its ring in memory, but a key
another replica publishes meanwhile could start signing without it knowing. The rotation
rules bound that: a key written at P signs from P + publish_ahead + notice at the
earliest (`RotationPolicy.lead`; `keys.date_from_writing`). So a ring confirmed at S may
choose the signing key until S + lead, and a JWK Set served from it at t may be kept by a
verifier until S + lead at the latest: the JWKS endpoint shortens its max-age below
keys.jwks_max_age when S + lead comes sooner. Past S + lead `sign` raises KeysStale (the
endpoints answer 503) and the JWKS endpoint answers 503, until a read of the store succeeds
again.
"""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .clock import Clock
from .keys import (
    Event,
    KeyInfo,
    Rotation,
    RotationPolicy,
    SigningRing,
    add_successors,
    advance,
    change_due,
    date_from_writing,
    ensure_active,
    ring_snapshot,
    transitions,
)
from .protocol.errors import TemporarilyUnavailable
from .store.base import SigningKeyRecord, Store, StoreUnavailable

T = TypeVar("T")

ENCRYPTION_KEY_BYTES = 32  # AES-256
SEALED_FORMAT = b"\x01"  # the first byte of a sealed key: AES-256-GCM, nonce, ciphertext
NONCE_BYTES = 12
TAG_BYTES = 16
# Compare-and-set attempts before a change gives up: each failure means another replica
# changed the ring in between, which happens a few times a day at most.
ATTEMPTS = 5


def encryption_key_bytes(text: str) -> bytes | None:
    """The 32 bytes of `keys.encryption_key` (standard or URL-safe base64, padding
    optional), or None when it is not that."""
    compact = "".join(text.split())
    padded = compact.replace("-", "+").replace("_", "/") + "=" * (-len(compact) % 4)
    try:
        raw = base64.b64decode(padded, validate=True)
    except ValueError:
        return None
    return raw if len(raw) == ENCRYPTION_KEY_BYTES else None


class KeyDecryptionError(Exception):
    """A sealed key does not open with the configured encryption key."""


class KeysStale(TemporarilyUnavailable):
    """The ring in memory was confirmed against the store too long ago to sign with."""


class KeyCipher:
    """Seals private keys for the store, and opens them again."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    @classmethod
    def from_setting(cls, text: str) -> KeyCipher:
        """From `keys.encryption_key`: base64 of 32 bytes (`encryption_key_bytes`)."""
        key = encryption_key_bytes(text)
        if key is None:
            raise ValueError("keys.encryption_key is not base64 of 32 bytes")
        return cls(key)

    def seal(self, kid: str, private_key: Any) -> bytes:
        der = private_key.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return self.seal_bytes(kid.encode(), der)

    def seal_bytes(self, associated: bytes, plain: bytes) -> bytes:
        """`plain` sealed as keys are (format byte, fresh nonce, ciphertext), bound to
        `associated`: it opens only with the same associated data."""
        nonce = os.urandom(NONCE_BYTES)
        return SEALED_FORMAT + nonce + self._aead.encrypt(nonce, plain, associated)

    def open_bytes(self, associated: bytes, sealed: bytes) -> bytes | None:
        """What `seal_bytes` sealed, or None when it does not open (another key, other
        associated data, an altered or foreign value)."""
        if not sealed.startswith(SEALED_FORMAT) or len(sealed) < 1 + NONCE_BYTES + TAG_BYTES:
            return None
        nonce, body = sealed[1 : 1 + NONCE_BYTES], sealed[1 + NONCE_BYTES :]
        try:
            return self._aead.decrypt(nonce, body, associated)
        except InvalidTag:
            return None

    def open(self, kid: str, sealed: bytes) -> Any:
        if not sealed.startswith(SEALED_FORMAT) or len(sealed) < 1 + NONCE_BYTES + TAG_BYTES:
            raise KeyDecryptionError(
                f"the stored signing key {kid} is not in a format this version reads"
            )
        nonce, body = sealed[1 : 1 + NONCE_BYTES], sealed[1 + NONCE_BYTES :]
        try:
            der = self._aead.decrypt(nonce, body, kid.encode())
        except InvalidTag:
            raise KeyDecryptionError(
                f"keys.encryption_key does not open the stored signing key {kid}: it is not the"
                " key the ring was written with (or the row was altered)"
            ) from None
        # Sealed by this server and authenticated just now: the RSA consistency check (over
        # 100 ms a key) would only slow every start.
        return serialization.load_der_private_key(der, None, unsafe_skip_rsa_key_validation=True)


def _info(record: SigningKeyRecord) -> KeyInfo:
    return KeyInfo(
        kid=record.kid,
        alg=record.alg,
        state=record.state,
        created_at=record.created_at,
        activate_at=record.activate_at,
        retired_at=record.retired_at,
        remove_after=record.remove_after,
    )


def _record(info: KeyInfo, sealed: bytes) -> SigningKeyRecord:
    return SigningKeyRecord(
        kid=info.kid,
        alg=info.alg,
        state=info.state,
        created_at=info.created_at,
        activate_at=info.activate_at,
        retired_at=info.retired_at,
        remove_after=info.remove_after,
        sealed_private_key=sealed,
    )


Decide = Callable[[dict[str, KeyInfo], dict[str, Any], float], T]


class StoredKeyRing(SigningRing):
    """The ring in the store, shared by every replica on the database."""

    where = "the storage"

    def __init__(
        self,
        store: Store,
        cipher: KeyCipher | None,
        policy: RotationPolicy,
        clock: Clock,
    ) -> None:
        """`cipher` may be None for a ring that is only listed (`keys list`)."""
        super().__init__(policy, clock)
        self.store = store
        self.cipher = cipher
        self._version = -1  # of the ring in memory; none read yet
        self._sealed: dict[str, bytes] = {}
        self._confirmed_at: float | None = None  # when the store last showed this version

    # ------------------------------------------------------------------ freshness

    def stale(self, now: float) -> str | None:
        return self._older_than(now, self._policy().lead)

    def jwks_cacheable_for(self, now: float) -> float | None:
        if self._confirmed_at is None:
            return 0.0
        # A key this ring does not know signs from confirmed_at + lead at the earliest.
        return self._confirmed_at + self._policy().lead - now

    def _older_than(self, now: float, bound: float) -> str | None:
        if self._confirmed_at is None:
            return "the key ring has not been read from the storage yet"
        age = now - self._confirmed_at
        if age > bound:
            return (
                f"the key ring was last read from the storage {age:.1f}s ago (allowed: {bound:g}s)"
            )
        return None

    def _refuse_if_stale(self, now: float) -> None:
        why = self.stale(now)
        if why is not None:
            raise KeysStale(why)

    def _policy(self) -> RotationPolicy:
        assert self.policy is not None
        return self.policy

    # ------------------------------------------------------------------ lifecycle

    async def start(self, algorithms: Iterable[str]) -> list[Event]:
        wanted = list(algorithms)

        def decide(infos: dict[str, KeyInfo], private: dict[str, Any], now: float) -> list[Event]:
            events = advance(infos, private, now, self.policy)
            return events + ensure_active(infos, private, wanted, now)

        return await self._change(decide, self.clock())

    async def tick(self, now: float) -> list[Event]:
        version = await self.store.signing_keys_version()
        policy = self._policy()
        if version == self._version and not change_due(self._snap.infos, now, policy):
            self._confirmed_at = max(now, self._confirmed_at or now)
            return []
        return await self._change(
            lambda infos, private, at: advance(infos, private, at, policy), now
        )

    async def rotate_keys(self, algorithms: Iterable[str], now: float) -> list[Rotation]:
        wanted = list(algorithms)
        policy = self._policy()

        def decide(infos: dict[str, KeyInfo], private: dict[str, Any], at: float) -> list[Rotation]:
            advance(infos, private, at, policy)
            return add_successors(infos, private, wanted, at, policy)

        rotations = await self._change(decide, now)
        # As written: a new key is dated from its writing (`_change`).
        return [replace(r, info=self._snap.infos[r.info.kid]) for r in rotations]

    async def listing(self, now: float) -> list[KeyInfo] | None:
        ring = await self.store.signing_keys()
        if ring.version == 0:
            return None
        infos = {record.kid: _info(record) for record in ring.keys}
        if self.policy is not None:
            infos, _ = transitions(infos, now, self.policy)
        return sorted(infos.values(), key=lambda i: (i.created_at, i.kid))

    # ------------------------------------------------------------------ reading and writing

    async def _read(self) -> tuple[int, dict[str, KeyInfo], dict[str, Any], dict[str, bytes]]:
        """The ring as stored; keys already open in memory are not opened again."""
        ring = await self.store.signing_keys()
        known = self._snap.private
        infos: dict[str, KeyInfo] = {}
        private: dict[str, Any] = {}
        sealed: dict[str, bytes] = {}
        for record in ring.keys:
            infos[record.kid] = _info(record)
            sealed[record.kid] = record.sealed_private_key
            if record.kid in known and self._sealed.get(record.kid) == record.sealed_private_key:
                private[record.kid] = known[record.kid]
            else:
                private[record.kid] = self._cipher().open(record.kid, record.sealed_private_key)
        return ring.version, infos, private, sealed

    def _cipher(self) -> KeyCipher:
        if self.cipher is None:
            raise RuntimeError("opening stored keys needs keys.encryption_key")
        return self.cipher

    async def _change(self, decide: Decide[T], now: float) -> T:
        """Read the ring, let `decide` change it in place, and write it back under a
        compare-and-set on the version read; from a new read when another came first."""
        for _ in range(ATTEMPTS):
            version, infos, private, sealed = await self._read()
            # The ring just read is the store's as of `now`: in force at once (a key another
            # replica added is published, the ring is current again), so that the decision
            # and the write, which may generate an RSA key, do not leave it aging meanwhile.
            self._install(version, infos, private, sealed, now)
            before = dict(infos)
            # In a worker thread: a new RSA key takes a while to generate.
            result = await asyncio.to_thread(decide, infos, private, now)
            if infos == before:
                return result
            date_from_writing(infos, before, self.clock(), self._policy())
            cipher = self._cipher()
            written = {
                kid: sealed[kid] if kid in sealed else cipher.seal(kid, private[kid])
                for kid in infos
            }
            records = [_record(info, written[info.kid]) for info in infos.values()]
            if await self.store.replace_signing_keys(version, records):
                self._install(version + 1, infos, private, written, now)
                return result
        raise StoreUnavailable(
            f"the signing key ring changed under this server {ATTEMPTS} times in a row"
        )

    def _install(
        self,
        version: int,
        infos: Mapping[str, KeyInfo],
        private: Mapping[str, Any],
        sealed: Mapping[str, bytes],
        confirmed_at: float,
    ) -> None:
        kept = {kid: private[kid] for kid in infos}
        self._snap = ring_snapshot(infos, kept, None)
        self._sealed = {kid: sealed[kid] for kid in infos}
        self._version = version
        self._confirmed_at = max(confirmed_at, self._confirmed_at or confirmed_at)
