"""Composition root of the gateway: everything built once from settings, and the one handler.

The request path of one configuration is `pipeline.Pipeline` (match, certificate, extract,
verify, decide, limit, forward); this module chooses and builds what each step runs: the verifier
(`verifiers.dispatch.build`), the rate limiter and its backend, the forwarder.

`Gateway` holds what lives as long as the process: connection pools, metrics, the access log,
and per issuer the key set and introspection cache, which a reload keeps while that issuer's
settings stay the same. A reload builds a new Pipeline and swaps it in whole: a request
keeps the pipeline it started with, and what only the old one used is closed once its last
request is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import ssl
import time
import weakref
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from resource import RLIM_INFINITY, RLIMIT_NOFILE, getrlimit, setrlimit
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import HttpVersion11, RawRequestMessage
from yarl import URL

from portcullis import runtime, tls
from portcullis.aiohttp_private import HeadSettlingRequest, RefusingConnection, http11_if_unparsable
from portcullis.http import field_limit, json_response, unparsable, unparsable_status
from portcullis.yamlconf import ConfigError

from . import adapter, extauthz
from . import settings as settings_module
from .core.clock import SYSTEM_CLOCK, Clock
from .core.dpop import MemoryReplayCache, ReplayCache
from .core.exchange import EXT_AUTHZ, Exchange
from .forward import LEFT_OUT, Forwarder, Upstream
from .ops.accesslog import AccessLog
from .ops.metrics import (
    CONTENT_TYPE,
    IssuerCounts,
    Metrics,
    ProcessMetrics,
    SharedMetrics,
    StateCounts,
)
from .settings import IssuerSettings, Settings
from .steps import errors
from .steps.pipeline import LastToken, Pipeline, Resource
from .steps.ratelimit import Buckets, Limiter, buckets_for
from .steps.replay import RedisReplayCache
from .steps.revocations import Revocations
from .transport import framing, tracecontext
from .transport.capacity import BodiesInFlight, Slots
from .transport.upstream_client import Origin, UpstreamClient
from .verifiers import dispatch
from .verifiers.cache import TokenCache
from .verifiers.introspection import Introspector
from .verifiers.jwks import KeySet, keys_session

log = logging.getLogger("portcullis.gateway")

_MAX_LINGERING = timedelta(seconds=10)
# Descriptors kept for listeners, log files, key fetches and the like, beyond the pools.
_SPARE_DESCRIPTORS = 64
_REFUSAL_LOG_INTERVAL = timedelta(seconds=10)


# ---------------------------------------------------------------------------- the process


def _decider(settings: Settings) -> extauthz.Decider | None:
    if settings.ext_authz is None:
        return None
    return extauthz.Decider(
        settings.ext_authz.trusted_callers, adapter.identity_headers(settings.identity_headers)
    )


def _verification_identity(issuer: IssuerSettings) -> IssuerSettings:
    """The issuer settings a verified token depends on (not audiences: policy checks those
    on every request; not the line it is written on; not its revocation events, checked on
    every request too)."""
    return replace(issuer, audiences=(), line=0, revocation_events=None)


def _bucket_store(settings: Settings) -> tuple[object, ...]:
    """What the rate-limit buckets depend on: the same values keep their state on reload."""
    limits = settings.rate_limits
    return (
        limits.backend,
        limits.max_keys,
        limits.timeout,
        limits.key_prefix,
        limits.max_connections,
    )


def replay_identity(settings: Settings) -> tuple[object, ...]:
    """What the replay cache depends on: the same values keep it (and what it remembers)
    on reload. The memory cache's size is not in it: it is resized in place."""
    limits = settings.rate_limits
    if not limits.redis:
        return ("memory",)
    return (
        "redis",
        limits.backend,
        limits.timeout,
        limits.max_connections,
        settings.dpop.replay_key_prefix,
    )


def replay_cache_for(settings: Settings) -> ReplayCache:
    """Redis when the rate limits are kept there, else this process's memory."""
    limits = settings.rate_limits
    if limits.redis:
        return RedisReplayCache(
            limits.backend,
            limits.timeout.total_seconds(),
            settings.dpop.replay_key_prefix,
            limits.max_connections,
        )
    return MemoryReplayCache(settings.dpop.replay_cache_size)


def _upstream_pool(settings: Settings) -> tuple[object, ...]:
    """What the upstream connection pool depends on: the same values keep it on reload. The
    TLS files' contents count, so a reload picks up a rotated client certificate or CA."""
    up = settings.upstream
    return (
        up.url,  # the client's connections are to the URL's origin
        up.server_name,
        up.max_connections,
        up.connect_timeout,
        up.read_timeout,
        up.pool_timeout,
        settings.forward.buffer_size,
        up.ca_file,
        up.cert_file,
        up.key_file,
        tls.file_state(up.ca_file, up.cert_file, up.key_file),
    )


