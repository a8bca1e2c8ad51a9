"""Signing in through an upstream OpenID Connect provider (`identity_providers`): this server
is an ordinary client of each (OIDC Core §3.1, the authorization code flow).

The sign-in page links each provider to `/federation/NAME/start`, with the authorization
request the person is signing in for and a proof, bound to their browser session, that the
server rendered that link (Sessions.proof): a link made elsewhere starts nothing. The device
page's sign-in form has the same links for the user code it checked (`_ForDevice`): the
code, sealed with the rest, comes back through the provider to that code's consent page.
The account page's own sign-in form has them too (`_ForAccount`), and comes back to it.

start:
 1. the proof and the authorization request checked again (AuthorizationEndpoint.validate);
 2. the provider's discovery document, kept `discovery_max_age` (`Upstream`, which also
    uses the last good copy for `discovery_stale_if_error` while fetching fails): fetched with
    `timeout` for all of it, at most MAX_DOCUMENT bytes, redirects never followed, its
    `issuer` the configured one exactly (OIDC Discovery §4.3);
 3. a new `state`, `nonce` and PKCE verifier (RFC 7636, S256) sealed into a cookie
    (AES-GCM, keyed by the browser session's secret, so it opens only in the browser that
    started, for PENDING_LIFETIME), then a redirect to the provider's authorization
    endpoint with the callback's exact redirect URI.
callback:
 4. the cookie opened, `state` equal to the sealed one, then used once (Store.use_jti);
 5. `iss` (RFC 9207 §2.4), then an `error` from the provider;
 6. the code exchanged at its token endpoint (client_secret_basic, client_secret_post or
    private_key_jwt), with the verifier and the same redirect URI;
 7. the ID token: signed with an algorithm the provider advertises (public-key ones only)
    by a key of its jwks_uri (fetched again, at most once per KEYS_REFETCH, for a kid not
    known yet), then its claims (protocol/federation.py); the claims the local user is
    filled from that it lacks are read from the userinfo endpoint, about the same `sub`;
 8. the local user (`Accounts`): the one the identity is linked to, whose mapped claims
    (`claims`: the name, the email with the provider's word on it, an address only once the
    provider verified it; the username, when free, of a user without a password here) are
    refreshed from the provider's (a `user.updated` audit event when something changed);
    else, only when the operator's rule allows it (a verified email of a trusted domain),
    the existing user with that email; else a user created now, with a new random `sub`
    that no later claim of the provider changes;
 9. a new login session, and the authorization request (or the device page, or the
    account page) resumed where the password form would have taken it; for a user with a
    second factor here (an authenticator app or a passkey) whose provider did not say
    `mfa`, the second step first (the pending sign-in of endpoints/signin.py, carrying the
    provider's methods and auth_time for the ID token), where either is offered.
A provider that cannot be reached or answers what it should not is a `ProviderUnavailable`,
a refusal a FederationRefused: either shows the sign-in page again with what happened, the
password form still there (unless `password_sign_in: false`: the buttons alone). Nothing
is stored for a refused sign-in but its used `state`.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import os
import secrets
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp
import jwt
import orjson
from aiohttp import web
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from . import audit
from .audit import Event
from .clock import Clock
from .endpoints.account import PROVIDER_CARRIED as ACCOUNT_CARRIED
from .endpoints.account import AccountPages
from .endpoints.authorize import (
    AuthorizationEndpoint,
    AuthorizationRequest,
    PageError,
    Parameters,
    RedirectError,
)
from .endpoints.device import GONE as DEVICE_GONE
from .endpoints.device import DevicePages
from .endpoints.forms import query_items, with_query
from .endpoints.signin import FirstStep, client_address
from .factors import ENROLMENT_NEEDS_SIGN_IN_WITHIN, Method
from .federation_keys import SigningKey
from .metrics import Metrics
from .protocol import assurance, pkce, user_codes
from .protocol import federation as rules
from .protocol.errors import OAuthError
from .protocol.federation import ClaimNames, Expected, FederationRefused
from .registry import Client
from .sessions import Session, Sessions
from .store.base import (
    MANAGED_BY_API,
    MANAGED_BY_CONFIG,
    AlreadyExists,
    DeviceRecord,
    IdentityLink,
    Store,
    UserRecord,
)

log = logging.getLogger("portcullis.authserver.federation")

MAX_DOCUMENT = 256 * 1024  # bytes of a discovery document, key set or token response
PENDING_LIFETIME = 600.0  # seconds between start and callback
KEYS_REFETCH = 10.0  # seconds: the least time between two fetches of a provider's keys
RETRY_AFTER_FAILURE = 10.0  # seconds: after a failed fetch, while a stale copy is used
PROOF = "proof"
_USERNAME_TRIES = 5


class ProviderUnavailable(Exception):
    """The provider cannot be used now: unreachable, slow, or answering what it should not."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Provider:
    """One upstream provider, as the configuration declares it."""

    name: str
    display_name: str
    issuer: str
    client_id: str
    auth_method: str
    client_secret: str | None
    signing_key: SigningKey | None
    scopes: tuple[str, ...]
    claims: ClaimNames
    link_domains: frozenset[str]
    timeout: float  # seconds
    max_age: float  # seconds the discovery document and keys are kept
    tls: ssl.SSLContext
    # Seconds past max_age the last good copies are still used while fetching fails.
    stale_if_error: float = 0.0


