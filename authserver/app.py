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
from portcullis.http import json_response

from .endpoints import authorize, discovery, introspect, logout, revoke, token, userinfo
from .endpoints.common import SERVICES, Services, page_environment
from .grants.authorization_code import AuthorizationCode
from .grants.base import GrantContext, Registry
from .grants.client_credentials import ClientCredentials
from .grants.refresh_token import RefreshToken
from .keys import KeyRing
from .sessions import Sessions
from .settings import Settings
from .store import open_store
from .store.base import Store
from .tokens import Minter

log = logging.getLogger("portcullis.authserver")

PURGE_EVERY = 300.0  # seconds


def build_app(settings: Settings) -> web.Application:
    app = web.Application(client_max_size=1024 * 1024)
    base = urlsplit(settings.issuer).path.rstrip("/")

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        store = open_store(settings.storage)
        await store.open()
        keyring = KeyRing(settings.keys.dir)
        keyring.load([settings.keys.access_token_alg, *settings.id_token_algs])
        minter = Minter(settings, keyring)
        context = GrantContext(settings, store, minter)
        registry = Registry(
            [AuthorizationCode(context), ClientCredentials(context), RefreshToken(context)]
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
        )
        app[discovery.DISCOVERY] = discovery.Document(
            discovery.metadata(settings, registry.names()), max_age=3600
        )
        purger = asyncio.create_task(_purge(store, keyring))
        yield
        purger.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await purger
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
    r.add_route("GET", base + "/logout", logout.logout)
    r.add_route("POST", base + "/logout", logout.logout)
    r.add_get(base + "/healthz", _healthz)
    r.add_static(base + "/static", Path(__file__).resolve().parent / "static", append_version=False)
    return app


async def _healthz(_: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def _purge(store: Store, keyring: KeyRing) -> None:
    """Delete expired rows, and retired keys once every token they signed has expired."""
    while True:
        await asyncio.sleep(PURGE_EVERY)
        try:
            now = time.time()
            removed = await store.purge_expired(now)
            log.info("expired rows purged", extra={"rows": removed})
            gone = keyring.purge(now)
            if gone:
                log.info("retired keys removed", extra={"kids": gone})
        except Exception:
            log.exception("purge failed")


async def serve(settings: Settings) -> None:
    app = build_app(settings)
    await runtime.serve(
        [runtime.Listener(app, settings.listen.host, settings.listen.port, "authserver")],
        grace=timedelta(seconds=10),
    )
