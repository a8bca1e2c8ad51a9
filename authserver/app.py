"""Composition root of the authorization server: store, key ring, grants, routes, listeners.

Only this module names a concrete store (through `store.open_store`).

`AuthServer` holds what lives as long as the process (the store, the key ring, the
password-hashing pool, metrics, the pages) and the `Components` built from the configuration
in force: the registry of clients and users, the grants, the endpoints, the discovery
document and the CORS policy. Endpoints never see either: each is given the few parts it
uses, and the values it reads from the configuration, never a section of it (the functions
under "the parts' terms" turn the sections that need more than a field read). SIGHUP
reloads the configuration file: a valid one becomes new `Components`, swapped in at once
(`Live`), so a request finishes on the configuration it started with; login sessions and
everything else in the store stay valid. The file's clients and users are
seeds written to the store (registry.seed), at start before serving, and on a reload right
after the swap. An invalid one changes nothing: its
problems are logged and the old configuration serves on. Settings bound to what was opened
at start (listen addresses, storage, issuer, keys, the password-hashing pool) keep their old
values until a restart, with a warning.

Two listeners: the public one (`listen`) and the admin one (`admin_listen`) with /healthz,
/readyz and /metrics, for probes and scrapers that the public network need not reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from portcullis import runtime
from portcullis.addresses import ClientAddresses
from portcullis.http import json_response
from portcullis.tls import RotatingCertificate
from portcullis.yamlconf import ConfigError, Withheld

from . import accesslog, audit, cors, registry
from . import settings as settings_module
from .accesslog import AccessLog, AccessLogOptions, Exchange
from .admin.access import AdminAccess
from .admin.api import PREFIX as ADMIN_PREFIX
from .admin.api import AdminApi
from .admin.context import Context as AdminContext
from .clients import ClientAuthenticator, assertion_audiences
from .clock import Clock
from .dpop import NonceMaker, ProofChecker
from .endpoints import discovery
from .endpoints.account import AccountPages
from .endpoints.authorize import AuthorizationEndpoint
from .endpoints.device import CodeGuesses, DevicePages
from .endpoints.device_authorization import DeviceAuthorizationEndpoint
from .endpoints.errors import Handler, json_errors_of
from .endpoints.introspect import IntrospectionEndpoint
from .endpoints.logout import LogoutEndpoint
from .endpoints.pages import Pages, page_environment
from .endpoints.passkey_offers import PasskeyOffers
from .endpoints.passkeys import PasskeyCheck, PasskeyPages
from .endpoints.registration import RegistrationEndpoint
from .endpoints.revoke import RevocationEndpoint
from .endpoints.second_factor import FactorPages, issuer_label
from .endpoints.signin import CodeCheck, LoginRules, PasswordCheck, SignInServices
from .endpoints.token import TokenEndpoint
from .endpoints.userinfo import UserInfoEndpoint
from .events import EventStream, Reason, Revocations, SignedEvents
from .factors import Requirement, SecondFactors
from .federation import Federation, SignInLinks
from .grants.authorization_code import AuthorizationCode
from .grants.base import Registry
from .grants.client_credentials import ClientCredentials
from .grants.device_code import DeviceCode
from .grants.issuance import RefreshLifetimes, TokenIssuer
from .grants.refresh_token import RefreshToken
from .keys import Event, KeyRing, SigningRing
from .metadata_documents import DocumentFetcher, MetadataDocuments
from .metrics import CONTENT_TYPE, Metrics
from .passkeys import Passkeys
from .protocol.cors import CorsPolicy
from .resource_tokens import AccessTokens, ResourceTokens
from .sessions import Sessions
from .settings import (
    BACKOFF_FIRST_DELAY,
    DpopSettings,
    LoginThrottle,
    Settings,
    StoragePool,
    rotation_policy,
)
from .store import open_store
from .store.base import AlreadyExists, PoolLimits, Store, StoreUnavailable
from .stored_keys import KeyCipher, KeyDecryptionError, StoredKeyRing
from .tokens import Minter
from .users import PasswordHasher

log = logging.getLogger("portcullis.authserver")
T = TypeVar("T")

PURGE_EVERY = timedelta(minutes=5)
SHUTDOWN_GRACE = timedelta(seconds=10)
# /readyz waits this long for the store to answer; a store slower than this is not ready.
STORE_PING_TIMEOUT = timedelta(seconds=2)

# Settings bound to what was opened at start: a change is reported and waits for a restart.
_RESTART_ONLY: dict[str, Callable[[Settings], object]] = {
    "listen": lambda s: s.listen,
    "admin_listen": lambda s: s.admin_listen,
    "storage": lambda s: s.storage,
    "storage_pool": lambda s: s.storage_pool,
    "issuer": lambda s: s.issuer,
    "keys": lambda s: s.keys,
    "password_hashing": lambda s: s.password_hashing,
    "access_log": lambda s: s.request_log,
}


@dataclass(frozen=True)
class Components:
    """What requests are served with, built from one configuration and replaced whole by a
    reload. The store, key ring and hasher are the process's, the same in every one."""

    settings: Settings
    store: Store
    keyring: SigningRing
    minter: Minter
    hasher: PasswordHasher
    cors: CorsPolicy  # which browser pages may read which answers
    addresses: ClientAddresses  # who a request is from, through trusted proxies
    document: discovery.Document  # the metadata document
    jwks: discovery.Jwks
    token: TokenEndpoint
    introspection: IntrospectionEndpoint
    revocation: RevocationEndpoint
    device_authorization: DeviceAuthorizationEndpoint
    userinfo: UserInfoEndpoint
    authorize: AuthorizationEndpoint
    federation: Federation | None  # /federation/..., with identity_providers
    device: DevicePages
    factors: FactorPages  # /factors: setting up an authenticator app (or a passkey)
    logout: LogoutEndpoint
    account: AccountPages  # /account: the signed-in user's grants, sessions and password
    passkeys: PasskeyPages  # /login/passkey, /account/passkeys: signing in with a passkey
    events: EventStream  # GET /revocation_events
    registration: RegistrationEndpoint | None  # /register, when registration.enabled
    # Revoking every token of a subject or client at once (users disabled, clients deleted).
    revocations: Revocations
    admin: AdminApi