@dataclass(frozen=True)
class Metadata:
    """What is used of a provider's discovery document."""

    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    algorithms: frozenset[str]
    iss_supported: bool  # RFC 9207 §3
    userinfo_endpoint: str | None = None


@dataclass
class _Kept:
    """The last good copies of a provider's documents, when each was fetched, and when a
    failed fetch may be tried again."""

    metadata: Metadata | None = None
    metadata_at: float = float("-inf")
    metadata_retry: float = float("-inf")
    keys: list[dict[str, Any]] = field(default_factory=list)
    keys_at: float = float("-inf")
    keys_current: bool = False  # fetched since the document kept was
    keys_retry: float = float("-inf")


class Upstream:
    """A provider's documents, fetched with bounds and kept a while, and its token endpoint.

    The discovery document is fetched again after `max_age`, the keys after each new
    document (and, at most once per KEYS_REFETCH, for a kid they lack): a key the provider
    withdrew (compromised, say) stops verifying within `max_age`. When fetching again fails
    (unreachable, an error status, an answer that does not pass its checks), the last good
    copy is used for at most `stale_if_error` past its age, as RFC 5861 §4's stale-if-error
    lets an HTTP cache do: a provider's moment of trouble does not stop everyone's sign-in.
    Each such failure is logged and counted (`federation_stale_documents`), and the next
    fetch waits RETRY_AFTER_FAILURE, so sign-ins do not each wait out the timeout. Past the
    bound, or with no good copy, the provider is unavailable: closed, not trusted blindly.
    """

    def __init__(self, provider: Provider, clock: Clock, metrics: Metrics | None = None) -> None:
        self.provider = provider
        self.clock = clock
        self.metrics = metrics
        self._kept = _Kept()
        self._lock = asyncio.Lock()

    async def metadata(self) -> Metadata:
        async with self._lock:
            now, kept, max_age = self.clock(), self._kept, self.provider.max_age
            if kept.metadata is not None and (
                now < kept.metadata_at + max_age
                or (now < kept.metadata_retry and self._servable(kept.metadata_at, now))
            ):
                return kept.metadata
            try:
                document = await self._get(
                    self.provider.issuer + "/.well-known/openid-configuration"
                )
                metadata = _metadata(document, self.provider.issuer)
            except ProviderUnavailable as exc:
                if kept.metadata is None or not self._servable(kept.metadata_at, now):
                    raise
                self._used_stale("discovery", exc.reason, now - kept.metadata_at)
                kept.metadata_retry = now + RETRY_AFTER_FAILURE
                return kept.metadata
            kept.metadata, kept.metadata_at = metadata, now
            kept.keys_current = False  # the keys are fetched again after each new document
            return metadata

    async def key(self, kid: str | None, alg: str) -> jwt.PyJWK:
        """The provider's key for an ID token's header; FederationRefused when none fits."""
        metadata = await self.metadata()
        async with self._lock:
            now, kept = self.clock(), self._kept
            found = _key_for(kept.keys, kid, alg) if kept.keys_current else None
            servable = self._servable(kept.keys_at, now)
            if not kept.keys_current and now < kept.keys_retry and servable:
                found = _key_for(kept.keys, kid, alg)  # a fetch failed moments ago
            elif found is None and (not kept.keys_current or now - kept.keys_at >= KEYS_REFETCH):
                try:
                    keys = _keys_of(await self._get(metadata.jwks_uri))
                except ProviderUnavailable as exc:
                    # Only keys that were current may stand in: a kid the current keys lack
                    # is no better known for an error.
                    if kept.keys_current or not kept.keys or not servable:
                        raise
                    self._used_stale("jwks", exc.reason, now - kept.keys_at)
                    kept.keys_retry = now + RETRY_AFTER_FAILURE
                else:
                    kept.keys, kept.keys_at, kept.keys_current = keys, now, True
                found = _key_for(kept.keys, kid, alg)
        if found is None:
            raise FederationRefused(
                "unknown_key", "The provider's ID token is signed by a key it does not publish."
            )
        try:
            return jwt.PyJWK(found, algorithm=alg)
        except (jwt.PyJWTError, ValueError, TypeError):
            raise FederationRefused(
                "unknown_key", "The provider's ID token is signed by a key that does not fit."
            ) from None

    def _servable(self, fetched_at: float, now: float) -> bool:
        """Whether a copy fetched at `fetched_at` may still be used when fetching it fails."""
        return now < fetched_at + self.provider.max_age + self.provider.stale_if_error

    def _used_stale(self, document: str, reason: str, age: float) -> None:
        log.warning(
            "identity provider document used stale",
            extra={
                "provider": self.provider.name,
                "document": document,
                "reason": reason,
                "age_seconds": int(age),
            },
        )
        if self.metrics is not None:
            self.metrics.stale_document(self.provider.name, document)

    async def exchange(self, code: str, verifier: str, redirect_uri: str) -> dict[str, Any]:
        """The token response for `code` (OIDC Core §3.1.3.1, RFC 7636 §4.5)."""
        provider, metadata = self.provider, await self.metadata()
        form = {
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": redirect_uri,
            "code_verifier": verifier,
        }
        headers = {"Accept": "application/json"}
        if provider.auth_method == "client_secret_basic":
            # RFC 6749 §2.3.1: each part form-encoded before they are joined.
            secret = provider.client_secret or ""
            pair = f"{quote(provider.client_id, safe='')}:{quote(secret, safe='')}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        elif provider.auth_method == "client_secret_post":
            form.update(client_id=provider.client_id, client_secret=provider.client_secret or "")
        else:
            form.update(
                client_id=provider.client_id,
                client_assertion_type="urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
                client_assertion=self._assertion(metadata.token_endpoint),
            )
        status, body = await self._request(
            "POST", metadata.token_endpoint, data=form, headers=headers
        )
        if status != 200:
            error = body.get("error") if isinstance(body, dict) else None
            log.warning(
                "provider refused the code",
                extra={"provider": provider.name, "status": status, "error": str(error)[:64]},
            )
            raise FederationRefused("code_refused", "The provider did not accept the sign-in.")
        if not isinstance(body, dict) or not isinstance(body.get("id_token"), str):
            raise ProviderUnavailable("token_response_without_id_token")
        return body

    async def userinfo(self, endpoint: str, access_token: str) -> Any:
        """The userinfo response (OIDC Core §5.3), read as JSON (a signed one is not asked)."""
        headers = {"Authorization": f"Bearer {access_token}", "Accept": "application/json"}
        status, body = await self._request("GET", endpoint, headers=headers)
        if status != 200:
            raise ProviderUnavailable(f"userinfo_http_{status}")
        return body

    def _assertion(self, token_endpoint: str) -> str:
        """A private_key_jwt assertion (RFC 7523 §3): the provider's issuer as its audience,
        as draft-ietf-oauth-rfc7523bis asks, and its token endpoint for those that want it."""
        provider, key = self.provider, self.provider.signing_key
        assert key is not None
        now = int(self.clock())
        claims = {
            "iss": provider.client_id,
            "sub": provider.client_id,
            "aud": [provider.issuer, token_endpoint],
            "jti": secrets.token_urlsafe(16),
            "iat": now,
            "exp": now + 60,
        }
        return jwt.encode(claims, key.key, algorithm=key.alg, headers={"kid": key.kid})

    async def _get(self, url: str) -> Any:
        status, body = await self._request("GET", url, headers={"Accept": "application/json"})
        if status != 200:
            raise ProviderUnavailable(f"http_{status}")
        return body

    async def _request(self, method: str, url: str, **kwargs: Any) -> tuple[int, Any]:
        timeout = aiohttp.ClientTimeout(total=self.provider.timeout)
        connector = aiohttp.TCPConnector(ssl=self.provider.tls, force_close=True)
        try:
            async with (
                aiohttp.ClientSession(
                    timeout=timeout, connector=connector, trust_env=False
                ) as session,
                session.request(method, url, allow_redirects=False, **kwargs) as response,
            ):
                body = await _bounded(response)
                status = response.status
        except (aiohttp.ClientError, ssl.SSLError, OSError, TimeoutError) as exc:
            log.warning(
                "identity provider unreachable",
                extra={"provider": self.provider.name, "reason": type(exc).__name__},
            )
            raise ProviderUnavailable("unreachable") from None
        try:
            return status, orjson.loads(body)
        except orjson.JSONDecodeError:
            if status >= 500 or status == 200:
                log.warning(
                    "identity provider answered no JSON",
                    extra={"provider": self.provider.name, "status": status},
                )
                raise ProviderUnavailable("not_json") from None
            return status, None


