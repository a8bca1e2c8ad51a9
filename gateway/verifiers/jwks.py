"""Key sets of trusted issuers, kept in memory and refreshed in the background.

Each issuer has one KeySet. It finds its `jwks_uri` (configured, or from the issuer's
discovery document), fetches the keys at start-up and again when the response's
`Cache-Control: max-age` runs out (clamped to the configured bounds), and retries with
backoff when a fetch fails while the last good keys keep serving (stale-if-error).

The request path only reads memory. The one exception is a token whose `kid` is not in the
set: it may trigger `refetch_for_unknown_kid`, which shares a fetch in flight among all
callers and fetches at most once per cool-down, so a flood of made-up kids cannot hammer the
issuer. Only such refetches count towards the cool-down: a key the issuer starts signing with
right after the start-up or a scheduled fetch is fetched at once, once MIN_REFETCH_GAP has
passed since that fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson
from cryptography.exceptions import UnsupportedAlgorithm
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm
from jwt.exceptions import InvalidKeyError

from portcullis import tls

from ..core.clock import Now, Sleep
from ..core.records import Issuer, KeySetTiming

log = logging.getLogger("portcullis.gateway.jwks")

USER_AGENT = "portcullis-gateway"
MAX_DOCUMENT_BYTES = 1024 * 1024
# Memory an issuer's keys hold at most, as measured by bench/memory.py (jwks-1mib-ec): a key
# set of MAX_DOCUMENT_BYTES made of P-256 keys, the type that costs most per byte of JWKS,
# holds about 18 MiB (a typical set of a few keys, about 2 KiB a key); while a fetch replaces
# it, the old set and the new one are both held.
KEY_SET_BYTES = 2 * 18 * 1024 * 1024
FIRST_RETRY = timedelta(milliseconds=500)  # after a failed fetch; doubles up to max_backoff
# No schedule fetches more often than this, even when min_ttl or max_backoff is 0s: a key
# set refreshed in a loop would hammer the issuer and gain nothing.
MIN_INTERVAL = timedelta(milliseconds=50)
# No refetch for an unknown kid this soon after any fetch (or within the cool-down, when that
# is shorter): the set just fetched is the issuer's current one.
MIN_REFETCH_GAP = timedelta(seconds=1)

# alg -> (kty, curves allowed); RFC 7518 §3.4 ties ES256/384/512 to one curve each.
KEY_TYPE_OF_ALG: Mapping[str, tuple[str, frozenset[str] | None]] = {
    "RS256": ("RSA", None),
    "RS384": ("RSA", None),
    "RS512": ("RSA", None),
    "PS256": ("RSA", None),
    "PS384": ("RSA", None),
    "PS512": ("RSA", None),
    "ES256": ("EC", frozenset({"P-256"})),
    "ES384": ("EC", frozenset({"P-384"})),
    "ES512": ("EC", frozenset({"P-521"})),
    "EdDSA": ("OKP", frozenset({"Ed25519", "Ed448"})),
}
_LOADERS: Mapping[str, Any] = {
    "RSA": RSAAlgorithm.from_jwk,
    "EC": ECAlgorithm.from_jwk,
    "OKP": OKPAlgorithm.from_jwk,
}
_PRIVATE_MEMBERS = ("d", "p", "q", "dp", "dq", "qi", "oth", "k")


@dataclass(frozen=True)
class VerifyKey:
    kid: str | None
    kty: str
    crv: str | None
    alg: str | None  # the JWK's own `alg`, when it restricts the key to one algorithm
    key: Any  # a cryptography public key object

    def fits(self, alg: str) -> bool:
        kty, curves = KEY_TYPE_OF_ALG[alg]
        if self.kty != kty or (self.alg is not None and self.alg != alg):
            return False
        return curves is None or self.crv in curves


class KeysUnavailable(Exception):
    """No key set has ever been loaded for the issuer: verification cannot happen (503)."""


def parse_jwks(document: Any) -> dict[str | None, tuple[VerifyKey, ...]]:
    """Public signing keys by kid. Keys that are not for signatures or not usable are skipped.

    One malformed entry never spoils the set: whatever its members hold (arrays where
    strings belong, unknown types, broken numbers), it is skipped and the others load.
    """
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise ValueError("not a JWK Set: no keys array")
    keys: dict[str | None, list[VerifyKey]] = {}
    for jwk in document["keys"]:
        key = _verify_key(jwk)
        if key is not None:
            keys.setdefault(key.kid, []).append(key)
    return {kid: tuple(found) for kid, found in keys.items()}


def _verify_key(jwk: Any) -> VerifyKey | None:
    """The public signing key of one JWK Set entry, or None when it is not one we can use."""
    if not isinstance(jwk, dict):
        return None
    kty, use, alg, kid, crv = (jwk.get(m) for m in ("kty", "use", "alg", "kid", "crv"))
    # RFC 7517 §4: these members are strings; an entry where they are not is malformed.
    if not all(v is None or isinstance(v, str) for v in (kty, use, alg, kid, crv)):
        return None
    if not isinstance(kty, str) or kty not in _LOADERS or use not in (None, "sig"):
        return None
    ops = jwk.get("key_ops")
    if ops is not None and not (isinstance(ops, list) and "verify" in ops):
        return None
    if alg is not None and alg not in KEY_TYPE_OF_ALG:
        return None  # bound to an algorithm we never accept
    # Private members are dropped before loading, so a key set that leaks them still
    # yields public keys only.
    public = {k: v for k, v in jwk.items() if k not in _PRIVATE_MEMBERS}
    try:
        key = _LOADERS[kty](public)
    except (InvalidKeyError, UnsupportedAlgorithm, ValueError, KeyError, TypeError) as exc:
        # A member missing, of the wrong type, not base64url, or not a point of the curve:
        # the issuer's mistake, and that one key is skipped.
        log.debug("a key of the set cannot be loaded", extra={"kid": kid, "reason": str(exc)})
        return None
    return VerifyKey(kid, kty, crv, alg, key)


_MAX_AGE = re.compile(r"(?:^|,)\s*max-age\s*=\s*\"?(\d+)\"?", re.IGNORECASE)


def cache_lifetime(cache_control: str | None, settings: KeySetTiming) -> float:
    """Seconds until the next scheduled refresh: max-age clamped to [min_ttl, max_ttl]."""
    low, high = settings.min_ttl.total_seconds(), settings.max_ttl.total_seconds()
    if cache_control:
        m = _MAX_AGE.search(cache_control)
        if m:
            return min(max(float(m.group(1)), low), high)
    return low


def discovery_urls(issuer: str) -> list[str]:
    """OpenID Connect Discovery §4 first, then RFC 8414 §3.1 (well-known before the path)."""
    parts = urlsplit(issuer)
    path = parts.path.rstrip("/")
    oidc = issuer.rstrip("/") + "/.well-known/openid-configuration"
    rfc8414 = urlunsplit(
        (parts.scheme, parts.netloc, "/.well-known/oauth-authorization-server" + path, "", "")
    )
    return [oidc, rfc8414]


class FetchError(Exception):
    pass


def issuer_tls(issuer: Issuer) -> ssl.SSLContext | bool:
    """How an issuer's https certificate is checked: against its `ca_file`, else the system's
    CAs."""
    return tls.client_context(issuer.ca_file) if issuer.ca_file is not None else True


async def fetch_json(
    session: aiohttp.ClientSession,
    url: str,
    timeout: float,
    tls: ssl.SSLContext | bool = True,
) -> tuple[Any, str | None]:
    """GET a JSON document of bounded size; (document, Cache-Control) or FetchError.
    `tls` checks an https server's certificate (a context trusting the issuer's own CA)."""
    try:
        async with session.get(
            url,
            timeout=aiohttp.ClientTimeout(total=timeout),
            allow_redirects=False,
            headers={"Accept": "application/json"},
            ssl=tls,
        ) as resp:
            if resp.status != 200:
                raise FetchError(f"{url} answered {resp.status}")
            body = await read_bounded(resp, MAX_DOCUMENT_BYTES)
            if body is None:
                raise FetchError(f"{url} answered more than {MAX_DOCUMENT_BYTES} bytes")
            try:
                return orjson.loads(body), resp.headers.get("Cache-Control")
            except orjson.JSONDecodeError:
                raise FetchError(f"{url} did not answer JSON") from None
    except TimeoutError:
        raise FetchError(f"{url} timed out") from None
    except aiohttp.ClientError as exc:
        raise FetchError(f"{url} unreachable: {type(exc).__name__}") from None


async def read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None as soon as it exceeds `limit` bytes.

    `StreamReader.read(n)` returns what has arrived so far, not n bytes: a body spanning
    several network reads has to be collected until EOF.
    """
    if resp.content_length is not None and resp.content_length > limit:
        return None
    body = bytearray()
    while chunk := await resp.content.read(limit + 1 - len(body)):
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def keys_session() -> aiohttp.ClientSession:
    """The session key sets fetch with (discovery documents and JWKS)."""
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(), headers={"User-Agent": USER_AGENT}
    )