# Settings the running sockets were made with: a change is reported and waits for a restart.
_RESTART_ONLY: dict[str, Callable[[Settings], object]] = {
    "listen": lambda s: s.listen,
    "admin_listen": lambda s: s.admin_listen,
    "workers": lambda s: s.workers,
    "shutdown_grace": lambda s: s.shutdown_grace,
    "limits (all but max_body_size)": lambda s: replace(s.limits, max_body_size=None),
    # Rotated certificate files are followed without a reload; other paths need a restart.
    "tls": lambda s: s.tls,
    "ext_authz.listen": lambda s: s.ext_authz.listen if s.ext_authz is not None else None,
}


class Startable(Protocol):
    """A part with background work (refreshes, connections), started once it is in use."""

    def start(self) -> None: ...


@dataclass(frozen=True)
class Built:
    """One configuration's pipeline and the parts it runs on (Gateway.build). `fresh`: the
    parts made for it, to start (among them its new key sets and introspectors, which a
    reload lets load before it swaps); `retired`: those of the configuration before it that
    it does not use, closed once that configuration's last request is done."""

    settings: Settings
    pipeline: Pipeline[Forwarder]
    upstream: Upstream
    buckets: Buckets
    replay: ReplayCache
    verification: dispatch.Verification
    fresh: list[Startable]
    fresh_keysets: list[KeySet]
    fresh_introspectors: list[Introspector]
    retired: list[Resource]