async def _bounded(response: aiohttp.ClientResponse) -> bytes:
    if response.content_length is not None and response.content_length > MAX_DOCUMENT:
        raise ProviderUnavailable("too_large")
    body = b""
    while not response.content.at_eof():
        body += await response.content.read(MAX_DOCUMENT + 1 - len(body))
        if len(body) > MAX_DOCUMENT:
            raise ProviderUnavailable("too_large")
    return body


def _metadata(document: Any, issuer: str) -> Metadata:
    if not isinstance(document, dict):
        raise ProviderUnavailable("discovery_not_an_object")
    # OIDC Discovery §4.3: the issuer in the document is the one asked, exactly.
    if document.get("issuer") != issuer:
        raise ProviderUnavailable("discovery_issuer_mismatch")
    endpoints: list[str] = []
    for member in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
        value = document.get(member)
        if not rules.endpoint_allowed(issuer, value):
            raise ProviderUnavailable("discovery_incomplete")
        endpoints.append(str(value))
    userinfo = document.get("userinfo_endpoint")
    algorithms = rules.id_token_algorithms(document.get("id_token_signing_alg_values_supported"))
    if not algorithms:
        raise ProviderUnavailable("no_public_key_algorithm")
    return Metadata(
        authorization_endpoint=endpoints[0],
        token_endpoint=endpoints[1],
        jwks_uri=endpoints[2],
        algorithms=algorithms,
        iss_supported=document.get("authorization_response_iss_parameter_supported") is True,
        userinfo_endpoint=userinfo if rules.endpoint_allowed(issuer, userinfo) else None,
    )


