"""Composition root of the authorization server: store, key ring, grants, routes.

Only this module names a concrete store (through `store.open_store`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from portcullis import runtime
from portcullis.addresses import ClientAddresses
from portcullis.http import json_response

from . import registry
from .clients import ClientAuthenticator
from .clock import Clock
from .endpoints import discovery
from .endpoints.authorize import AuthorizationEndpoint
from .endpoints.device import DevicePages
from .endpoints.device_authorization import DeviceAuthorizationEndpoint
from .endpoints.errors import json_errors
from .endpoints.introspect import IntrospectionEndpoint
from .endpoints.logout import LogoutEndpoint
from .endpoints.pages import Pages, page_environment
from .endpoints.resource_tokens import AccessTokens
from .endpoints.revoke import RevocationEndpoint
from .endpoints.signin import PasswordCheck
from .endpoints.token import TokenEndpoint
from .endpoints.userinfo import UserInfoEndpoint
from .grants.authorization_code import AuthorizationCode
from .grants.base import Registry
from .grants.client_credentials import ClientCredentials
from .grants.device_code import DeviceCode
from .grants.issuance import TokenIssuer
from .grants.refresh_token import RefreshToken
from .keys import CHECK_EVERY, Event, KeyRing, RotationPolicy, jwks_cache_control
from .sessions import Sessions
from .settings import Settings
from .store import open_store
from .store.base import Store, StoreUnavailable
from .tokens import Minter
from .users import PasswordHasher

log = logging.getLogger("portcullis.authserver")

PURGE_EVERY = timedelta(minutes=5)


@dataclass(frozen=True)
class Components:
    """What the composition root built and owns the lifetime of. Endpoints never see this:
    each is given the few parts it uses."""

    settings: Settings
    store: Store
    keyring: KeyRing
    minter: Minter
    hasher: PasswordHasher


COMPONENTS = web.AppKey("components", Components)


def build_app(settings: Settings, *, clock: Clock = time.time) -> web.Application:
    app = web.Application(client_max_size=1024 * 1024)
    base = urlsplit(settings.issuer).path.rstrip("/")
    issuer = settings.issuer
    default_audience = settings.default_audience or settings.issuer

    store = open_store(settings.storage)
    keyring = KeyRing(settings.keys.dir, RotationPolicy.from_settings(settings), clock=clock)
    minter = Minter(settings, keyring)
    hasher = PasswordHasher(
        settings.password_hashing.workers, settings.password_hashing.max_waiting
    )
    clients, users = registry.from_settings(settings)
    components = Components(settings, store, keyring, minter, hasher)
    app[COMPONENTS] = components

    issuer_of_tokens = TokenIssuer(minter, settings.lifetimes)
    grants = Registry(
        [
            AuthorizationCode(store, users, issuer_of_tokens),
            ClientCredentials(minter, default_audience),
            RefreshToken(store, users, issuer_of_tokens, settings.refresh_grace.total_seconds()),
            DeviceCode(store, users, issuer_of_tokens),
        ]
    )
    authenticator = ClientAuthenticator(clients, store, issuer, clock)
    access_tokens = AccessTokens(keyring, settings.keys.access_token_alg, issuer, store)
    sessions = Sessions(settings, store, users, clock)
    pages = Pages(page_environment(), base + "/static")
    passwords = PasswordCheck(
        store,
        users,
        hasher,
        settings.login_throttle,
        ClientAddresses(settings.trusted_proxies),
        clock,
    )
    token = TokenEndpoint(grants, authenticator, issuer + "/token", clock)
    introspection = IntrospectionEndpoint(
        authenticator, access_tokens, store, issuer, issuer + "/introspect", clock
    )
    revocation = RevocationEndpoint(authenticator, access_tokens, store, issuer + "/revoke", clock)
    device_authorization = DeviceAuthorizationEndpoint(
        authenticator,
        store,
        default_audience=default_audience,
        lifetime=settings.lifetimes.device_code,
        interval=settings.device.interval,
        verification_uri=issuer + "/device",
        url=issuer + "/device_authorization",
        clock=clock,
    )
    userinfo = UserInfoEndpoint(access_tokens, users)
    authorize = AuthorizationEndpoint(
        clients=clients,
        users=users,
        store=store,
        sessions=sessions,
        pages=pages,
        passwords=passwords,
        issuer=issuer,
        default_audience=default_audience,
        code_lifetime=settings.lifetimes.authorization_code.total_seconds(),
        scope_description=settings.scope_description,
        base_path=base,
        clock=clock,
    )
    device = DevicePages(
        store=store,
        clients=clients,
        users=users,
        sessions=sessions,
        pages=pages,
        passwords=passwords,
        settings=settings.device,
        addresses=ClientAddresses(settings.trusted_proxies),
        scope_description=settings.scope_description,
        base_path=base,
        clock=clock,
    )
    logout = LogoutEndpoint(
        clients=clients,
        users=users,
        sessions=sessions,
        pages=pages,
        keyring=keyring,
        issuer=issuer,
        id_token_algs=settings.id_token_algs,
        base_path=base,
    )
    document = discovery.Document(discovery.metadata(settings, grants.names()), max_age=3600)
    jwks = discovery.Jwks(keyring, jwks_cache_control(settings))

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await store.open()
        try:
            _log_key_events(keyring.load(settings.signing_algs))
        except BaseException:
            await store.close()
            raise
        tasks = [
            asyncio.create_task(_purge(store, clock)),
            asyncio.create_task(_watch_keys(keyring, clock)),
        ]
        yield
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        hasher.close()
        await store.close()

    app.cleanup_ctx.append(lifecycle)
    page = pages.guard
    r = app.router
    r.add_get(base + "/.well-known/openid-configuration", document.respond)
    r.add_get(base + "/.well-known/oauth-authorization-server", document.respond)
    if base:
        # RFC 8414 §3.1: for an issuer with a path, the well-known segment comes first.
        r.add_get("/.well-known/oauth-authorization-server" + base, document.respond)
    r.add_get(base + "/jwks", jwks.respond)
    r.add_route("GET", base + "/authorize", page(authorize.authorize))
    r.add_route("POST", base + "/authorize", page(authorize.authorize))
    r.add_post(base + "/login", page(authorize.login))
    r.add_post(base + "/consent", page(authorize.consent))
    r.add_post(base + "/token", json_errors(token.handle))
    r.add_route("GET", base + "/userinfo", json_errors(userinfo.handle))
    r.add_route("POST", base + "/userinfo", json_errors(userinfo.handle))
    r.add_post(base + "/introspect", json_errors(introspection.handle))
    r.add_post(base + "/revoke", json_errors(revocation.handle))
    r.add_post(base + "/device_authorization", json_errors(device_authorization.handle))
    r.add_get(base + "/device", page(device.device_page))
    r.add_post(base + "/device", page(device.check_code))
    r.add_post(base + "/device/login", page(device.login))
    r.add_post(base + "/device/consent", page(device.consent))
    r.add_route("GET", base + "/logout", page(logout.handle))
    r.add_route("POST", base + "/logout", page(logout.handle))
    r.add_get(base + "/healthz", _healthz)
    r.add_static(base + "/static", Path(__file__).resolve().parent / "static", append_version=False)
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


async def _watch_keys(keyring: KeyRing, clock: Clock) -> None:
    """Pick up keys other processes wrote (`keys rotate`) and write the transitions that are
    due: activation, retirement, removal, automatic rotation. In a worker thread: it reads
    files, may wait for another process's lock, and generating an RSA key takes a while."""
    while True:
        await asyncio.sleep(CHECK_EVERY.total_seconds())
        try:
            _log_key_events(await asyncio.to_thread(keyring.check, clock()))
        except Exception:
            log.exception("key ring check failed")


def _log_key_events(events: list[Event]) -> None:
    for event in events:
        log.info("signing key " + event.what, extra={"kid": event.kid, "alg": event.alg})


async def serve(settings: Settings) -> None:
    app = build_app(settings)
    await runtime.serve(
        [runtime.Listener(app, settings.listen.host, settings.listen.port, "authserver")],
        grace=timedelta(seconds=10),
    )