class Gateway:
    """One gateway process: pools, caches, metrics, access log, and the current pipeline."""

    def __init__(
        self,
        settings: Settings,
        upstream_session: aiohttp.ClientSession,
        keys_session: aiohttp.ClientSession,
        clock: Clock = SYSTEM_CLOCK,
        *,
        shared_metrics: str | None = None,
    ) -> None:
        """`shared_metrics`: the directory where the workers of one supervisor add up their
        metrics (metrics.SharedMetrics); None for a gateway of one process."""
        self.settings = settings
        self.clock = clock
        # Opened first: it is the one step here that can fail on the file system, and it
        # must fail before a client session below exists that nothing would close.
        log = settings.request_log
        self.access_log = AccessLog(adapter.access_log(log)) if log.enabled else None
        self._keys_session = keys_session
        self._upstream_session = upstream_session  # the first pool's; a reload makes its own
        self._bodies = BodiesInFlight(settings.limits.max_bodies_per_client)
        self.metrics: Metrics = (
            ProcessMetrics(self._counts)
            if shared_metrics is None
            else SharedMetrics(self._counts, shared_metrics)
        )
        self.token_cache = TokenCache(settings.token_cache_size, clock.wall)
        self._retired_backend_errors = 0  # counted by bucket stores replaced on reload
        self._forwarders: weakref.WeakSet[Forwarder] = weakref.WeakSet()  # for open WebSockets
        # The deny-set of revoked tokens and the issuers' event streams that fill it.
        self.revocations = Revocations(
            keys_session, clock.wall, clock.monotonic, on_applied=self._evict_revoked
        )
        built = self.build(settings, None)
        self._install(built)
        self._unstarted = built.fresh  # started by start()
        self.decider = _decider(settings)
        self.draining = False
        self._reload_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._file_state = _file_state(settings.file)

    # ------------------------------------------------------------------ building

    def build(self, settings: Settings, previous: Settings | None) -> Built:
        """The pipeline of `settings` and every part it runs on, made one way at start and on
        reload: with no `previous` configuration everything is made anew; on reload a part
        of the running configuration is kept while what it was made from is unchanged (its
        identity below: connections, buckets, remembered proofs and key sets keep their
        state), else made anew and the old one retired. New parts are not started."""
        fresh: list[Startable] = []
        retired: list[Resource] = []
        reused = previous is not None

        def keeps(identity: Callable[[Settings], object]) -> bool:
            return previous is not None and identity(settings) == identity(previous)

        if keeps(_upstream_pool):
            upstream = self._upstream
        else:
            if reused:
                retired.append(self._upstream)
            upstream = Upstream(
                upstream_client(settings),
                upstream_session(settings) if reused else self._upstream_session,
                Slots(settings.upstream.max_connections),
            )
        if keeps(_bucket_store):
            buckets = self._buckets
        else:
            if reused:
                retired.append(self._buckets)
            buckets = buckets_for(adapter.bucket_store(settings), self.clock.monotonic)
            fresh.append(buckets)
        if keeps(replay_identity):
            replay = self.replay
        else:
            if reused:
                retired.append(self.replay)
            replay = replay_cache_for(settings)
            fresh.append(replay)
        issuers = adapter.issuers(settings)
        before_keysets = self._keysets if reused else {}
        before_introspectors = self._introspectors if reused else {}
        verification = dispatch.build(
            issuers,
            adapter.key_set_timing(settings),
            self._keys_session,
            self.token_cache,
            before_keysets,
            before_introspectors,
            self.clock,
        )
        fresh_keysets = [k for i, k in verification.keysets.items() if i not in before_keysets]
        fresh_introspectors = [
            v for i, v in verification.introspectors.items() if i not in before_introspectors
        ]
        retired += [k for i, k in before_keysets.items() if i not in verification.keysets]
        retired += [
            v for i, v in before_introspectors.items() if i not in verification.introspectors
        ]
        fresh += fresh_keysets
        fresh += fresh_introspectors
        fresh += self.revocations.configure(issuers, adapter.key_set_timing(settings))
        pipeline = Pipeline(
            adapter.request_path(settings),
            adapter.routes(settings),
            issuers,
            resources=adapter.resources(settings),
            verifier=verification.verifier,
            limiter=Limiter(settings.rate_limits.on_backend_error, buckets, self.clock.monotonic),
            forwarder=Forwarder(
                adapter.forwarding(settings), upstream, self._bodies, self.clock.wall
            ),
            metrics=self.metrics,
            replay=replay,
            now=self.clock.wall,
            revocations=self.revocations.deny if self.revocations.active else None,
        )
        return Built(
            settings,
            pipeline,
            upstream,
            buckets,
            replay,
            verification,
            fresh,
            fresh_keysets,
            fresh_introspectors,
            retired,
        )

    def _install(self, built: Built) -> None:
        """Make `built` the configuration that serves: from here on, every new request takes
        its pipeline (no await in here)."""
        self.settings, self.pipeline = built.settings, built.pipeline
        self.decider = _decider(built.settings)
        self._upstream, self._buckets, self.replay = built.upstream, built.buckets, built.replay
        verification = built.verification
        self._keysets, self._introspectors = verification.keysets, verification.introspectors
        self.token_cache.epoch = verification.epoch  # the old verifier writes no more
        self._forwarders.add(built.pipeline.forwarder)

    @property
    def keysets(self) -> Mapping[str, KeySet]:
        """The key set of each issuer whose JWTs are verified here, by issuer URL."""
        return {keyset.issuer.issuer: keyset for keyset in self._keysets.values()}

    @property
    def bodies_in_flight(self) -> BodiesInFlight:
        return self._bodies

    @property
    def rate_limit_buckets(self) -> Buckets:
        return self._buckets

    @property
    def introspectors(self) -> Mapping[str, Introspector]:
        return {i.issuer.issuer: i for i in self._introspectors.values()}

    def start(self) -> None:
        self.metrics.start()
        for part in self._unstarted:
            part.start()
        self._unstarted = []
        self.revocations.start()
        if self.settings.reload.watch and self._file_state is not None:
            self._watcher = asyncio.create_task(self._watch(), name="config watcher")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        for task in list(self._background):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for keyset in self._keysets.values():
            await keyset.close()
        for introspector in self._introspectors.values():
            await introspector.close()
        await self.revocations.close()
        await self._buckets.close()
        await self.replay.close()
        # The upstream in use (a retired one was closed when its last request ended). Its
        # pooled session may be the caller's, which closes it again: closing is idempotent.
        await self._upstream.close()
        if self.access_log is not None:
            self.access_log.close()
        await self.metrics.close()

    def not_ready(self) -> dict[str, str]:
        """Why this process should not get traffic yet; empty when ready."""
        reasons = {
            keyset.issuer.issuer: keyset.last_error or "keys not loaded yet"
            for keyset in self._keysets.values()
            if not keyset.loaded
        }
        for introspector in self._introspectors.values():
            if not introspector.ready:
                reasons[introspector.issuer.issuer] = (
                    introspector.last_error or "introspection endpoint not known yet"
                )
        reasons.update(self.revocations.not_ready())
        if self.draining:
            reasons["gateway"] = "shutting down"
        return reasons

    def _evict_revoked(self) -> None:
        """After a revocation event: introspection answers about revoked tokens go (the
        deny-set refuses them anyway; the caches need not keep them)."""
        deny = self.revocations.deny
        for introspector in self._introspectors.values():
            introspector.cache.retain(lambda principal: not deny.evicts(principal))

    # ------------------------------------------------------------------ requests

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        started = time.perf_counter()
        pipeline = self.pipeline  # this request's configuration, whatever reloads happen
        forwarder = pipeline.forwarder
        if pipeline.traceparent:
            trace_id, traceparent, restarted = tracecontext.outgoing(
                request.headers.get("traceparent")
            )
            # A new trace's id is as random as a request id: one serves as both.
            exchange = Exchange(
                started,
                forwarder.request_id(request, trace_id if restarted else None),
                request.method,
                request.raw_path,
            )
            exchange.trace_id = trace_id
            exchange.traceparent = traceparent
            exchange.trace_restarted = restarted
        else:
            exchange = Exchange(
                started, forwarder.request_id(request), request.method, request.raw_path
            )
        pipeline.inflight += 1
        status = 500
        last = cast(_Connection, request.protocol).last_token
        try:
            sent = cast(_PublicRequest, request).sent_version
            refused = (
                framing.refusal(sent, request.headers.getall("Transfer-Encoding", ()))
                if sent != _HTTP11 or "Transfer-Encoding" in request.headers
                else None  # the common case: nothing to refuse, nothing more to read
            )
            if refused is None:
                response = await pipeline.handle(request, exchange, last)
            else:
                exchange.deny("unframeable", False)
                response = errors.unframeable(*refused)
            status = response.status
            if not response.prepared:
                response.headers[forwarder.request_id_header] = exchange.request_id
            return response
        except asyncio.CancelledError:
            status = 499  # the client went away before the answer
            raise
        except Exception:
            # A fault of the gateway's own: logged with the request id, answered with 500
            # by the connection's error handler.
            log.exception("request failed", extra={"request_id": exchange.request_id})
            raise
        finally:
            self._finished(pipeline, request, exchange, status)

    async def decide(self, request: web.BaseRequest) -> web.StreamResponse:
        """A front proxy's question on the decision listener (extauthz): steps 1 to 8 of the
        current pipeline on the request it describes, counted and logged with mode
        ext_authz."""
        started = time.perf_counter()
        pipeline, decider = self.pipeline, self.decider
        forwarder = pipeline.forwarder
        exchange = Exchange(
            started, forwarder.request_id(request), request.method, request.raw_path, EXT_AUTHZ
        )
        pipeline.inflight += 1
        status = 500
        try:
            if decider is None:  # the listener outlives a reload that removed ext_authz
                exchange.deny("ext_authz_off", False)
                response: web.StreamResponse = errors.not_found()
            else:
                response = await decider.decide(pipeline, request, exchange)
            status = response.status
            response.headers[forwarder.request_id_header] = exchange.request_id
            return response
        except asyncio.CancelledError:
            status = 499
            raise
        except Exception:
            log.exception("decision failed", extra={"request_id": exchange.request_id})
            raise
        finally:
            self._finished(pipeline, request, exchange, status)

    def _finished(
        self,
        pipeline: Pipeline[Forwarder],
        request: web.BaseRequest,
        exchange: Exchange,
        status: int,
    ) -> None:
        """The end of a request on either listener: no longer in flight (a drain waits for
        that), counted, and logged."""
        pipeline.inflight -= 1
        if not pipeline.inflight and pipeline.drained is not None:
            pipeline.drained.set()
        finished = time.perf_counter()
        self.metrics.observe(exchange, status, finished)
        access_log = self.access_log
        if access_log is not None:
            addresses = pipeline.addresses
            exchange.client = (
                addresses.client(request.remote, request.headers.getall("X-Forwarded-For", ()))
                if addresses.uses_forwarded_for
                else request.remote
            )
            access_log.record(exchange, status, finished)

    # ------------------------------------------------------------------ metrics

    def _counts(self) -> StateCounts:
        issuers: dict[str, IssuerCounts] = {}
        for keyset in self._keysets.values():
            counts = issuers.setdefault(keyset.issuer.issuer, IssuerCounts(keyset.issuer.issuer))
            counts.jwks_fetches = keyset.fetches
            counts.jwks_failures = keyset.failures
        for introspector in self._introspectors.values():
            url = introspector.issuer.issuer
            counts = issuers.setdefault(url, IssuerCounts(url))
            counts.introspection_active = introspector.active
            counts.introspection_inactive = introspector.inactive_answers
            counts.introspection_errors = introspector.failures
            counts.introspection_cache_hits = (
                introspector.cache.hits + introspector.inactive.hits + introspector.shared.hits
            )
        for stream in self.revocations.streams.values():
            url = stream.url
            counts = issuers.setdefault(url, IssuerCounts(url))
            counts.revocation_stream_synced = int(stream.synced)
            counts.revocation_stream_lag = stream.lag()
            counts.revocation_events_applied = stream.applied
            counts.revocation_events_rejected = stream.rejected
            counts.revocation_entries = self.revocations.deny.entries(url)
            counts.revocation_entries_dropped = self.revocations.deny.dropped.get(url, 0)
        return StateCounts(
            issuers=list(issuers.values()),
            token_cache_hits=self.token_cache.hits,
            token_cache_misses=self.token_cache.misses,
            token_cache_entries=len(self.token_cache),
            rate_limit_backend=self._buckets.name,
            rate_limit_backend_errors=self._retired_backend_errors + self._buckets.errors,
            websockets_open=sum(f.websockets_open for f in self._forwarders),
        )

    # ------------------------------------------------------------------ reload

    async def reload(self) -> bool:
        """Validate the file again and, when it is valid, swap in a pipeline built from it.

        An invalid file changes nothing: each problem is logged as FILE:LINE: message and
        the current configuration keeps serving.
        """
        async with self._reload_lock:
            path = self.settings.file
            try:
                new = await asyncio.to_thread(settings_module.load, path)
            except ConfigError as exc:
                for problem in exc.problems:
                    log.error(str(problem), extra={"event": "config_problem"})
                log.error(
                    "config reload rejected; the previous configuration keeps serving",
                    extra={"file": path, "problems": len(exc.problems)},
                )
                self.metrics.reloaded(False)
                self._file_state = await _file_state_off_loop(path)
                return False
            await self._apply(new)
            self._file_state = await _file_state_off_loop(path)
            self.metrics.reloaded(True)
            log.info("config reloaded", extra={"file": path})
            return True

    async def _apply(self, new: Settings) -> None:
        """Build everything the new settings need, let new issuers load their keys, then
        swap: from the swap on, every new request takes the new pipeline."""
        old_settings, old = self.settings, self.pipeline
        for what, read in _RESTART_ONLY.items():
            if read(old_settings) != read(new):
                log.warning(
                    "a changed setting takes effect only after a restart",
                    extra={"setting": what},
                )
        built = self.build(new, old_settings)
        for part in built.fresh:
            part.start()
        # An issuer new to this config gets its keys (or endpoint) before it gets requests;
        # an issuer that cannot be reached in that time is not waited for longer.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(new.jwks.fetch_timeout.total_seconds() + 1):
                await asyncio.gather(
                    *(keyset.refresh() for keyset in built.fresh_keysets if not keyset.loaded),
                    *(introspector.wait_ready() for introspector in built.fresh_introspectors),
                    return_exceptions=True,
                )
        self._in_background(self.revocations.retire())

        # The swap, with no await in it.
        if built.buckets is not self._buckets:
            self._retired_backend_errors += self._buckets.errors
        self._install(built)
        replay = built.replay
        if isinstance(replay, MemoryReplayCache):
            # Kept with what it remembers: a new one would accept again the proofs of the
            # last minute.
            replay.max_entries = new.dpop.replay_cache_size
        # Verified tokens stay trusted only while their issuer is verified the same way.
        kept = {
            issuer.issuer
            for issuer in new.issuers
            if (before := old_settings.issuer(issuer.issuer)) is not None
            and _verification_identity(before) == _verification_identity(issuer)
        }
        self.token_cache.retain(lambda principal: principal.issuer in kept)
        self.token_cache.resize(new.token_cache_size)
        if new.request_log != old_settings.request_log:
            if self.access_log is not None:
                self.access_log.close()
            self.access_log = (
                AccessLog(adapter.access_log(new.request_log)) if new.request_log.enabled else None
            )
        if new.log_level != old_settings.log_level:
            logging.getLogger().setLevel(new.log_level.upper())
        old.retired.extend(built.retired)
        self._in_background(self._retire(old, new.shutdown_grace))

    async def _retire(self, old: Pipeline[Forwarder], grace: timedelta) -> None:
        """Close what only `old` used, once its in-flight requests are done (or after a
        grace period, for a stream that never ends; or at once when the gateway closes)."""
        try:
            if old.inflight:
                old.drained = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(grace.total_seconds(), 1.0)):
                        await old.drained.wait()
        finally:
            for resource in old.retired:
                try:
                    await resource.close()
                except Exception:
                    # Closing must go on with the others; the failure is not hidden.
                    log.exception(
                        "closing a retired resource failed",
                        extra={"resource": type(resource).__name__},
                    )

    async def _watch(self) -> None:
        """Reload when the file changes (its size, modification time or inode)."""
        while True:
            await asyncio.sleep(self.settings.reload.interval.total_seconds())
            if not self.settings.reload.watch:
                continue
            state = await _file_state_off_loop(self.settings.file)
            if state is not None and state != self._file_state:
                self._file_state = state
                try:
                    await self.reload()
                except Exception:
                    log.exception("config reload failed")

    def request_reload(self) -> None:
        """For SIGHUP: start a reload without waiting for it."""
        self._in_background(self.reload())

    def _in_background(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _file_state_off_loop(path: str) -> tuple[int, int, int, str] | None:
    """`_file_state` in a worker thread: reading and hashing the file (on a slow or network
    disk above all) must not hold up the requests on the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, _file_state, path)


def _file_state(path: str) -> tuple[int, int, int, str] | None:
    try:
        stat = os.stat(path)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns, digest)


def admin_app(gateway: Gateway) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        reasons = gateway.not_ready()
        streams = gateway.revocations.state()
        extra = {"revocation_events": streams} if streams else {}
        if reasons:
            return json_response({"status": "not_ready", "reasons": reasons, **extra}, status=503)
        return json_response({"status": "ready", **extra})

    async def metrics(_: web.Request) -> web.Response:
        body = gateway.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def own_head(_: web.Request, response: web.StreamResponse) -> None:
        settle_head(response, gateway.settings.server_header)

    app = web.Application()
    app.on_response_prepare.append(own_head)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


def upstream_tls(settings: Settings) -> ssl.SSLContext | bool:
    """How the upstream's certificate is checked: against `ca_file` (default: the system's
    CAs), with the gateway's client certificate when one is configured."""
    up = settings.upstream
    if up.ca_file is None and up.cert_file is None:
        return True
    return tls.client_context(up.ca_file, up.cert_file, up.key_file)


