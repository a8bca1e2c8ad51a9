"""Composition root of the authorization server: store, key ring, grants, routes, listeners.

Only this module names a concrete store (through `store.open_store`).

`AuthServer` holds what lives as long as the process (the store, the key ring, metrics) and
the configuration it serves, as one `Services` value. SIGHUP reloads the configuration file:
a valid one becomes a new `Services`, swapped in at once, so a request finishes on the
configuration it started with; login sessions and everything else in the store stay valid.
An invalid one changes nothing: its problems are logged and the old configuration serves on.
Settings bound to what was opened at start (listen addresses, storage, issuer, keys) keep
their old values until a restart, with a warning.

Two listeners: the public one (`listen`) and the admin one (`admin_listen`) with /healthz,
/readyz and /metrics, for probes and scrapers that the public network need not reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from portcullis import runtime
from portcullis.addresses import ClientAddresses
from portcullis.http import json_response
from portcullis.tls import RotatingCertificate
from portcullis.yamlconf import ConfigError

from . import cors
from . import settings as settings_module
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
from .endpoints.common import LIVE, Live, Services, page_environment
from .grants.authorization_code import AuthorizationCode
from .grants.base import GrantContext, Registry
from .grants.client_credentials import ClientCredentials
from .grants.device_code import DeviceCode
from .grants.refresh_token import RefreshToken
from .keys import CHECK_EVERY, Event, KeyRing, RotationPolicy, jwks_cache_control
from .metrics import CONTENT_TYPE, Metrics, timed_store
from .sessions import Sessions
from .settings import Settings
from .store import open_store
from .store.base import Store
from .tokens import Minter

log = logging.getLogger("portcullis.authserver")

PURGE_EVERY = timedelta(minutes=5)
SHUTDOWN_GRACE = timedelta(seconds=10)
# /readyz waits this long for the store to answer; a store slower than this is not ready.
STORE_PING_TIMEOUT = timedelta(seconds=2)

# Settings bound to what was opened at start: a change is reported and waits for a restart.
_RESTART_ONLY: dict[str, Callable[[Settings], object]] = {
    "listen": lambda s: s.listen,
    "admin_listen": lambda s: s.admin_listen,
    "storage": lambda s: s.storage,
    "issuer": lambda s: s.issuer,
    "keys": lambda s: s.keys,
}


class AuthServer:
    """One authorization server process: the store, the key ring and metrics for its whole
    life, and the Services in force (`live`), replaced whole by a reload."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.live = Live()
        self.draining = False
        self._base = urlsplit(settings.issuer).path.rstrip("/")
        self._pages = page_environment()
        self._store: Store | None = None
        self._keyring: KeyRing | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._reload_lock = asyncio.Lock()

    # ------------------------------------------------------------------ lifetime

    async def open(self) -> None:
        """Open the store and the key ring, then serve the configuration; StartupError with
        one line when either cannot be used."""
        settings = self.settings
        store = timed_store(open_store(settings.storage), self.metrics)
        try:
            await store.open()
        except Exception as exc:
            raise runtime.StartupError(
                f"cannot open the store {_redacted(settings.storage)}: {_why(exc)}"
            ) from exc
        keyring = KeyRing(settings.keys.dir, RotationPolicy.from_settings(settings))
        try:
            _log_key_events(await asyncio.to_thread(keyring.load, settings.signing_algs))
        except Exception as exc:
            await store.close()
            raise runtime.StartupError(
                f"cannot use the key directory {settings.keys.dir}: {_why(exc)}"
            ) from exc
        self._store, self._keyring = store, keyring
        self.live.services = self._services(settings)
        self._tasks = [
            asyncio.create_task(_purge(store)),
            asyncio.create_task(_watch_keys(keyring)),
        ]

    async def close(self) -> None:
        for task in [*self._tasks, *self._background]:
            task.cancel()
        for task in [*self._tasks, *self._background]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._store is not None:
            await self._store.close()

    def _services(self, settings: Settings) -> Services:
        """Everything a request uses that the configuration decides, built from `settings`."""
        assert self._store is not None and self._keyring is not None
        minter = Minter(settings, self._keyring)
        context = GrantContext(settings, self._store, minter, self.metrics)
        registry = Registry(
            [
                AuthorizationCode(context),
                ClientCredentials(context),
                RefreshToken(context),
                DeviceCode(context),
            ]
        )
        return Services(
            settings=settings,
            store=self._store,
            keyring=self._keyring,
            minter=minter,
            grants=registry,
            sessions=Sessions(settings, self._store),
            pages=self._pages,
            base_path=self._base,
            addresses=ClientAddresses(settings.trusted_proxies),
            metrics=self.metrics,
            discovery=discovery.Document(
                discovery.metadata(settings, registry.names()), max_age=3600
            ),
            cors=cors.policy(settings),
        )

    # ------------------------------------------------------------------ readiness

    async def not_ready(self) -> dict[str, str]:
        """Why this process should not get traffic; empty when ready."""
        svc = self.live.services
        if svc is None:
            return {"authserver": "starting"}
        reasons: dict[str, str] = {}
        try:
            async with asyncio.timeout(STORE_PING_TIMEOUT.total_seconds()):
                await svc.store.ping()
        except TimeoutError:
            reasons["store"] = (
                f"no answer within {STORE_PING_TIMEOUT.total_seconds():g}s (busy or unreachable)"
            )
        except Exception as exc:
            reasons["store"] = f"unreachable: {_why(exc)}"
        missing = []
        for alg in svc.settings.signing_algs:
            try:
                svc.keyring.active(alg)
            except LookupError:
                missing.append(alg)
        if missing:
            reasons["keys"] = f"no signing key for {', '.join(missing)} in {svc.keyring.dir}"
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
                    _log_key_events(await asyncio.to_thread(keyring.load, added))
            except Exception as exc:
                return self._rejected(path, f"cannot add signing keys: {_why(exc)}")
            # The swap: nothing awaited from here on.
            keyring.policy = RotationPolicy.from_settings(new)
            if new.log_level != self.settings.log_level:
                logging.getLogger().setLevel(new.log_level.upper())
            self.settings = new
            self.live.services = self._services(new)
            self.metrics.reloaded(True)
            log.info("config reloaded", extra={"file": path})
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
            issuer=old.issuer,
            keys=old.keys,
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