def _keys_of(document: Any) -> list[dict[str, Any]]:
    keys = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(keys, list):
        raise ProviderUnavailable("jwks_not_a_key_set")
    # Private members never make a key usable here (RFC 7517 §9.2): such keys are skipped.
    return [k for k in keys if isinstance(k, dict) and not ({"d", "k", "p", "q"} & k.keys())]


def _key_for(keys: list[dict[str, Any]], kid: str | None, alg: str) -> dict[str, Any] | None:
    usable = [k for k in keys if k.get("use", "sig") == "sig" and k.get("alg", alg) == alg]
    if kid is not None:
        usable = [k for k in usable if k.get("kid") == kid]
    return usable[0] if len(usable) == 1 or (kid is not None and usable) else None


# ---------------------------------------------------------------------------- local users


@dataclass(frozen=True)
class SignedIn:
    subject: str
    outcome: str  # returning, linked or created: for the log
    # RFC 8176 methods the provider says it used (its ID token's `amr`, registered names
    # only): what this server's ID tokens then say of the sign-in. None are this server's.
    amr: tuple[str, ...] = ()
    auth_time: float | None = None  # when the user signed in at the provider
    updated: bool = False  # a returning user's claims changed with the provider's


class Accounts:
    """Step 8 of the module docstring: the local user an identity signs in as."""

    def __init__(self, store: Store, clock: Clock) -> None:
        self.store = store
        self.clock = clock

    async def sign_in(
        self, provider: Provider, provider_subject: str, claims: Mapping[str, Any]
    ) -> SignedIn:
        owner = await self.store.identity_owner(provider.issuer, provider_subject)
        if owner is not None:
            user = await self._enabled(owner)
            updated = await self._refresh(provider, user, claims)
            return SignedIn(owner, "returning", updated=updated)
        now = self.clock()
        email = rules.email_to_link(claims, provider.claims, provider.link_domains)
        if email is not None:
            # Only a user whose own email is verified here, and who signs in through no
            # provider yet: an address a federated sign-in brought (verified or not), or one
            # a provider gave a former holder, never takes over an account.
            existing = [
                u
                for u in await self.store.users_with_email(email)
                if rules.same_email(u.claims.get("email"), email)
                and u.claims.get("email_verified") is True
                and not await self.store.identity_links(u.subject)
            ]
            if len(existing) > 1:
                raise FederationRefused(
                    "ambiguous_email",
                    "More than one account here has this email; "
                    "ask an administrator to link yours.",
                )
            if existing:
                if existing[0].disabled:
                    raise FederationRefused("disabled", "Your account here is disabled.")
                link = IdentityLink(provider.issuer, provider_subject, existing[0].subject, now)
                return await self._link(link, None, "linked")
        username, local_claims = rules.profile_of(claims, provider.claims, provider_subject)
        subject = base64.urlsafe_b64encode(os.urandom(16)).rstrip(b"=").decode()
        suffixes = (secrets.token_hex(3) for _ in range(_USERNAME_TRIES))
        for name in rules.usernames(username, suffixes):
            user = UserRecord(
                subject=subject,
                username=name,
                password_hash="",  # no password: this user signs in through the provider
                claims=local_claims,
                roles=(),
                disabled=False,
                managed_by=MANAGED_BY_API,
                created_at=now,
                updated_at=now,
            )
            try:
                return await self._link(
                    IdentityLink(provider.issuer, provider_subject, subject, now), user, "created"
                )
            except AlreadyExists:
                continue  # the username is taken: the next one
        raise FederationRefused(
            "no_username", "No username could be given to your account; ask an administrator."
        )

    async def _link(self, link: IdentityLink, user: UserRecord | None, outcome: str) -> SignedIn:
        try:
            await self.store.link_identity(link, user)
        except AlreadyExists:
            # A sign-in of the same identity, at the same time, linked it first.
            owner = await self.store.identity_owner(link.issuer, link.provider_subject)
            if owner is None:
                raise
            return await self._returning(owner)
        return SignedIn(link.subject, outcome)

    async def _returning(self, subject: str) -> SignedIn:
        await self._enabled(subject)
        return SignedIn(subject, "returning")

    async def _enabled(self, subject: str) -> UserRecord:
        user = await self.store.get_user(subject)
        if user is None or user.disabled:
            raise FederationRefused("disabled", "Your account here is disabled.")
        return user

    async def _refresh(
        self, provider: Provider, user: UserRecord, claims: Mapping[str, Any]
    ) -> bool:
        """The claims the operator maps from the provider, as it gives them now, on the
        linked `user` (protocol/federation.refreshed_claims); whether anything changed.

        Never the `sub`. The username follows the provider's only for a user without a
        password here (one created by a first sign-in: a user with a password types their
        username at the password form, which must not move under them), and only when no
        other user has it. A user of the configuration file is the file's (it would put
        them back at the next start): left as it is. The write is a compare-and-set on the
        user's version (a second one without the username, when another user took it
        meanwhile): a change by an administrator meanwhile wins, and the next sign-in
        refreshes again."""
        if user.managed_by == MANAGED_BY_CONFIG:
            return False
        refreshed = rules.refreshed_claims(user.claims, claims, provider.claims)
        username = user.username
        offered = rules.offered_username(claims, provider.claims)
        if (
            offered is not None
            and offered != username
            and not user.password_hash
            and await self.store.user_by_username(offered) is None
        ):
            username = offered
        if refreshed == dict(user.claims) and username == user.username:
            return False
        record = replace(user, username=username, claims=refreshed, updated_at=self.clock())
        try:
            return await self.store.save_user(record, user.version)
        except AlreadyExists:
            # The username was taken meanwhile: the claims without it.
            if refreshed == dict(user.claims):
                return False
            return await self.store.save_user(replace(record, username=user.username), user.version)


