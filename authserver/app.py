"""Composition root of the authorization server: store, key ring, grants, routes.

Only this module names a concrete store (through `store.open_store`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from portcullis import runtime
from portcullis.addresses import ClientAddresses
from portcullis.http import json_response

from .endpoints import (
    authorize,
    device,
    device_authorization,
    discovery,
    introspect,
    logout,
    revoke,
    token,
    userinfo,
)
from .endpoints.common import SERVICES, Services, page_environment
from .grants.authorization_code import AuthorizationCode
from .grants.base import GrantContext, Registry
from .grants.client_credentials import ClientCredentials
from .grants.device_code import DeviceCode
from .grants.refresh_token import RefreshToken
from .keys import CHECK_EVERY, Event, KeyRing, RotationPolicy, jwks_cache_control
from .sessions import Sessions
from .settings import Settings
from .store import open_store
from .store.base import Store
from .tokens import Minter

log = logging.getLogger("portcullis.authserver")

PURGE_EVERY = timedelta(minutes=5)


def build_app(settings: Settings) -> web.Application:
    app = web.Application(client_max_size=1024 * 1024)
    base = urlsplit(settings.issuer).path.rstrip("/")

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        store = open_store(settings.storage)
        await store.open()
        keyring = KeyRing(settings.keys.dir, RotationPolicy.from_settings(settings))
        _log_key_events(keyring.load(settings.signing_algs))
        minter = Minter(settings, keyring)
        context = GrantContext(settings, store, minter)
        registry = Registry(
            [
                AuthorizationCode(context),
                ClientCredentials(context),
                RefreshToken(context),
                DeviceCode(context),
            ]
        )
        app[SERVICES] = Services(
            settings=settings,
            store=store,
            keyring=keyring,
            minter=minter,
            grants=registry,
            sessions=Sessions(settings, store),
            pages=page_environment(),
            base_path=base,
            addresses=ClientAddresses(settings.trusted_proxies),
        )
        app[discovery.DISCOVERY] = discovery.Document(
            discovery.metadata(settings, registry.names()), max_age=3600
        )
        app[discovery.JWKS_CACHE_CONTROL] = jwks_cache_control(settings)
        tasks = [asyncio.create_task(_purge(store)), asyncio.create_task(_watch_keys(keyring))]
        yield
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await store.close()

    app.cleanup_ctx.append(lifecycle)
    r = app.router
    r.add_get(base + "/.well-known/openid-configuration", discovery.discovery)
    r.add_get(base + "/.well-known/oauth-authorization-server", discovery.discovery)
    if base:
        # RFC 8414 §3.1: for an issuer with a path, the well-known segment comes first.
        r.add_get("/.well-known/oauth-authorization-server" + base, discovery.discovery)
    r.add_get(base + "/jwks", discovery.jwks)
    r.add_route("GET", base + "/authorize", authorize.authorize)
    r.add_route("POST", base + "/authorize", authorize.authorize)
    r.add_post(base + "/login", authorize.login)
    r.add_post(base + "/consent", authorize.consent)
    r.add_post(base + "/token", token.token)
    r.add_route("GET", base + "/userinfo", userinfo.userinfo)
    r.add_route("POST", base + "/userinfo", userinfo.userinfo)
    r.add_post(base + "/introspect", introspect.introspect)
    r.add_post(base + "/revoke", revoke.revoke)
    r.add_post(base + "/device_authorization", device_authorization.device_authorization)
    r.add_get(base + "/device", device.device_page)
    r.add_post(base + "/device", device.check_code)
    r.add_post(base + "/device/login", device.login)
    r.add_post(base + "/device/consent", device.consent)
    r.add_route("GET", base + "/logout", logout.logout)
    r.add_route("POST", base + "/logout", logout.logout)
    r.add_get(base + "/healthz", _healthz)
    r.add_static(base + "/static", Path(__file__).resolve().parent / "static", append_version=False)
    return app


async def _healthz(_: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def _purge(store: Store) -> None:
    """Delete expired rows."""
    while True:
        await asyncio.sleep(PURGE_EVERY.total_seconds())
        try:
            removed = await store.purge_expired(time.time())
            log.info("expired rows purged", extra={"rows": removed})
        except Exception:
            log.exception("purge failed")


async def _watch_keys(keyring: KeyRing) -> None:
    """Pick up keys other processes wrote (`keys rotate`) and write the transitions that are
    due: activation, retirement, removal, automatic rotation. In a worker thread: it reads
    files, may wait for another process's lock, and generating an RSA key takes a while."""
    while True:
        await asyncio.sleep(CHECK_EVERY.total_seconds())
        try:
            _log_key_events(await asyncio.to_thread(keyring.check, time.time()))
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