def upstream_client(settings: Settings) -> UpstreamClient:
    """The keep-alive connections every exchange but a WebSocket upgrade goes over."""
    up = settings.upstream
    url = urlsplit(up.url)
    context: ssl.SSLContext | None = None
    if url.scheme == "https":
        checked = upstream_tls(settings)
        context = checked if isinstance(checked, ssl.SSLContext) else ssl.create_default_context()
    host = url.hostname or ""
    return UpstreamClient(
        Origin(
            host,
            url.port or (443 if context is not None else 80),
            context,
            up.server_name,
            # The URL's authority as written, lower-cased as aiohttp's URL sends it.
            URL(up.url).host_port_subcomponent or host,
        ),
        max_connections=up.max_connections,
        connect_timeout=up.connect_timeout.total_seconds(),
        read_timeout=up.read_timeout.total_seconds(),
        buffer_size=settings.forward.buffer_size,
    )


def upstream_session(settings: Settings) -> aiohttp.ClientSession:
    """The session WebSocket upgrades to the upstream are made with; bytes pass through
    untouched."""
    up = settings.upstream
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=up.max_connections,
            limit_per_host=0,
            ssl=upstream_tls(settings),
        ),
        timeout=aiohttp.ClientTimeout(
            total=None,
            # Requests wait for a connection in the forwarder's `Slots`, for pool_timeout at
            # most. This only bounds what remains: a wait inside the pool while a connection
            # just given back is still being closed, plus the connect itself.
            connect=(up.pool_timeout + up.connect_timeout).total_seconds(),
            sock_connect=up.connect_timeout.total_seconds(),
            sock_read=up.read_timeout.total_seconds(),
        ),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        read_bufsize=settings.forward.buffer_size,
    )