# ---------------------------------------------------------------------------- the pending sign-in


@dataclass(frozen=True)
class Pending:
    state: str
    nonce: str
    verifier: str
    carried: list[tuple[str, str]]
    expires_at: float


def _sealing_key(session: Session, provider: str) -> bytes:
    return hmac.new(
        session.record.csrf_secret, b"federation\x00" + provider.encode(), hashlib.sha256
    ).digest()


def seal(session: Session, provider: str, pending: Pending) -> str:
    payload = orjson.dumps(
        {
            "s": pending.state,
            "n": pending.nonce,
            "v": pending.verifier,
            "c": pending.carried,
            "e": pending.expires_at,
        }
    )
    iv = os.urandom(12)
    sealed = AESGCM(_sealing_key(session, provider)).encrypt(iv, payload, provider.encode())
    return base64.urlsafe_b64encode(iv + sealed).rstrip(b"=").decode()


def unseal(session: Session, provider: str, value: str, now: float) -> Pending | None:
    """The pending sign-in, unless the value was sealed for another session or provider,
    altered, or is past its time."""
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        payload = AESGCM(_sealing_key(session, provider)).decrypt(
            raw[:12], raw[12:], provider.encode()
        )
        data = orjson.loads(payload)
        pending = Pending(
            data["s"], data["n"], data["v"], [(k, v) for k, v in data["c"]], float(data["e"])
        )
    except (ValueError, InvalidTag, KeyError, TypeError, orjson.JSONDecodeError):
        return None
    return pending if pending.expires_at > now else None


# ---------------------------------------------------------------------------- the routes


@dataclass(frozen=True)
class SignInLinks:
    """The sign-in page's buttons: one link per provider, for one request and session."""

    providers: tuple[tuple[str, str], ...]  # (name, display name)
    base_path: str

    def __call__(self, session: Session, carried: list[tuple[str, str]]) -> list[dict[str, str]]:
        return [
            {
                "name": shown,
                "href": with_query(
                    f"{self.base_path}/federation/{name}/start",
                    {
                        **dict(carried),
                        PROOF: Sessions.proof(session, [("federation", name), *carried]),
                    },
                ),
            }
            for name, shown in self.providers
        ]