class KeySet:
    """The verification keys of one issuer."""

    def __init__(
        self,
        issuer: Issuer,
        settings: KeySetTiming,
        session: aiohttp.ClientSession,
        now: Now = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        purpose: str = "access tokens",
    ) -> None:
        """`now` reads a monotonic clock (the schedule, the cool-downs) and `sleep` waits on
        it (between scheduled refreshes); `purpose` names in its log lines what the keys
        verify (an issuer with revocation events has a key set for those too)."""
        self.issuer = issuer
        self.purpose = purpose
        self.settings = settings
        self._session = session
        self._now = now
        self._sleep = sleep
        self._tls = issuer_tls(issuer)
        self._jwks_uri = issuer.jwks_uri
        self._keys: dict[str | None, tuple[VerifyKey, ...]] = {}
        self._all: tuple[VerifyKey, ...] = ()
        self.loaded = False
        self.fetches = 0
        self.failures = 0
        self.last_error: str | None = None
        self._last_attempt = -float("inf")  # monotonic time of the last fetch start
        self._last_kid_refetch = -float("inf")  # ... of the last one an unknown kid started
        self._next_refresh = 0.0
        self._inflight: asyncio.Task[bool] | None = None
        self._runner: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ request path

    def find(self, kid: str | None, alg: str) -> VerifyKey | None:
        """The key for a token header; a token without kid needs exactly one fitting key."""
        if kid is None:
            fitting = [k for k in self._all if k.fits(alg)]
            return fitting[0] if len(fitting) == 1 else None
        for key in self._keys.get(kid, ()):
            if key.fits(alg):
                return key
        return None

    def count_fitting(self, alg: str) -> int:
        """How many keys of the set could verify `alg`, whatever their kid."""
        return sum(1 for k in self._all if k.fits(alg))

    def knows(self, kid: str | None) -> bool:
        return kid in self._keys if kid is not None else bool(self._all)

    async def refetch_for_unknown_kid(self) -> None:
        """Refresh for a kid not in the set, or join the fetch in flight; nothing when an
        unknown kid refetched within the cool-down or any fetch started within the gap."""
        if self._inflight is not None:
            await asyncio.shield(self._inflight)
            return
        now = self._now()
        cooldown = self.settings.refetch_cooldown.total_seconds()
        if now - self._last_kid_refetch < cooldown:
            return
        if now - self._last_attempt < min(MIN_REFETCH_GAP.total_seconds(), cooldown):
            return
        self._last_kid_refetch = now
        await self.refresh()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._runner = asyncio.create_task(self._run(), name=f"jwks {self.issuer.issuer}")

    async def close(self) -> None:
        for task in (self._runner, self._inflight):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def refresh(self) -> bool:
        """Fetch now, or join the fetch already running. True when keys were loaded."""
        if self._inflight is None:
            self._inflight = asyncio.create_task(self._fetch())
            self._inflight.add_done_callback(self._clear_inflight)
        return await asyncio.shield(self._inflight)

    def _clear_inflight(self, task: asyncio.Task[bool]) -> None:
        if self._inflight is task:
            self._inflight = None

    async def _run(self) -> None:
        first_backoff = max(
            min(FIRST_RETRY, self.settings.max_backoff), MIN_INTERVAL
        ).total_seconds()
        max_backoff = max(self.settings.max_backoff, MIN_INTERVAL).total_seconds()
        backoff = first_backoff
        while True:
            wait = self._next_refresh - self._now()
            if wait > 0:
                await self._sleep(wait)
                continue
            if await self.refresh():
                backoff = first_backoff
            else:
                # Not loaded yet, or the endpoint is failing while stale keys serve: retry
                # sooner than the cache lifetime, doubling up to max_backoff.
                self._next_refresh = self._now() + backoff
                backoff = min(backoff * 2, max_backoff)

    async def _fetch(self) -> bool:
        self._last_attempt = self._now()
        self.fetches += 1
        timeout = self.settings.fetch_timeout.total_seconds()
        try:
            if self._jwks_uri is None:
                self._jwks_uri = await self._discover(timeout)
            document, cache_control = await fetch_json(
                self._session, self._jwks_uri, timeout, self._tls
            )
            keys = parse_jwks(document)
        except Exception as exc:
            # Whatever went wrong (FetchError and ValueError are the expected kinds), the
            # refresher must live on: a dead one would never load or refresh keys again.
            if not isinstance(exc, FetchError | ValueError):
                log.exception(
                    "jwks fetch crashed",
                    extra={"issuer": self.issuer.issuer, "for": self.purpose},
                )
            self.failures += 1
            self.last_error = str(exc) or type(exc).__name__
            if self.issuer.jwks_uri is None:
                self._jwks_uri = None  # discover again next time: the issuer may have moved it
            log.warning(
                "jwks fetch failed",
                extra={
                    "issuer": self.issuer.issuer,
                    "for": self.purpose,
                    "reason": str(exc),
                    "serving_stale_keys": self.loaded,
                },
            )
            return False
        if not keys:
            log.warning(
                "jwks has no usable signing keys",
                extra={"issuer": self.issuer.issuer, "for": self.purpose},
            )
        self._keys = keys
        self._all = tuple(k for found in keys.values() for k in found)
        self.loaded = True
        self.last_error = None
        ttl = max(cache_lifetime(cache_control, self.settings), MIN_INTERVAL.total_seconds())
        self._next_refresh = self._now() + ttl
        log.info(
            "jwks loaded",
            extra={
                "issuer": self.issuer.issuer,
                "for": self.purpose,
                "keys": len(self._all),
                "next_refresh_s": ttl,
            },
        )
        return True

    async def _discover(self, timeout: float) -> str:
        problems = []
        for url in discovery_urls(self.issuer.issuer):
            try:
                document, _ = await fetch_json(self._session, url, timeout, self._tls)
            except FetchError as exc:
                problems.append(str(exc))
                continue
            if not isinstance(document, dict):
                problems.append(f"{url} is not a metadata object")
                continue
            # RFC 8414 §3.3 / OIDC Discovery §4.3: the document must name the same issuer.
            if document.get("issuer") != self.issuer.issuer:
                problems.append(f"{url} names another issuer")
                continue
            jwks_uri = document.get("jwks_uri")
            if not isinstance(jwks_uri, str):
                problems.append(f"{url} has no jwks_uri")
                continue
            scheme = urlsplit(jwks_uri).scheme
            if scheme != "https" and not (scheme == "http" and _http_allowed(self.issuer)):
                problems.append(f"{url} gives a jwks_uri that is not https")
                continue
            return jwks_uri
        raise FetchError("discovery failed: " + "; ".join(problems))


def _http_allowed(issuer: Issuer) -> bool:
    return issuer.allow_http or urlsplit(issuer.issuer).scheme == "http"