def _why(error: BaseException) -> str:
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


def build_app(settings: Settings, server: AuthServer | None = None) -> web.Application:
    """The public application; `server` (made from `settings` when not given) is opened
    when the application starts and closed when it is cleaned up."""
    server = server or AuthServer(settings)
    app = web.Application(client_max_size=1024 * 1024, middlewares=[_counted(server.metrics)])
    app[LIVE] = server.live
    app[discovery.JWKS_CACHE_CONTROL] = jwks_cache_control(settings)
    base = urlsplit(settings.issuer).path.rstrip("/")
    live = server.live
    # Preflights are answered there, before routing.
    app.middlewares.append(
        cors.middleware(lambda: live.services.cors if live.services else None, base)
    )

    async def lifecycle(_: web.Application) -> AsyncIterator[None]:
        await server.open()
        yield
        await server.close()

    app.cleanup_ctx.append(lifecycle)
    # Each route is named: the name is the `endpoint` label of the request metrics.
    r = app.router
    r.add_get(base + "/.well-known/openid-configuration", discovery.discovery, name="discovery")
    r.add_get(
        base + "/.well-known/oauth-authorization-server",
        discovery.discovery,
        name="oauth_metadata",
    )
    if base:
        # RFC 8414 §3.1: for an issuer with a path, the well-known segment comes first.
        r.add_get(
            "/.well-known/oauth-authorization-server" + base,
            discovery.discovery,
            name="oauth_metadata_path_first",
        )
    r.add_get(base + "/jwks", discovery.jwks, name="jwks")
    r.add_route("GET", base + "/authorize", authorize.authorize, name="authorize")
    r.add_route("POST", base + "/authorize", authorize.authorize, name="authorize")
    r.add_post(base + "/login", authorize.login, name="login")
    r.add_post(base + "/consent", authorize.consent, name="consent")
    r.add_post(base + "/token", token.token, name="token")
    r.add_route("GET", base + "/userinfo", userinfo.userinfo, name="userinfo")
    r.add_route("POST", base + "/userinfo", userinfo.userinfo, name="userinfo")
    r.add_post(base + "/introspect", introspect.introspect, name="introspect")
    r.add_post(base + "/revoke", revoke.revoke, name="revoke")
    r.add_post(
        base + "/device_authorization",
        device_authorization.device_authorization,
        name="device_authorization",
    )
    r.add_get(base + "/device", device.device_page, name="device")
    r.add_post(base + "/device", device.check_code, name="device")
    r.add_post(base + "/device/login", device.login, name="device_login")
    r.add_post(base + "/device/consent", device.consent, name="device_consent")
    r.add_route("GET", base + "/logout", logout.logout, name="logout")
    r.add_route("POST", base + "/logout", logout.logout, name="logout")
    r.add_get(base + "/healthz", _healthz, name="healthz")
    r.add_static(
        base + "/static",
        Path(__file__).resolve().parent / "static",
        append_version=False,
        name="static",
    )
    return app


def _counted(metrics: Metrics) -> Middleware:
    """Middleware counting every answer by route name and status."""

    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away before the answer
            raise
        finally:
            # A path no route serves has a system route without a name.
            metrics.request(request.match_info.route.name or "unmatched", status)

    return count


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
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
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
            ),
            runtime.Listener(
                admin_app(server), settings.admin_listen.host, settings.admin_listen.port, "admin"
            ),
        ],
        grace=SHUTDOWN_GRACE,
        on_draining=lambda: setattr(server, "draining", True),
        on_reload=server.request_reload,
    )