class Federation:
    """GET /federation/{name}/start and /federation/{name}/callback."""

    def __init__(
        self,
        providers: Iterable[Provider],
        *,
        authorize: AuthorizationEndpoint,
        sessions: Sessions,
        store: Store,
        issuer: str,
        base_path: str,
        secure: bool,
        clock: Clock = time.time,
        metrics: Metrics | None = None,
        device: DevicePages | None = None,
        account: AccountPages | None = None,
        password_sign_in: bool = True,
    ) -> None:
        self.upstreams = {p.name: Upstream(p, clock, metrics) for p in providers}
        self.password_sign_in = password_sign_in  # what a refusal offers instead
        self.device = device  # the device page, whose sign-in form has the buttons too
        self.account = account  # and the account page, whose own sign-in form has them
        self.authorize = authorize
        self.sessions = sessions
        self.store = store
        self.accounts = Accounts(store, clock)
        self.issuer = issuer
        self.base_path = base_path
        self.clock = clock
        self.secure = secure
        self.cookie = "__Host-portcullis_federation" if secure else "portcullis_federation"

    def redirect_uri(self, name: str) -> str:
        return f"{self.issuer}/federation/{name}/callback"

    async def start(self, request: web.Request) -> web.StreamResponse:
        upstream = self.upstreams.get(request.match_info["name"])
        if upstream is None:
            raise web.HTTPNotFound()
        name = upstream.provider.name
        try:
            try:
                given = Parameters.collect(query_items(request))
            except OAuthError as exc:
                raise PageError(f"The request is malformed: {exc.description}.") from None
            values = {k: v for k, v in given.values.items() if k != PROOF}
            session = await self.sessions.current(request)

            def proven(carried: list[tuple[str, str]]) -> bool:
                return session is not None and Sessions.proof_valid(
                    session, [("federation", name), *carried], given.values.get(PROOF)
                )

            target = await self._target(Parameters(values, given.repeated), proven)
            if isinstance(target, web.Response):
                return target
            assert session is not None
            try:
                metadata = await upstream.metadata()
            except ProviderUnavailable as exc:
                log.warning(
                    "federated sign-in unavailable", extra={"provider": name, "reason": exc.reason}
                )
                message = _unreachable(upstream.provider, self.password_sign_in)
                return await target.refused(request, message, 502)
            return self._to_provider(upstream.provider, metadata, session, target)
        except PageError as exc:
            return self.authorize.pages.error(
                400, "This sign-in request cannot be handled", exc.message
            )
        except RedirectError as exc:
            return self.authorize.error_redirect(request, exc)

    async def _target(
        self, params: Parameters, proven: Callable[[list[tuple[str, str]]], bool]
    ) -> _Target | web.Response:
        """What the sign-in is for, once `proven` says the parameters are the server's own
        for this session: the device page's user code (its proof stands for the page's
        throttled check of the code, so no code is looked up before it holds), the account
        page, else an authorization request, validated again (PageError, RedirectError)."""
        if "user_code" in params.values:
            code = user_codes.normalise(params.values["user_code"])
            carried = [("user_code", code)] if code else []
            if (
                self.device is None
                or not carried
                or params.repeated
                or set(params.values) != {"user_code"}
                or not proven(carried)
            ):
                return self._expired()
            assert code is not None
            found = await self.device.pending_code(code)
            if found is None:
                return self.device.pages.error(400, "This code cannot be used", DEVICE_GONE)
            record, client = found
            return _ForDevice(self.device, self.sessions, code, client, record)
        if "account" in params.values:
            carried = sorted(params.values.items())
            if self.account is None or params.repeated or carried != ACCOUNT_CARRIED:
                return self._expired()
            if not proven(carried):
                return self._expired()
            return _ForAccount(self.account)
        auth = await self.authorize.validate(params)
        if not proven(auth.carried()):
            return self._expired()
        return _ForAuthorization(self.authorize, auth)

    def _expired(self) -> web.Response:
        return self.authorize.pages.error(
            403,
            "Your session expired",
            "Please go back to the application and try again.",
            "csrf",
        )

    def _to_provider(
        self,
        provider: Provider,
        metadata: Metadata,
        session: Session,
        target: _Target,
    ) -> web.Response:
        """Step 3: the redirect to the provider, the pending sign-in sealed beside it. A
        client's `prompt=login` and `max_age` go to the provider too: the sign-in it asked
        for happens there (checked on the way back, `signed_in_at`)."""
        carried = target.carried
        verifier = secrets.token_urlsafe(48)
        pending = Pending(
            state=secrets.token_urlsafe(32),
            nonce=secrets.token_urlsafe(32),
            verifier=verifier,
            carried=carried,
            expires_at=self.clock() + PENDING_LIFETIME,
        )
        location = with_query(
            metadata.authorization_endpoint,
            {
                "response_type": "code",
                "client_id": provider.client_id,
                "redirect_uri": self.redirect_uri(provider.name),
                "scope": " ".join(provider.scopes),
                "state": pending.state,
                "nonce": pending.nonce,
                "code_challenge": pkce.s256(verifier),
                "code_challenge_method": "S256",
                **({"prompt": "login"} if target.login_forced else {}),
                **({"max_age": str(target.max_age)} if target.max_age is not None else {}),
            },
        )
        response = web.Response(
            status=302, headers={"Location": location, "Cache-Control": "no-store"}
        )
        response.set_cookie(
            self.cookie,
            seal(session, provider.name, pending),
            path="/",
            httponly=True,
            samesite="Lax",  # sent on the provider's top-level redirect back
            secure=self.secure,
            max_age=int(PENDING_LIFETIME),
        )
        return response

    async def callback(self, request: web.Request) -> web.StreamResponse:
        upstream = self.upstreams.get(request.match_info["name"])
        if upstream is None:
            raise web.HTTPNotFound()
        provider = upstream.provider
        try:
            params = Parameters.collect(query_items(request))
        except OAuthError as exc:
            return self.authorize.pages.error(
                400,
                "This sign-in cannot be completed",
                f"The response is malformed: {exc.description}.",
            )
        session = await self.sessions.current(request)
        value = request.cookies.get(self.cookie)
        now = self.clock()
        pending = unseal(session, provider.name, value, now) if session and value else None
        if pending is None:
            log.warning(
                "federated sign-in refused",
                extra={"provider": provider.name, "reason": "no_pending_sign_in"},
            )
            return self._cleared(
                self.authorize.pages.error(
                    400,
                    "This sign-in cannot be completed",
                    "It was not started in this browser, or it took too long. "
                    "Go back to the application and sign in again.",
                )
            )
        try:
            # Sealed by this server for this session: its own parameters already.
            target = await self._target(Parameters.collect(pending.carried), lambda _: True)
        except PageError as exc:
            return self._cleared(
                self.authorize.pages.error(
                    400, "This sign-in request cannot be handled", exc.message
                )
            )
        except RedirectError as exc:
            return self._cleared(self.authorize.error_redirect(request, exc))
        if isinstance(target, web.Response):
            return self._cleared(target)
        try:
            signed_in = await self._verified_subject(upstream, params, pending, now, target)
        except FederationRefused as refused:
            log.warning(
                "federated sign-in refused",
                extra={"provider": provider.name, "reason": refused.reason},
            )
            return self._cleared(
                await target.refused(
                    request,
                    f"Signing in with {provider.display_name} failed. {refused.message}",
                    400,
                )
            )
        except ProviderUnavailable as exc:
            log.warning(
                "federated sign-in unavailable",
                extra={"provider": provider.name, "reason": exc.reason},
            )
            message = _unreachable(provider, self.password_sign_in)
            return self._cleared(await target.refused(request, message, 502))
        assert session is not None
        log.info(
            "federated sign-in", extra={"provider": provider.name, "outcome": signed_in.outcome}
        )
        address = client_address(self.authorize.passwords.addresses, request)
        if signed_in.outcome == "created":
            audit.record(Event.USER_CREATED, audit.SERVER, subject=signed_in.subject)
        elif signed_in.outcome == "linked":
            audit.record(
                Event.IDENTITY_LINKED,
                audit.SERVER,
                subject=signed_in.subject,
                reason=provider.name,
            )
        elif signed_in.updated:
            audit.record(
                Event.USER_UPDATED,
                audit.SERVER,
                subject=signed_in.subject,
                reason=f"provider:{provider.name}",
            )
        if Method.MULTIPLE not in signed_in.amr and await self.authorize.has_second_factor(
            signed_in.subject
        ):
            # The user has a second factor here (an app or a passkey) and the provider did
            # not say it asked for one: the second step follows, as after a password.
            first = FirstStep(signed_in.amr, signed_in.auth_time)
            return self._cleared(await target.code_step(request, session, signed_in.subject, first))
        audit.record(
            Event.SIGNIN_SUCCEEDED,
            audit.USER,
            subject=signed_in.subject,
            address=address,
            reason=f"provider:{provider.name}",
        )
        new_session = await self.sessions.login(
            request, signed_in.subject, signed_in.amr, signed_in.auth_time
        )
        response = await target.signed_in(request, new_session)
        self.sessions.set_cookie(response, new_session)
        return self._cleared(response)

    async def _verified_subject(
        self,
        upstream: Upstream,
        params: Parameters,
        pending: Pending,
        now: float,
        target: _Target,
    ) -> SignedIn:
        provider = upstream.provider
        given_state = params.values.get("state", "")
        if params.repeated or not hmac.compare_digest(given_state.encode(), pending.state.encode()):
            raise FederationRefused(
                "state_mismatch", "The response does not belong to this sign-in."
            )
        if not await self.store.use_jti(
            "federation:" + provider.name, pending.state, pending.expires_at, now
        ):
            raise FederationRefused("state_replayed", "This response was used already.")
        metadata = await upstream.metadata()
        rules.check_response_issuer(
            params.values.get("iss"), provider.issuer, metadata.iss_supported
        )
        if "error" in params.values:
            raise FederationRefused("provider_error", "The provider did not sign you in.")
        code = params.values.get("code")
        if not code:
            raise FederationRefused("no_code", "The response carries no code.")
        tokens = await upstream.exchange(code, pending.verifier, self.redirect_uri(provider.name))
        claims = await self._id_token_claims(upstream, metadata, tokens["id_token"])
        provider_subject = rules.check_id_token_claims(
            claims, Expected(provider.issuer, provider.client_id, pending.nonce, self.clock())
        )
        if metadata.userinfo_endpoint and rules.missing_claims(claims, provider.claims):
            # OIDC Core §5.4: a provider may release the scopes' claims at userinfo only.
            access_token = tokens.get("access_token")
            if isinstance(access_token, str):
                given = await upstream.userinfo(metadata.userinfo_endpoint, access_token)
                claims = rules.with_userinfo(claims, given, provider_subject)
        # Before any user is made or linked: a sign-in the client forced must have happened.
        auth_time = rules.signed_in_at(
            claims,
            self.clock(),
            started_at=pending.expires_at - PENDING_LIFETIME,
            login_forced=target.login_forced,
            max_age=target.max_age,
        )
        signed_in = await self.accounts.sign_in(provider, provider_subject, claims)
        methods = rules.provider_methods(claims.get("amr")) or (assurance.EXTERNAL,)
        return replace(signed_in, amr=methods, auth_time=auth_time)

    async def _id_token_claims(
        self, upstream: Upstream, metadata: Metadata, token: str
    ) -> dict[str, Any]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise FederationRefused(
                "malformed_id_token", "The provider's ID token is malformed."
            ) from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in metadata.algorithms:
            raise FederationRefused(
                "id_token_alg",
                "The provider's ID token is signed with an algorithm it does not advertise.",
            )
        kid = header.get("kid")
        key = await upstream.key(kid if isinstance(kid, str) else None, alg)
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                options={
                    "verify_aud": False,
                    "verify_iss": False,
                    "verify_exp": False,
                    "verify_iat": False,
                    "verify_nbf": False,
                },
            )
        except jwt.PyJWTError:
            raise FederationRefused(
                "id_token_signature", "The provider's ID token has no valid signature."
            ) from None
        return claims

    def _cleared(self, response: web.StreamResponse) -> web.StreamResponse:
        response.del_cookie(
            self.cookie, path="/", secure=self.secure, httponly=True, samesite="Lax"
        )
        return response