def settle_head(response: web.StreamResponse, server_header: str) -> None:
    """The last word on an answer's head, once aiohttp has added its default fields: an
    upstream's answer loses those its upstream did not send (forward.LEFT_OUT); the gateway's
    own answers carry `server_header` as their Server field, or none when it is empty, so
    they never tell the software and version behind them."""
    headers = response.headers
    left_out = response.get(LEFT_OUT)
    if left_out is not None:
        for name in left_out:
            headers.popall(name, None)
    elif server_header:
        headers["Server"] = server_header
    else:
        headers.popall("Server", None)


_HTTP11 = (1, 1)


class _PublicRequest(HeadSettlingRequest):
    """A request on the public listener: every answer to it, relayed or the gateway's own,
    gets its head settled (settle_head) just before it is written. `sent_version` is the
    version its request line gave; a request in one the listener does not speak is handed
    on as HTTP/1.1 to be refused (framing.py), and answered in HTTP/1.1 (RFC 9110 §6.2)."""

    ATTRS = HeadSettlingRequest.ATTRS | frozenset({"sent_version"})
    sent_version: tuple[int, int] = (1, 1)

    def settle(self, response: web.StreamResponse) -> None:
        settle_head(response, cast(_Connection, self.protocol).server_header)


class _Connection(RefusingConnection):
    """aiohttp's per-connection protocol, answering requests it cannot parse (a request line
    too long: 414; a header too long, too many headers: 431; a broken request line: 400) in
    HTTP/1.1 with the resource error body instead of a text page that echoes the request,
    and logging them without a traceback (portcullis.aiohttp_private): they are the client's
    mistake, and a flood of them must not flood the log. They are counted as denials, like
    every other refusal.

    A connection over `limits.max_connections` is closed as soon as it is accepted, before
    anything is read: a flood of connections (half-sent request heads above all, each held
    until idle_timeout) cannot take every file descriptor, and the connections already open
    are served as usual."""

    def __init__(self, server: _Server, metrics: Metrics, **kwargs: Any) -> None:
        super().__init__(server, self._refuse_unparsable, **kwargs)
        self._server = server
        self._metrics = metrics
        self._admitted = False
        self.last_token = LastToken()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._server.admit():
            # No more data is received after abort; connection_lost has nothing to undo.
            cast(asyncio.Transport, transport).abort()
            return
        self._admitted = True
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._admitted:
            self._admitted = False
            self._server.release()
            super().connection_lost(exc)

    def _refuse_unparsable(self, exc: BaseException | None) -> web.StreamResponse:
        status = unparsable_status(exc, self._server.request_line_limit)
        self._metrics.unparsable(status)
        return unparsable(status)

    @property
    def server_header(self) -> str:
        return self._server.gateway.settings.server_header


