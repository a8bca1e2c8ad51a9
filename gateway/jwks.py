"""Key sets of trusted issuers, kept in memory and refreshed in the background.

Each issuer has one KeySet. It finds its `jwks_uri` (configured, or from the issuer's
discovery document), fetches the keys at start-up and again when the response's
`Cache-Control: max-age` runs out (clamped to the configured bounds), and retries with
backoff when a fetch fails while the last good keys keep serving (stale-if-error).

The request path only reads memory. The one exception is a token whose `kid` is not in the
set: it may trigger `refetch_for_unknown_kid`, which fetches at most once per cool-down and
shares a fetch in flight among all callers, so a flood of made-up kids cannot hammer the
issuer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from .settings import IssuerSettings, JwksSettings

log = logging.getLogger("portcullis.gateway.jwks")

MAX_DOCUMENT_BYTES = 1024 * 1024

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
    """Public signing keys by kid. Keys that are not for signatures or not usable are skipped."""
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise ValueError("not a JWK Set: no keys array")
    keys: dict[str | None, list[VerifyKey]] = {}
    for jwk in document["keys"]:
        if not isinstance(jwk, dict):
            continue
        kty = jwk.get("kty")
        if not isinstance(kty, str) or kty not in _LOADERS or jwk.get("use", "sig") != "sig":
            continue
        ops = jwk.get("key_ops")
        if isinstance(ops, list) and "verify" not in ops:
            continue
        alg = jwk.get("alg")
        if alg is not None and alg not in KEY_TYPE_OF_ALG:
            continue  # bound to an algorithm we never accept
        public = {k: v for k, v in jwk.items() if k not in _PRIVATE_MEMBERS}
        try:
            key = _LOADERS[kty](public)
        except Exception:
            continue
        kid = jwk.get("kid")
        kid = kid if isinstance(kid, str) else None
        crv = jwk.get("crv") if isinstance(jwk.get("crv"), str) else None
        keys.setdefault(kid, []).append(VerifyKey(kid, kty, crv, alg, key))
    return {kid: tuple(found) for kid, found in keys.items()}


_MAX_AGE = re.compile(r"(?:^|,)\s*max-age\s*=\s*\"?(\d+)\"?", re.IGNORECASE)


def cache_lifetime(cache_control: str | None, settings: JwksSettings) -> float:
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


async def fetch_json(
    session: aiohttp.ClientSession, url: str, timeout: float
) -> tuple[Any, str | None]:
    """GET a JSON document of bounded size; (document, Cache-Control) or FetchError."""
    try:
        async with session.get(
            url,
            timeout=aiohttp.ClientTimeout(total=timeout),
            allow_redirects=False,
            headers={"Accept": "application/json"},
        ) as resp:
            if resp.status != 200:
                raise FetchError(f"{url} answered {resp.status}")
            body = await resp.content.read(MAX_DOCUMENT_BYTES + 1)
            if len(body) > MAX_DOCUMENT_BYTES:
                raise FetchError(f"{url} answered more than {MAX_DOCUMENT_BYTES} bytes")
            try:
                return orjson.loads(body), resp.headers.get("Cache-Control")
            except orjson.JSONDecodeError:
                raise FetchError(f"{url} did not answer JSON") from None
    except TimeoutError:
        raise FetchError(f"{url} timed out") from None
    except aiohttp.ClientError as exc:
        raise FetchError(f"{url} unreachable: {type(exc).__name__}") from None


class KeySet:
    """The verification keys of one issuer."""

    def __init__(
        self,
        issuer: IssuerSettings,
        settings: JwksSettings,
        session: aiohttp.ClientSession,
    ) -> None:
        self.issuer = issuer
        self.settings = settings
        self._session = session
        self._jwks_uri = issuer.jwks_uri
        self._keys: dict[str | None, tuple[VerifyKey, ...]] = {}
        self._all: tuple[VerifyKey, ...] = ()
        self.loaded = False
        self.fetches = 0
        self.failures = 0
        self.last_error: str | None = None
        self._last_attempt = -float("inf")  # monotonic time of the last fetch start
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

    def knows(self, kid: str | None) -> bool:
        return kid in self._keys if kid is not None else bool(self._all)

    async def refetch_for_unknown_kid(self) -> None:
        """Refresh once for a kid not in the set, unless a fetch ran within the cool-down."""
        if self._inflight is not None:
            await asyncio.shield(self._inflight)
            return
        if time.monotonic() - self._last_attempt < self.settings.refetch_cooldown.total_seconds():
            return
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
        backoff = 0.5
        while True:
            wait = self._next_refresh - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            if await self.refresh():
                backoff = 0.5
            else:
                # Not loaded yet, or the endpoint is failing while stale keys serve: retry
                # sooner than the cache lifetime, doubling up to max_backoff.
                self._next_refresh = time.monotonic() + backoff
                backoff = min(backoff * 2, self.settings.max_backoff.total_seconds())

    async def _fetch(self) -> bool:
        self._last_attempt = time.monotonic()
        self.fetches += 1
        timeout = self.settings.fetch_timeout.total_seconds()
        try:
            if self._jwks_uri is None:
                self._jwks_uri = await self._discover(timeout)
            document, cache_control = await fetch_json(self._session, self._jwks_uri, timeout)
            keys = parse_jwks(document)
        except (FetchError, ValueError) as exc:
            self.failures += 1
            self.last_error = str(exc)
            if self.issuer.jwks_uri is None:
                self._jwks_uri = None  # discover again next time: the issuer may have moved it
            log.warning(
                "jwks fetch failed",
                extra={
                    "issuer": self.issuer.issuer,
                    "reason": str(exc),
                    "serving_stale_keys": self.loaded,
                },
            )
            return False
        if not keys:
            log.warning("jwks has no usable signing keys", extra={"issuer": self.issuer.issuer})
        self._keys = keys
        self._all = tuple(k for found in keys.values() for k in found)
        self.loaded = True
        self.last_error = None
        ttl = cache_lifetime(cache_control, self.settings)
        self._next_refresh = time.monotonic() + ttl
        log.info(
            "jwks loaded",
            extra={"issuer": self.issuer.issuer, "keys": len(self._all), "next_refresh_s": ttl},
        )
        return True

    async def _discover(self, timeout: float) -> str:
        problems = []
        for url in discovery_urls(self.issuer.issuer):
            try:
                document, _ = await fetch_json(self._session, url, timeout)
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


def _http_allowed(issuer: IssuerSettings) -> bool:
    return issuer.allow_http or urlsplit(issuer.issuer).scheme == "http"