def _unreachable(provider: Provider, password_sign_in: bool) -> str:
    instead = "Sign in with your password, or try" if password_sign_in else "Try"
    return f"{provider.display_name} cannot be reached right now. {instead} again in a moment."


# ---------------------------------------------------------------------------- what it is for


class _Target(Protocol):
    """What a federated sign-in is for, and where it goes on: the items its pending sign-in
    carries, the fresh sign-in it asks of the provider, the page that tells of a refusal,
    the code step for a user with an app here, and what comes once it is signed in."""

    @property
    def carried(self) -> list[tuple[str, str]]: ...
    @property
    def login_forced(self) -> bool: ...
    @property
    def max_age(self) -> int | None: ...

    async def refused(self, request: web.Request, message: str, status: int) -> web.Response: ...

    async def code_step(
        self, request: web.Request, session: Session, subject: str, first: FirstStep
    ) -> web.Response: ...

    async def signed_in(self, request: web.Request, session: Session) -> web.Response: ...


@dataclass(frozen=True)
class _ForAuthorization:
    """An authorization request: its sign-in page, its code step, then consent or the code."""

    endpoint: AuthorizationEndpoint
    auth: AuthorizationRequest

    @property
    def carried(self) -> list[tuple[str, str]]:
        return self.auth.carried()

    @property
    def login_forced(self) -> bool:
        return "login" in self.auth.prompt

    @property
    def max_age(self) -> int | None:
        return self.auth.max_age

    async def refused(self, request: web.Request, message: str, status: int) -> web.Response:
        return await self.endpoint.login_page(request, self.auth, error=message, status=status)

    async def code_step(
        self, request: web.Request, session: Session, subject: str, first: FirstStep
    ) -> web.Response:
        return await self.endpoint.code_page(request, self.auth, session, subject, first=first)

    async def signed_in(self, request: web.Request, session: Session) -> web.Response:
        try:
            return await self.endpoint.proceed(request, self.auth, session, login_done=True)
        except RedirectError as exc:
            return self.endpoint.error_redirect(request, exc)