@dataclass
class Live:
    """The Components in force. A configuration reload replaces `components` whole; a
    request reads it once, when it starts, and finishes on what it got."""

    components: Components | None = None  # None until the server has started

    def current(self) -> Components:
        if self.components is None:
            raise RuntimeError("the authorization server has not started")
        return self.components


LIVE = web.AppKey("live", Live)


class AuthServer:
    """One authorization server process: the store, the key ring, the password-hashing pool
    and metrics for its whole life, and the Components in force (`live`), replaced whole by
    a reload."""

    def __init__(self, settings: Settings, clock: Clock = time.time) -> None:
        self.settings = settings
        self.clock = clock
        self.metrics = Metrics()
        log_settings = settings.request_log
        self.access_log = (
            AccessLog(AccessLogOptions(log_settings.output, log_settings.flush_interval))
            if log_settings.enabled
            else None
        )
        self.live = Live()
        self.draining = False
        self.base = urlsplit(settings.issuer).path.rstrip("/")
        self.pages = Pages(page_environment(), self.base + "/static")
        self._store: Store | None = None
        self._keyring: SigningRing | None = None
        self._hasher: PasswordHasher | None = None
        self._signed_events: SignedEvents | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self.event_followers: set[asyncio.Task[Any]] = set()  # open revocation event streams
        self._reload_lock = asyncio.Lock()

    # ------------------------------------------------------------------ lifetime

    async def open(self) -> None:
        """Open the store and the key ring, then serve the configuration; StartupError with
        one line when either cannot be used."""
        settings, clock = self.settings, self.clock
        store = open_store(
            settings.storage, pool_limits(settings.storage_pool), self.metrics.store_call
        )
        try:
            await store.open()
        except Exception as exc:
            raise runtime.StartupError(
                f"cannot open the store {_redacted(settings.storage)}: {_why(exc)}"
            ) from exc
        keyring = key_ring(settings, store, clock)
        try:
            _log_key_events(await keyring.start(settings.signing_algs))
        except Exception as exc:
            await store.close()
            what = keyring.where if settings.keys.dir else f"the signing keys in {keyring.where}"
            raise runtime.StartupError(f"cannot use {what}: {_why(exc)}") from exc
        try:
            await _seed(store, settings, clock, cut_off=False)
        except Exception as exc:
            await store.close()
            raise runtime.StartupError(
                f"cannot write the configured clients and users to the store: {_why(exc)}"
            ) from exc
        hashing = settings.password_hashing
        self._store, self._keyring = store, keyring
        self._signed_events = SignedEvents(
            keyring, settings.keys.access_token_alg, settings.issuer, clock
        )
        self._hasher = PasswordHasher(hashing.workers, hashing.max_waiting)
        self.live.components = self._components(settings)
        self._tasks = [
            asyncio.create_task(_purge(store, clock)),
            asyncio.create_task(_watch_keys(keyring, clock, settings.keys.reload_every)),
        ]

    async def close(self) -> None:
        for task in [*self._tasks, *self._background]:
            task.cancel()
        for task in [*self._tasks, *self._background]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._hasher is not None:
            self._hasher.close()
        if self._store is not None:
            await self._store.close()
        if self.access_log is not None:
            self.access_log.close()
        audit.LINES.flush()

    def _components(self, settings: Settings) -> Components:
        """Everything a request uses that the configuration decides, built from `settings`."""
        store, keyring, hasher = self._store, self._keyring, self._hasher
        signed_events = self._signed_events
        assert store is not None and keyring is not None and hasher is not None
        assert signed_events is not None
        clock, metrics, pages, base = self.clock, self.metrics, self.pages, self.base
        issuer = settings.issuer
        audiences = settings_module.protected_resources(settings)
        # Read from the store at every lookup: a change made through the admin API, by any
        # replica, is in force at the next request.
        stored_clients = registry.StoredClients(
            store, clock, self_registered_scopes=settings_module.offered_scopes(settings)
        )
        users = registry.StoredUsers(store)
        revocations = Revocations(store, clock, settings.lifetimes.access_token)
        # With metadata document clients, their URLs are clients too (fetched when named).
        documents = (
            MetadataDocuments(
                store=store,
                stored=stored_clients,
                fetcher=DocumentFetcher(
                    settings_module.document_rules(settings.client_id_metadata_documents)
                ),
                policy=settings_module.document_policy(settings),
                revocations=revocations,
                metrics=metrics,
                clock=clock,
            )
            if settings.client_id_metadata_documents.enabled
            else None
        )
        clients: registry.ClientRegistry = documents or stored_clients
        minter = token_minter(settings, keyring)
        lifetimes = settings.lifetimes
        issuer_of_tokens = TokenIssuer(
            minter, RefreshLifetimes(lifetimes.refresh_token_idle, lifetimes.refresh_token_absolute)
        )
        grants = Registry(
            [
                AuthorizationCode(store, users, issuer_of_tokens),
                ClientCredentials(minter, audiences),
                RefreshToken(
                    store,
                    users,
                    issuer_of_tokens,
                    settings.refresh_grace.total_seconds(),
                    metrics,
                    audiences,
                ),
                DeviceCode(store, users, issuer_of_tokens),
            ]
        )
        authenticator = ClientAuthenticator(
            clients,
            store,
            issuer,
            settings.client_assertion_max_lifetime,
            clock,
            assertion_audiences(issuer, issuer + "/token", settings.client_assertion_audience),
        )
        access_tokens = AccessTokens(
            keyring, settings.keys.access_token_alg, issuer, store, clients, users
        )
        admin_url = issuer + ADMIN_PREFIX
        proofs = proof_checker(settings.dpop, store, clock, metrics)
        # The one check of a token presented to this server's own resources.
        resource_tokens = ResourceTokens(access_tokens, proofs)
        addresses = ClientAddresses(settings.trusted_proxies)
        sessions = Sessions(
            store,
            users,
            secure=settings.secure_cookies,
            lifetime=settings.lifetimes.session,
            addresses=addresses,
            clock=clock,
        )
        passwords = PasswordCheck(
            store, users, hasher, login_rules(settings.login_throttle), addresses, clock, metrics
        )
        factors = second_factors(settings, store, clock, metrics)
        codes = CodeCheck(
            store, factors, login_rules(settings.login_throttle), addresses, clock, metrics
        )
        requirement = Requirement(
            settings.second_factors.required_for_everyone,
            frozenset(settings.second_factors.required_for_roles),
        )
        passkeys = Passkeys(store, issuer, clock)
        passkey_offers = PasskeyOffers(passkeys=passkeys, users=users, base_path=base, clock=clock)
        providers = settings_module.federation_providers(settings)
        sign_in_links = SignInLinks(tuple((p.name, p.display_name) for p in providers), base)
        sign_in = SignInServices(
            store=store,
            clients=clients,
            users=users,
            sessions=sessions,
            pages=pages,
            passwords=passwords,
            codes=codes,
            factors=factors,
            requirement=requirement,
            scope_description=settings.scope_description,
            base_path=base,
            clock=clock,
            sign_in_links=sign_in_links,
            passkeys=passkey_offers,
            password_sign_in=settings.password_sign_in,
        )
        device = DevicePages(
            sign_in,
            guesses=CodeGuesses(
                per_session=settings.device.max_failures,
                per_address=settings.device.max_failures_per_address,
                window=settings.device.window,
            ),
            addresses=addresses,
            audiences=audiences,
        )
        authorize = AuthorizationEndpoint(
            sign_in,
            issuer=issuer,
            audiences=audiences,
            code_lifetime=settings.lifetimes.authorization_code.total_seconds(),
            documents=documents,
        )
        account = AccountPages(sign_in, hasher=hasher)
        federation = (
            Federation(
                providers,
                authorize=authorize,
                sessions=sessions,
                store=store,
                issuer=issuer,
                base_path=base,
                secure=settings.secure_cookies,
                clock=clock,
                metrics=metrics,
                device=device,
                account=account,
                password_sign_in=settings.password_sign_in,
            )
            if providers
            else None
        )
        return Components(
            settings=settings,
            store=store,
            keyring=keyring,
            minter=minter,
            hasher=hasher,
            cors=cors.policy(settings.clients, settings.cors.allow_origins),
            addresses=addresses,
            document=discovery.Document(
                discovery.metadata(
                    issuer,
                    [scope.name for scope in settings.scopes],
                    settings.id_token_algs,
                    grants.names(),
                    registration_endpoint=(
                        issuer + "/register" if settings.registration.enabled else None
                    ),
                    metadata_documents=documents is not None,
                ),
                max_age=3600,
            ),
            jwks=discovery.Jwks(keyring, math.ceil(settings.keys.jwks_max_age.total_seconds())),
            token=TokenEndpoint(
                grants,
                authenticator,
                issuer + "/token",
                clock,
                metrics,
                proofs,
                keep_client=store.client_used,
            ),
            introspection=IntrospectionEndpoint(
                authenticator, access_tokens, store, issuer, issuer + "/introspect", clock
            ),
            revocation=RevocationEndpoint(
                authenticator, access_tokens, store, issuer + "/revoke", clock
            ),
            device_authorization=DeviceAuthorizationEndpoint(
                authenticator,
                store,
                audiences=audiences,
                lifetime=settings.lifetimes.device_code,
                interval=settings.device.interval,
                verification_uri=issuer + "/device",
                url=issuer + "/device_authorization",
                clock=clock,
            ),
            userinfo=UserInfoEndpoint(resource_tokens, users, issuer + "/userinfo"),
            authorize=authorize,
            federation=federation,
            device=device,
            factors=FactorPages(
                factors=factors,
                users=users,
                sessions=sessions,
                pages=pages,
                base_path=base,
                clock=clock,
                passkeys=passkey_offers,
            ),
            logout=LogoutEndpoint(
                clients=clients,
                users=users,
                sessions=sessions,
                pages=pages,
                keyring=keyring,
                issuer=issuer,
                id_token_algs=settings.id_token_algs,
                base_path=base,
            ),
            account=account,
            passkeys=PasskeyPages(
                passkeys=passkeys,
                check=PasskeyCheck(
                    passkeys,
                    store,
                    users,
                    login_rules(settings.login_throttle),
                    addresses,
                    clock,
                    metrics,
                ),
                users=users,
                sessions=sessions,
                pages=pages,
                authorize=authorize,
                account=account,
                device=device,
                factors=factors,
                base_path=base,
                clock=clock,
            ),
            events=EventStream(
                authenticator,
                store,
                signed_events,
                issuer + "/revocation_events",
                clock,
                heartbeat=settings.revocation_events.heartbeat,
                poll_interval=settings.revocation_events.poll_interval,
                followers=self.event_followers,
            ),
            revocations=revocations,
            registration=(
                RegistrationEndpoint(
                    store=store,
                    policy=settings_module.registration_policy(settings),
                    rate=settings_module.registration_cap(settings.registration),
                    addresses=addresses,
                    revocations=revocations,
                    url=issuer + "/register",
                    clock=clock,
                )
                if settings.registration.enabled
                else None
            ),
            admin=AdminApi(
                AdminContext(
                    store=store,
                    clock=clock,
                    known_scopes=settings.known_scopes,
                    signing_algs=tuple(settings.signing_algs),
                    access_token_alg=settings.keys.access_token_alg,
                    hasher=hasher,
                    keyring=keyring,
                    base_url=admin_url,
                    revocations=revocations,
                    metrics=metrics,
                ),
                AdminAccess(resource_tokens, users, admin_url),
                base + ADMIN_PREFIX,
            ),
        )

    # ------------------------------------------------------------------ readiness

    async def not_ready(self) -> dict[str, str]:
        """Why this process should not get traffic; empty when ready."""
        current = self.live.components
        if current is None:
            return {"authserver": "starting"}
        reasons: dict[str, str] = {}
        try:
            async with asyncio.timeout(STORE_PING_TIMEOUT.total_seconds()):
                await current.store.ping()
        except TimeoutError:
            reasons["store"] = (
                f"no answer within {STORE_PING_TIMEOUT.total_seconds():g}s (busy or unreachable)"
            )
        except Exception as exc:
            reasons["store"] = f"unreachable: {_why(exc)}"
        missing = []
        for alg in current.settings.signing_algs:
            try:
                current.keyring.active(alg)
            except LookupError:
                missing.append(alg)
        if missing:
            reasons["keys"] = f"no signing key for {', '.join(missing)} in {current.keyring.where}"
        stale = current.keyring.stale(self.clock())
        if stale is not None:
            reasons["keys"] = stale
        if self.draining:
            reasons["authserver"] = "shutting down"
        return reasons

    # ------------------------------------------------------------------ reload

    async def reload(self) -> bool:
        """Read and validate the file again; when valid, serve it from now on."""
        async with self._reload_lock:
            path = self.settings.file
            if self._keyring is None:
                return self._rejected(path, "the server is still starting")
            try:
                # Plain-text passwords are hashed while loading: off the event loop.
                new = await asyncio.to_thread(settings_module.load, path)
            except ConfigError as exc:
                for problem in exc.problems:
                    log.error(str(problem), extra={"event": "config_problem"})
                return self._rejected(path, f"{len(exc.problems)} problem(s) in the file")
            new = self._keep_restart_only(new)
            keyring = self._keyring
            added = [alg for alg in new.signing_algs if alg not in self.settings.signing_algs]
            try:
                if added:  # a client registered an ID token algorithm nothing signed with yet
                    _log_key_events(await keyring.start(added))
            except Exception as exc:
                return self._rejected(path, f"cannot add signing keys: {_why(exc)}")
            # Built before anything is changed; then the swap: nothing awaited until it is done.
            components = self._components(new)
            keyring.policy = rotation_policy(new)
            if new.log_level != self.settings.log_level:
                logging.getLogger().setLevel(new.log_level.upper())
            self.settings = new
            self.live.components = components
            self.metrics.reloaded(True)
            log.info("config reloaded", extra={"file": path})
            # Then the file's clients and users into the store. After the swap, not before:
            # the store may be busy (a request in flight holding a lock), and the reload
            # must not wait for it. Until this is done they are as the file had them before.
            try:
                assert self._store is not None
                await _seed(self._store, new, self.clock)
            except (AlreadyExists, StoreUnavailable) as exc:
                log.error(
                    "the configured clients and users could not be written to the store;"
                    " they stay as they were until the next reload or restart",
                    extra={"reason": str(exc)},
                )
            return True

    def _rejected(self, path: str, why: str) -> bool:
        log.error(
            "config reload rejected; the previous configuration keeps serving",
            extra={"file": path, "reason": why},
        )
        self.metrics.reloaded(False)
        return False

    def _keep_restart_only(self, new: Settings) -> Settings:
        """`new` with the settings only a restart can change taken from the running ones."""
        old = self.settings
        for name, read in _RESTART_ONLY.items():
            if read(old) != read(new):
                log.warning(
                    "a changed setting takes effect only after a restart",
                    extra={"setting": name},
                )
        # Subjects derived from the issuer stay those the running issuer derives, as it is kept.
        return replace(
            new,
            listen=old.listen,
            admin_listen=old.admin_listen,
            storage=old.storage,
            storage_pool=old.storage_pool,
            issuer=old.issuer,
            keys=old.keys,
            password_hashing=old.password_hashing,
        )

    def request_reload(self) -> None:
        """For SIGHUP: start a reload without waiting for it."""
        self._in_background(self._reload_logged())

    async def _reload_logged(self) -> None:
        try:
            await self.reload()
        except Exception:
            log.exception("config reload failed")

    def _in_background(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _seed(store: Store, settings: Settings, clock: Clock, *, cut_off: bool = True) -> None:
    """The configuration's clients and users into the store; on a reload, those it dropped
    are cut off too. At start they are only removed (their tokens end with them: nothing
    finds them any more): replicas starting together on one database may derive other
    subjects from their issuers, and must not cut each other's users off."""
    removed_clients, removed_users = await registry.seed(
        store, settings.clients, [(u, settings.subject_of(u)) for u in settings.users], clock()
    )
    if not cut_off:
        for removed in (*removed_clients, *removed_users):
            log.info("removed from the configuration", extra={"id": removed})
        return
    revocations = Revocations(store, clock, settings.lifetimes.access_token)
    for client_id in removed_clients:
        log.info("client removed from the configuration", extra={"client_id": client_id})
        await revocations.cut_off_client(client_id, Reason.UNCONFIGURED)
    for subject in removed_users:
        log.info("user removed from the configuration", extra={"subject": subject})
        await revocations.cut_off_subject(subject, Reason.UNCONFIGURED)


def _why(error: BaseException) -> str:
    if isinstance(error, KeyDecryptionError):
        return str(error)
    if isinstance(error, OSError):
        return runtime.reason(error)
    return str(error) or type(error).__name__


def _redacted(url: str) -> str:
    """A storage URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(":" + parts.password + "@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


# ---------------------------------------------------------------------------- the parts' terms
# The running parts are given values and records of their own, never a settings section:
# these turn the sections that need more than a field read into them.


def pool_limits(pool: StoragePool) -> PoolLimits:
    """`storage_pool`, as the store takes it."""
    return PoolLimits(
        min_size=pool.min_size,
        max_size=pool.max_size,
        connect_timeout=pool.connect_timeout,
        command_timeout=pool.command_timeout,
        acquire_timeout=pool.acquire_timeout,
        migration_timeout=pool.migration_timeout,
    )


def token_minter(settings: Settings, keyring: SigningRing) -> Minter:
    return Minter(
        keyring,
        issuer=settings.issuer,
        access_alg=settings.keys.access_token_alg,
        id_alg=settings.keys.id_token_alg,
        access_lifetime=settings.lifetimes.access_token,
        id_lifetime=settings.lifetimes.id_token,
    )


def proof_checker(dpop: DpopSettings, store: Store, clock: Clock, metrics: Metrics) -> ProofChecker:
    nonces = None
    if dpop.nonce:
        if not dpop.nonce_key:  # the settings refuse this: never serve without nonces
            raise ValueError("dpop.nonce needs dpop.nonce_key")
        nonces = NonceMaker(str(dpop.nonce_key).encode(), dpop.nonce_lifetime.total_seconds())
    return ProofChecker(
        store, clock, metrics, max_age=dpop.proof_max_age, leeway=dpop.leeway, nonces=nonces
    )


def second_factors(
    settings: Settings, store: Store, clock: Clock, metrics: Metrics
) -> SecondFactors:
    """Authenticator apps, sealed with second_factors.encryption_key (or keys')."""
    secret = settings.second_factor_key
    cipher = (
        KeyCipher.from_setting(secret)
        if secret is not None and not isinstance(secret, Withheld)
        else None
    )
    return SecondFactors(store, cipher, issuer_label(settings.issuer), clock, metrics)


def login_rules(throttle: LoginThrottle) -> LoginRules:
    """`login_throttle`, as the login forms' password check takes it."""
    return LoginRules(
        max_failures=throttle.max_failures,
        max_failures_per_address=throttle.max_failures_per_address,
        window=throttle.window,
        backoff_after=throttle.backoff_after,
        backoff_first=BACKOFF_FIRST_DELAY,
        backoff_max=throttle.backoff_max,
    )


async def _without_server_field(_: web.Request, response: web.StreamResponse) -> None:
    """No Server field on any answer (aiohttp adds `Python/… aiohttp/…`): the software and
    its version are nothing a client needs, and a list to look vulnerabilities up by."""
    response.headers.popall("Server", None)


async def _answer_fields(request: web.Request, response: web.StreamResponse) -> None:
    """The public listener's answers: no Server field, and the request's id (accesslog.py),
    streamed answers included (they are prepared inside their handler)."""
    response.headers.popall("Server", None)
    exchange = accesslog.CURRENT.get()
    if exchange is not None:
        response.headers[accesslog.REQUEST_ID_HEADER] = exchange.request_id


def build_app(
    settings: Settings, server: AuthServer | None = None, *, clock: Clock = time.time
) -> web.Application:
    """The public application; `server` (made from `settings` and `clock` when not given)
    is opened when the application starts and closed when it is cleaned up."""
    server = server or AuthServer(settings, clock)
    live = server.live
    app = web.Application(client_max_size=1024 * 1024, middlewares=[_observed(server)])
    app.on_response_prepare.append(_answer_fields)
    app[LIVE] = live
    base = server.base

    async def lifecycle(_: web.Application) -> AsyncIterator[None]:
        await server.open()
        yield
        await server.close()

    app.cleanup_ctx.append(lifecycle)

    async def end_streams(_: web.Application) -> None:
        # Event streams never end by themselves: ended here, before the server waits for
        # the requests in flight.
        for task in list(server.event_followers):
            task.cancel()

    app.on_shutdown.append(end_streams)

    def json(pick: Callable[[Components], Handler]) -> Handler:
        return json_errors_of(lambda: pick(live.current()))

    def page(pick: Callable[[Components], Handler]) -> Handler:
        return server.pages.guard(_current(live, pick))

    document = _current(live, lambda c: c.document.respond)
    # Each route is named: the name is the `endpoint` label of the request metrics.
    r = app.router
    r.add_get(base + "/.well-known/openid-configuration", document, name="discovery")
    r.add_get(base + "/.well-known/oauth-authorization-server", document, name="oauth_metadata")
    if base:
        # RFC 8414 §3.1: for an issuer with a path, the well-known segment comes first. The
        # OpenID form with the path inserted (RFC 8414 §5) is the second of the locations an
        # MCP client tries (MCP authorization, "Authorization Server Metadata Discovery").
        r.add_get(
            "/.well-known/oauth-authorization-server" + base,
            document,
            name="oauth_metadata_path_first",
        )
        r.add_get(
            "/.well-known/openid-configuration" + base,
            document,
            name="discovery_path_first",
        )
    r.add_get(base + "/jwks", _current(live, lambda c: c.jwks.respond), name="jwks")
    authorize = page(lambda c: c.authorize.authorize)
    r.add_route("GET", base + "/authorize", authorize, name="authorize")
    r.add_route("POST", base + "/authorize", authorize, name="authorize")
    r.add_post(base + "/login", page(lambda c: c.authorize.login), name="login")
    r.add_post(base + "/login/code", page(lambda c: c.authorize.login_code), name="login_code")
    r.add_get(
        base + "/federation/{name}/start",
        page(lambda c: _federation(c).start),
        name="federation_start",
    )
    r.add_get(
        base + "/federation/{name}/callback",
        page(lambda c: _federation(c).callback),
        name="federation_callback",
    )
    r.add_post(base + "/consent", page(lambda c: c.authorize.consent), name="consent")
    r.add_get(base + "/factors", page(lambda c: c.factors.show), name="factors")
    r.add_post(base + "/factors/totp", page(lambda c: c.factors.begin), name="factors_totp")
    r.add_post(
        base + "/factors/totp/confirm",
        page(lambda c: c.factors.confirm),
        name="factors_totp_confirm",
    )
    r.add_post(base + "/token", json(lambda c: c.token.handle), name="token")
    userinfo = json(lambda c: c.userinfo.handle)
    r.add_route("GET", base + "/userinfo", userinfo, name="userinfo")
    r.add_route("POST", base + "/userinfo", userinfo, name="userinfo")
    r.add_post(base + "/introspect", json(lambda c: c.introspection.handle), name="introspect")
    r.add_post(base + "/revoke", json(lambda c: c.revocation.handle), name="revoke")
    r.add_get(
        base + "/revocation_events", json(lambda c: c.events.handle), name="revocation_events"
    )
    r.add_post(
        base + "/device_authorization",
        json(lambda c: c.device_authorization.handle),
        name="device_authorization",
    )
    r.add_post(base + "/register", json(lambda c: _registration(c).register), name="register")
    registered = base + "/register/{client_id}"
    r.add_get(registered, json(lambda c: _registration(c).read), name="registered_client")
    r.add_delete(registered, json(lambda c: _registration(c).delete), name="registered_client")
    r.add_get(base + "/device", page(lambda c: c.device.device_page), name="device")
    r.add_post(base + "/device", page(lambda c: c.device.check_code), name="device")
    r.add_post(base + "/device/login", page(lambda c: c.device.login), name="device_login")
    r.add_post(
        base + "/device/login/code", page(lambda c: c.device.login_code), name="device_login_code"
    )
    r.add_post(
        base + "/device/login/passkey",
        page(lambda c: c.passkeys.device_sign_in),
        name="device_login_passkey",
    )
    r.add_post(base + "/device/consent", page(lambda c: c.device.consent), name="device_consent")
    logout = page(lambda c: c.logout.handle)
    r.add_route("GET", base + "/logout", logout, name="logout")
    r.add_route("POST", base + "/logout", logout, name="logout")
    r.add_get(base + "/account", page(lambda c: c.account.show), name="account")
    r.add_post(base + "/account/login", page(lambda c: c.account.login), name="account_login")
    r.add_post(
        base + "/account/login/code",
        page(lambda c: c.account.login_code),
        name="account_login_code",
    )
    r.add_post(
        base + "/account/apps/revoke", page(lambda c: c.account.revoke), name="account_revoke"
    )
    r.add_post(base + "/login/passkey", page(lambda c: c.passkeys.sign_in), name="login_passkey")
    r.add_post(
        base + "/account/login/passkey",
        page(lambda c: c.passkeys.account_sign_in),
        name="account_login_passkey",
    )
    r.add_post(
        base + "/account/passkeys", page(lambda c: c.passkeys.create), name="account_passkeys"
    )
    r.add_post(
        base + "/account/passkeys/remove",
        page(lambda c: c.passkeys.remove),
        name="account_passkeys_remove",
    )
    r.add_post(
        base + "/account/sessions/end",
        page(lambda c: c.account.end_sessions),
        name="account_sessions",
    )
    r.add_post(
        base + "/account/password",
        page(lambda c: c.account.change_password),
        name="account_password",
    )
    r.add_post(
        base + "/account/factors/recovery-codes",
        page(lambda c: c.account.renew_recovery_codes),
        name="account_recovery_codes",
    )
    r.add_post(
        base + "/account/factors/totp/remove",
        page(lambda c: c.account.remove_factor),
        name="account_factor_remove",
    )
    admin = _current(live, lambda c: c.admin.handle)
    r.add_route("*", base + ADMIN_PREFIX + "{tail:(/.*)?}", admin, name="admin")
    r.add_get(base + "/healthz", _healthz, name="healthz")
    r.add_static(
        base + "/static",
        Path(__file__).resolve().parent / "static",
        append_version=False,
        name="static",
    )
    return app


def _federation(components: Components) -> Federation:
    """The federation routes in force; 404 without identity_providers."""
    if components.federation is None:
        raise web.HTTPNotFound()
    return components.federation


def _registration(components: Components) -> RegistrationEndpoint:
    """The registration endpoint in force; 404 while registration is not enabled."""
    if components.registration is None:
        raise web.HTTPNotFound(
            text='{"error":"not_found","error_description":"registration is not enabled"}',
            content_type="application/json",
        )
    return components.registration


def _current(live: Live, pick: Callable[[Components], Handler]) -> Handler:
    """A handler that serves each request with the handler `pick` chooses from the
    Components in force when the request starts."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await pick(live.current())(request)

    return handle


def _observed(server: AuthServer) -> Middleware:
    """Middleware that gives each request its id, and counts, times and logs (when the
    access log is on) every answer by route. The request's state lives in a context
    variable (accesslog.py): each request is served in a task of its own, so it is the
    request's alone and is still there when the answer is prepared."""
    metrics, access_log, live = server.metrics, server.access_log, server.live
    perf_counter = time.perf_counter
    cors_paths = cors.endpoints(server.base)  # answered by cors.answer, preflights included

    @web.middleware
    async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = perf_counter()
        exchange = Exchange(
            accesslog.request_id_of(request.headers.get(accesslog.REQUEST_ID_HEADER))
        )
        accesslog.CURRENT.set(exchange)
        status = 500
        try:
            endpoint = cors_paths.get(request.path)
            components = live.components
            if endpoint is None or components is None:  # None: not serving yet
                response = await handler(request)
            else:
                response = await cors.answer(components.cors, endpoint, request, handler)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away before the answer
            raise
        finally:
            finished = perf_counter()
            route = request.match_info.route
            # A path no route serves has a system route without a name.
            name = route.name or "unmatched"
            metrics.request(name, status)
            metrics.request_time(name, route, request.method, status, finished - started)
            if access_log is not None:
                components = live.components
                peer = request.remote
                access_log.record(
                    exchange,
                    client=(
                        components.addresses.client(
                            peer, request.headers.getall("X-Forwarded-For", ())
                        )
                        if components is not None
                        else peer or "unknown"
                    ),
                    method=request.method,
                    raw_path=request.raw_path,
                    route=name,
                    status=status,
                    started=started,
                    finished=finished,
                )

    return observe


def admin_app(server: AuthServer) -> web.Application:
    """/healthz (the process answers), /readyz (it can serve: store, keys, not draining) and
    /metrics, on the admin listener."""

    async def healthz(_: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        reasons = await server.not_ready()
        if reasons:
            return json_response({"status": "not_ready", "reasons": reasons}, status=503)
        return json_response({"status": "ready"})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=server.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE}
        )

    app = web.Application()
    app.on_response_prepare.append(_without_server_field)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


async def _healthz(_: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def _purge(store: Store, clock: Clock) -> None:
    """Delete expired rows."""
    while True:
        await asyncio.sleep(PURGE_EVERY.total_seconds())
        try:
            removed = await store.purge_expired(clock())
            log.info("expired rows purged", extra={"rows": removed})
        except StoreUnavailable as exc:
            log.warning("purge postponed: the store is unavailable", extra={"reason": str(exc)})
        except Exception:
            # A bug: logged with its traceback; the loop goes on so that it is not silent.
            log.exception("purge failed")


async def _watch_keys(keyring: SigningRing, clock: Clock, every: timedelta) -> None:
    """Pick up keys other processes wrote (another replica, `keys rotate`) and write the
    transitions that are due: activation, retirement, removal, automatic rotation."""
    outage = runtime.Outage()
    while True:
        await asyncio.sleep(every.total_seconds())
        try:
            _log_key_events(await keyring.tick(clock()))
        except StoreUnavailable as exc:
            if outage.failed():
                log.warning(
                    "key ring check postponed: the store is unavailable",
                    extra={"reason": str(exc), "failures": outage.failures},
                )
            continue
        except Exception:
            log.exception("key ring check failed")
            continue
        if (failures := outage.succeeded()) is not None:
            log.info("key ring check resumed", extra={"failures": failures})


def key_ring(settings: Settings, store: Store | None, clock: Clock = time.time) -> SigningRing:
    """The key ring the settings name: in the storage (no keys.dir), else in the directory."""
    keys, policy = settings.keys, rotation_policy(settings)
    if keys.dir is not None:
        return KeyRing(keys.dir, policy, clock=clock)
    if store is None:
        raise ValueError("a key ring kept in the storage needs the store")
    secret = keys.encryption_key
    cipher = (
        KeyCipher.from_setting(secret)
        if secret is not None and not isinstance(secret, Withheld)
        else None
    )
    return StoredKeyRing(store, cipher, policy, clock)


async def with_key_ring(settings: Settings, work: Callable[[SigningRing], Awaitable[T]]) -> T:
    """For `keys rotate` and `keys list`: the configured key ring, with the store open when
    the ring is kept there, given to `work`."""
    if settings.keys.dir is not None:
        return await work(key_ring(settings, None))
    store = open_store(settings.storage, pool_limits(settings.storage_pool))
    await store.open()
    try:
        return await work(key_ring(settings, store))
    finally:
        await store.close()


def _log_key_events(events: list[Event]) -> None:
    for event in events:
        log.info("signing key " + event.what, extra={"kid": event.kid, "alg": event.alg})


async def serve(settings: Settings) -> None:
    """Serve until SIGTERM, then drain; SIGHUP reloads the configuration file. With `tls`,
    the public listener serves TLS and follows its certificate files."""
    server = AuthServer(settings)
    certificate = RotatingCertificate(settings.tls) if settings.tls is not None else None
    await runtime.serve(
        [
            runtime.Listener(
                build_app(settings, server),
                settings.listen.host,
                settings.listen.port,
                "public",
                certificate,
                # Counted by status as an endpoint of their own (no route read them).
                refused=lambda status: server.metrics.request("unparsable", status),
            ),
            runtime.Listener(
                admin_app(server), settings.admin_listen.host, settings.admin_listen.port, "admin"
            ),
        ],
        grace=SHUTDOWN_GRACE,
        on_draining=lambda: setattr(server, "draining", True),
        on_reload=server.request_reload,
        started=_freeze_startup_objects,
    )


async def _freeze_startup_objects() -> None:
    """Leave what start-up built (modules, settings, the store, keys, routes: the objects
    that live as long as the process) out of the garbage collector's passes. Its full
    passes otherwise walk them all again every few thousand requests, which under load was
    a few percent of the token endpoint's CPU. Their memory is theirs for good anyway. The
    youngest generation is collected less often too, as in the gateway
    (runtime.settle_memory)."""
    runtime.settle_memory()


async def migrate(settings: Settings) -> None:
    """`portcullis-authserver migrate`: apply the storage's pending migrations, then close it.
    A server applies them at start too; this lets a deployment do it once, beforehand."""
    store = open_store(settings.storage, pool_limits(settings.storage_pool))
    try:
        await store.open()
    except Exception as exc:
        # Wrong credentials, an unknown database, a migration refused or timed out: one line
        # for the operator, as when a server cannot open the store (`--debug`: traceback).
        raise runtime.StartupError(
            f"cannot migrate the store {_redacted(settings.storage)}: {_why(exc)}"
        ) from exc
    await store.close()