class _Server(web.Server):
    """The public listener's server: its connections, counted against `max_connections`."""

    def __init__(
        self, gateway: Gateway, *, max_connections: int, max_line_size: int, **kwargs: Any
    ) -> None:
        super().__init__(
            gateway.handle, request_factory=self._request, max_line_size=max_line_size, **kwargs
        )
        self.gateway = gateway
        self.request_line_limit = max_line_size
        self._metrics = gateway.metrics
        self.max_connections = max_connections
        self.open_connections = 0
        self.refused_connections = 0
        self._now = gateway.clock.monotonic
        self._warned_at = -_REFUSAL_LOG_INTERVAL.total_seconds()

    def __call__(self) -> web.RequestHandler:
        return _Connection(self, self._metrics, loop=self._loop, **self._kwargs)

    def _request(
        self,
        message: RawRequestMessage,
        payload: aiohttp.StreamReader,
        protocol: web.RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        # A request the parser refused is answered as HTTP/1.1 (see aiohttp_private).
        message = http11_if_unparsable(message)
        version = message.version
        if version not in framing.SPOKEN:
            message = message._replace(version=HttpVersion11, should_close=True)
        request = _PublicRequest(message, payload, protocol, writer, task, self._loop)
        request.sent_version = (version.major, version.minor)
        return request

    def admit(self) -> bool:
        """Count a new connection, or refuse it when `max_connections` are open."""
        if self.open_connections < self.max_connections:
            self.open_connections += 1
            return True
        self.refused_connections += 1
        now = self._now()
        # Once in a while, not per connection: a flood of them must not flood the log.
        if now - self._warned_at >= _REFUSAL_LOG_INTERVAL.total_seconds():
            self._warned_at = now
            log.warning(
                "connection limit reached: new connections are closed",
                extra={
                    "max_connections": self.max_connections,
                    "refused_so_far": self.refused_connections,
                },
            )
        return False

    def release(self) -> None:
        self.open_connections -= 1


def _descriptors_besides_clients(settings: Settings) -> int:
    """File descriptors a gateway process may need besides its client connections."""
    introspection = sum(
        issuer.introspection.max_connections
        for issuer in settings.issuers
        if issuer.introspection is not None
    )
    return (
        settings.upstream.max_connections
        + settings.rate_limits.max_connections
        + introspection
        + _SPARE_DESCRIPTORS
    )


def connection_limit(settings: Settings) -> int:
    """`limits.max_connections`, lowered (with a warning) to what the open-file limit leaves
    room for: past that, accepting fails for every client alike, and the upstream pool
    could not open connections either."""
    configured = settings.limits.max_connections
    soft, _ = getrlimit(RLIMIT_NOFILE)
    if soft == RLIM_INFINITY:
        return configured
    room = max(1, soft - _descriptors_besides_clients(settings))
    if room >= configured:
        return configured
    log.warning(
        "limits.max_connections lowered to fit the open-file limit (ulimit -n)",
        extra={"max_connections": configured, "lowered_to": room, "open_file_limit": soft},
    )
    return room


def _raise_open_file_limit(settings: Settings) -> None:
    """Raise this process's soft open-file limit, up to the hard one, to what
    `limits.max_connections` needs (the soft limit is often 1024 by default)."""
    soft, hard = getrlimit(RLIMIT_NOFILE)
    wanted = settings.limits.max_connections + _descriptors_besides_clients(settings)
    if soft == RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == RLIM_INFINITY else min(wanted, hard)
    with contextlib.suppress(ValueError, OSError):
        setrlimit(RLIMIT_NOFILE, (target, hard))


def public_server(gateway: Gateway) -> web.Server:
    """A low-level server: no router or middleware between the socket and `handle`."""
    limits = gateway.settings.limits
    return _Server(
        gateway,
        max_connections=connection_limit(gateway.settings),
        # Bounds both an idle keep-alive connection and the time a client has to finish
        # sending a request head (the slowloris case).
        keepalive_timeout=limits.idle_timeout.total_seconds(),
        # After refusing a body (408, 413) the rest of it is read and dropped before the
        # connection closes, so the client sees the answer rather than a reset (RFC 9112
        # §9.6); a client that sends nothing for body_timeout meanwhile is not waited for.
        lingering_time=min(limits.body_timeout, _MAX_LINGERING).total_seconds(),
        max_line_size=limits.max_line_size,
        # aiohttp's parser reports a request line and a header field over their limits
        # alike, naming the limit broken: one byte more for fields tells them apart when
        # both are configured alike (414 and 431 answer them: unparsable_status).
        max_field_size=field_limit(limits.max_field_size, limits.max_line_size),
        max_headers=limits.max_headers,
        # A body goes upstream as the bytes the client sent: decoding a content coding here
        # would change the body under the client's own framing and labels (RFC 9110 §8.4:
        # the coding is the upstream's to undo).
        auto_decompress=False,
        access_log=None,
    )


class _DecisionRequest(HeadSettlingRequest):
    """A request on the decision listener: its answers carry the gateway's own Server field."""

    ATTRS = HeadSettlingRequest.ATTRS | frozenset({"server_header"})
    server_header = ""

    def settle(self, response: web.StreamResponse) -> None:
        settle_head(response, self.server_header)


class _DecisionServer(web.Server):
    """The decision listener for front proxies (extauthz): a low-level server, like the
    public one, with no router or middleware before `Gateway.decide`. A request it cannot
    parse is answered and logged as on the public listener (414, 431, 400; no echo), but
    not counted: the denials counted are the public listener's and the decisions'."""

    def __init__(self, gateway: Gateway) -> None:
        limits = gateway.settings.limits
        super().__init__(
            gateway.decide,
            request_factory=self._request,
            keepalive_timeout=limits.idle_timeout.total_seconds(),
            max_line_size=limits.max_line_size,
            max_field_size=field_limit(limits.max_field_size, limits.max_line_size),
            max_headers=limits.max_headers,
            auto_decompress=False,  # as on the public listener
            access_log=None,
        )
        self.gateway = gateway
        self._line_limit = limits.max_line_size

    def __call__(self) -> web.RequestHandler:
        return RefusingConnection(self, self._refuse, loop=self._loop, **self._kwargs)

    def _refuse(self, exc: BaseException | None) -> web.StreamResponse:
        return unparsable(unparsable_status(exc, self._line_limit))

    def _request(
        self,
        message: RawRequestMessage,
        payload: aiohttp.StreamReader,
        protocol: web.RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        message = http11_if_unparsable(message)
        request = _DecisionRequest(message, payload, protocol, writer, task, self._loop)
        request.server_header = self.gateway.settings.server_header
        return request


def decision_server(gateway: Gateway) -> web.Server:
    return _DecisionServer(gateway)


async def _settle() -> None:
    runtime.settle_memory()


async def serve(
    settings: Settings, *, reuse_port: bool = False, shared_metrics: str | None = None
) -> None:
    """Run one gateway process until SIGTERM, then drain. SIGHUP reloads the config.
    A worker is given the directory where the workers add up their metrics."""
    _raise_open_file_limit(settings)
    certificate = tls.RotatingCertificate(settings.tls) if settings.tls is not None else None
    async with upstream_session(settings) as up, keys_session() as keys:
        gateway = Gateway(settings, up, keys, shared_metrics=shared_metrics)
        gateway.start()
        try:
            await runtime.serve(
                [
                    runtime.Listener(
                        public_server(gateway),
                        settings.listen.host,
                        settings.listen.port,
                        "public",
                        certificate,
                    ),
                    *(
                        [
                            runtime.Listener(
                                decision_server(gateway),
                                settings.ext_authz.listen.host,
                                settings.ext_authz.listen.port,
                                "ext_authz",
                            )
                        ]
                        if settings.ext_authz is not None
                        else []
                    ),
                    # Last: once /readyz answers, every other listener accepts connections.
                    runtime.Listener(
                        admin_app(gateway),
                        settings.admin_listen.host,
                        settings.admin_listen.port,
                        "admin",
                        server_header=lambda: gateway.settings.server_header,
                    ),
                ],
                grace=settings.shutdown_grace,
                reuse_port=reuse_port,
                on_draining=lambda: setattr(gateway, "draining", True),
                on_reload=gateway.request_reload,
                started=_settle,
            )
        finally:
            await gateway.close()