@dataclass(frozen=True)
class _ForDevice:
    """The device page's user code (RFC 8628 §3.3): its sign-in form, its code step, then
    the device's consent page for that code, which the whole flow carried."""

    pages: DevicePages
    sessions: Sessions
    code: str
    client: Client
    record: DeviceRecord

    @property
    def carried(self) -> list[tuple[str, str]]:
        return [("user_code", self.code)]

    login_forced = False  # the device page asks for no fresh sign-in
    max_age = None

    async def refused(self, request: web.Request, message: str, status: int) -> web.Response:
        session = await self.sessions.ensure(request)
        return self.pages.login_page(session, self.client, self.code, error=message, status=status)

    async def code_step(
        self, request: web.Request, session: Session, subject: str, first: FirstStep
    ) -> web.Response:
        return await self.pages.second_step_page(session, self.client, self.code, subject, first)

    async def signed_in(self, request: web.Request, session: Session) -> web.Response:
        return await self.pages.signed_in(session, self.client, self.record)


@dataclass(frozen=True)
class _ForAccount:
    """The account page's own sign-in: its sign-in form, its second step, then the page."""

    pages: AccountPages

    @property
    def carried(self) -> list[tuple[str, str]]:
        return list(ACCOUNT_CARRIED)

    login_forced = False
    # The page's changes to factors need a sign-in this recent (its auth_time), and a user
    # who has no password here can make no other proof: OIDC Core §3.1.2.1, the provider
    # signs the user in again when its own sign-in is older, and its ID token must say so.
    max_age = int(ENROLMENT_NEEDS_SIGN_IN_WITHIN.total_seconds())

    async def refused(self, request: web.Request, message: str, status: int) -> web.Response:
        return await self.pages.sign_in_page(request, error=message, status=status)

    async def code_step(
        self, request: web.Request, session: Session, subject: str, first: FirstStep
    ) -> web.Response:
        return await self.pages.code_page(session, subject, first=first)

    async def signed_in(self, request: web.Request, session: Session) -> web.Response:
        return self.pages.signed_in()
