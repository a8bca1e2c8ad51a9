"""Verified-token cache: a token verified once is trusted until it expires.

A bounded LRU keyed by a SHA-256 digest of the token, so neither the tokens themselves nor
an unbounded number of entries are held. Entries carry their own expiry (the token's `exp`
plus leeway); an expired entry is a miss.

The digest is of the token's one spelling (`canonical_spelling`): an ES256, ES384 or ES512
signature (r, s) has a twin (r, n - s) that verifies alike and that anyone holding the
token can make, and both are accepted, since issuers sign either (portcullis/jose.py). So
the key is that of the low-S spelling, and a token and its twin are one entry, here and in
the introspection caches, which take the same key.
"""

from __future__ import annotations

import binascii
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable

from portcullis.jose import (
    NotAnObject,
    b64url_encode,
    compact_parts,
    decode_checked_alphabet,
    json_object,
    low_s,
)

from ..core.clock import Now
from ..core.principal import Principal

# Memory one entry holds at most, as measured by bench/memory.py (token-cache): the digest,
# the principal with its claims of a typical RFC 9068 access token, and what forwarding adds
# to it (identity headers, rate-limit key). About 2.4 KiB; 100,000 entries about 240 MiB.
ENTRY_BYTES = 2_500


# The base64url length of ES256, ES384 and ES512 signatures (RFC 7518 §3.4: R and S of 32,
# 48 and 66 bytes each).
_ECDSA_SIGNATURE_CHARS = {86: "ES256", 128: "ES384", 176: "ES512"}


def token_key(token: str) -> bytes:
    """The cache key of `token`: the SHA-256 digest of its one spelling."""
    return hashlib.sha256(canonical_spelling(token).encode()).digest()


def canonical_spelling(token: str) -> str:
    """`token`, unless it is a compact JWS signed by ES256, ES384 or ES512 with a high S:
    then the same token with the low-S spelling of its signature (portcullis.jose.low_s).
    Only a signature already spelt canonically in base64url is so taken, so no other
    spelling shares a key with a verified token: each is a key of its own, and the
    verifier refuses it."""
    signature_b64 = token[token.rfind(".") + 1 :]
    alg = _ECDSA_SIGNATURE_CHARS.get(len(signature_b64))
    if alg is None:  # not ECDSA (or no JWS)
        return token
    try:
        # The alphabet is proven below, and only for a token that is to change: the common
        # case (low S) is spared compact_parts' pass over the whole token.
        signature = decode_checked_alphabet(signature_b64)
    except binascii.Error:
        return token
    canonical = low_s(alg, signature)
    if canonical == signature:
        return token
    # A high S, if the signature is `alg`'s: the header says (Ed25519's has ES256's length).
    parts = compact_parts(token)  # every part base64url text: with the above, canonical
    if parts is None:
        return token
    try:
        header = json_object(parts[0])
    except NotAnObject:
        return token
    if header.get("alg") != alg:
        return token
    return f"{parts[0]}.{parts[1]}.{b64url_encode(canonical)}"


class TokenCache:
    def __init__(self, max_entries: int, now: Now = time.time) -> None:
        """`now` reads the wall clock: entries expire with the tokens' own `exp`."""
        self.max_entries = max_entries
        self._now = now
        self._entries: OrderedDict[bytes, tuple[Principal, float]] = OrderedDict()
        # Whose verdicts may be written: the verifier of the configuration in force. A request
        # still verifying under a configuration a reload replaced (waiting on a key fetch,
        # say) cannot put back a token that the new configuration would refuse.
        self.epoch: object = object()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> tuple[bytes, ...]:
        """The digests held, least recently used first (for diagnostics and tests)."""
        return tuple(self._entries)

    @property
    def off(self) -> bool:
        """Whether the cache holds nothing and keeps nothing (`token_cache_size: 0`): `get`
        can only miss and `put` only drop, so a caller may skip the token's digest."""
        return self.max_entries <= 0

    def count_miss(self) -> None:
        """Count a miss without a lookup (in a cache that is `off`)."""
        self.misses += 1

    def get(self, key: bytes, *, count_miss: bool = True) -> Principal | None:
        """The cached principal; `count_miss=False` for a look that a full check will follow."""
        principal = self.look(key)
        if principal is None:
            self.misses += count_miss
        return principal

    def look(self, key: bytes) -> Principal | None:
        """The cached principal, a miss not counted: the request path's look, which a full
        check follows on a miss."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        principal, valid_until = entry
        if self._now() >= valid_until:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return principal

    def put(
        self, key: bytes, principal: Principal, valid_until: float, epoch: object | None = None
    ) -> None:
        """Keep a verdict; one from a verifier of another `epoch` than the current one is
        dropped (None: written whatever the epoch, for a cache without reloads)."""
        if self.max_entries <= 0 or (epoch is not None and epoch is not self.epoch):
            return
        self._entries[key] = (principal, valid_until)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def resize(self, max_entries: int) -> None:
        """A new bound, applied at once: the least recently used entries beyond it go (all
        of them at 0, which turns the cache off)."""
        self.max_entries = max_entries
        while len(self._entries) > max(0, max_entries):
            self._entries.popitem(last=False)

    def retain(self, keep: Callable[[Principal], bool]) -> None:
        """Drop every entry whose principal `keep` refuses (on reload, for issuers whose
        verification changed)."""
        for key in [k for k, (principal, _) in self._entries.items() if not keep(principal)]:
            del self._entries[key]
