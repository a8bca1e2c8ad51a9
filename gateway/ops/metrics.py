"""Prometheus metrics of one gateway process, served at `/metrics` on the admin port.

Counted on the request path in plain dicts and lists (a request costs a few dict lookups
and additions), and turned into metric families by prometheus-client when scraped:
  portcullis_gateway_requests_total{mode, route, method, status, decision}
  portcullis_gateway_denials_total{mode, route, decision, reason}  deny and would_deny; every
                                                                   refusal, a refused path too
  (mode: proxy for the public listener, ext_authz for the decisions asked by front proxies)
  portcullis_gateway_request_duration_seconds{route}              histogram, whole exchange
  portcullis_gateway_upstream_duration_seconds{route}             histogram, upstream part
  portcullis_gateway_upstream_errors_total{route, kind}           connect | timeout | broken | busy
  portcullis_gateway_rate_limit_rejections_total{route, policy}
  portcullis_gateway_config_reloads_total{result}                 applied | rejected
Read from the live state at scrape time (no cost per request):
  portcullis_gateway_jwks_fetches_total{issuer}, ..._jwks_fetch_failures_total{issuer}
  portcullis_gateway_introspection_requests_total{issuer, outcome}  active|inactive|error
  portcullis_gateway_introspection_cache_hits_total{issuer}
  portcullis_gateway_token_cache_hits_total, ..._misses_total, ..._token_cache_entries
  portcullis_gateway_rate_limit_backend_errors_total{backend}
  portcullis_gateway_websockets_open
  portcullis_gateway_revocation_stream_synced{issuer}, ..._revocation_stream_lag_seconds{issuer}
  portcullis_gateway_revocation_events_total{issuer, outcome}     applied | rejected
  portcullis_gateway_revocation_entries{issuer}, ..._revocation_entries_dropped_total{issuer}
And portcullis_build_info{version}, always 1.

Every label has a bounded set of values: route names come from the config, methods outside
the standard ones are counted as OTHER, statuses are three digits.

With `workers: N`, one scrape answered by any worker shows the sum over every worker
(`SharedMetrics`): the supervisor makes a private directory and names it in
PROMETHEUS_MULTIPROC_DIR before it starts them, and each worker keeps its counts in
memory-mapped files there (prometheus-client's multiprocess mode), so the counts of a worker
that dies stay in the sum and no total ever goes down. A request's counts are gathered in
plain numbers and written once per turn of the event loop, for every request that ended in
it: a write to the files costs far more than an addition, and a loaded worker ends many
requests per turn, so one write serves them all. The figures read from the live state are
written there every `SHARE_INTERVAL` and on each scrape; the gauges count live workers only.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from portcullis.buildinfo import BuildInfo
from portcullis.histogram import Bounds, PlainHistogram

from ..core.exchange import DENY, PROXY, UNMATCHED, Exchange

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"}
)
PREFIX = "portcullis_gateway_"
# Where the workers of one supervisor keep their metric files; prometheus-client reads it
# when it is first imported, so the supervisor sets it before it starts any worker.
SHARED_DIRECTORY = "PROMETHEUS_MULTIPROC_DIR"
# How often a worker writes the figures read from its live state (token cache, key sets,
# introspection, ...) to its files, besides on each scrape it answers itself.
SHARE_INTERVAL = timedelta(seconds=1)
# The files a scrape adds up: counters, histograms and the gauges of live workers.
_SHARED_FILES = (
    "counter_*.db",
    "histogram_*.db",
    "gauge_livesum_*.db",
    "gauge_livemin_*.db",
    "gauge_livemax_*.db",
)

# The name (after PREFIX) and help text of each metric, the same for both kinds of Metrics.
HELP = {
    "requests": "Requests answered, by mode (proxy, ext_authz), route, method, status and "
    "decision (allow, deny, would_deny, preflight).",
    "denials": "Refusals (deny) and refusals monitor mode let through (would_deny), by reason.",
    "request_duration_seconds": "Time from a request's arrival to the end of its answer.",
    "upstream_duration_seconds": "Time from sending a request upstream to the end of the "
    "upstream's answer.",
    "upstream_errors": "Upstream exchanges that failed, by kind (connect, timeout, broken, busy).",
    "rate_limit_rejections": "Requests a rate limit refused (or would have, in monitor mode), "
    "by policy.",
    "config_reloads": "Configuration reloads, by result (applied, rejected).",
    "jwks_fetches": "Key set fetches, by issuer.",
    "jwks_fetch_failures": "Key set fetches that failed.",
    "introspection_requests": "Introspection calls, by issuer and outcome "
    "(active, inactive, error).",
    "introspection_cache_hits": "Tokens answered from the introspection cache "
    "(active or inactive).",
    "token_cache_hits": "Requests whose JWT was found in the verified-token cache.",
    "token_cache_misses": "JWTs that had to be verified.",
    "token_cache_entries": "Verified JWTs held in the cache.",
    "rate_limit_backend_errors": "Rate-limit checks the backend could not answer "
    "(on_backend_error applied).",
    "websockets_open": "WebSocket sessions open.",
    "revocation_stream_synced": "1 while the issuer's revocation events stream is connected "
    "and up to date (the least over workers).",
    "revocation_stream_lag_seconds": "0 while synced, else the time since the stream last was "
    "(the most over workers).",
    "revocation_events": "Revocation events received, by issuer and outcome (applied, rejected).",
    "revocation_entries": "Revoked tokens and cut-offs held (the most over workers).",
    "revocation_entries_dropped": "Deny-set entries dropped at max_entries before they expired.",
}


@dataclass
class IssuerCounts:
    issuer: str
    jwks_fetches: int | None = None
    jwks_failures: int | None = None
    introspection_active: int | None = None
    introspection_inactive: int | None = None
    introspection_errors: int | None = None
    introspection_cache_hits: int | None = None
    revocation_stream_synced: int | None = None  # None: the issuer streams no revocations
    revocation_stream_lag: float = 0.0
    revocation_events_applied: int = 0
    revocation_events_rejected: int = 0
    revocation_entries: int = 0
    revocation_entries_dropped: int = 0

    def introspection(self) -> tuple[tuple[str, int], ...]:
        return (
            ("active", self.introspection_active or 0),
            ("inactive", self.introspection_inactive or 0),
            ("error", self.introspection_errors or 0),
        )


@dataclass
class StateCounts:
    """What the live state has counted so far, gathered at scrape time."""

    issuers: list[IssuerCounts] = field(default_factory=list)
    token_cache_hits: int = 0
    token_cache_misses: int = 0
    token_cache_entries: int = 0
    rate_limit_backend: str = "memory"
    rate_limit_backend_errors: int = 0
    websockets_open: int = 0


class Metrics(ABC):
    """What the gateway counts, and the Prometheus text of it: one process's own counts
    (`ProcessMetrics`), or the sum over the workers of one supervisor (`SharedMetrics`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(BuildInfo())  # the same in every worker: never added up

    @abstractmethod
    def observe(self, exchange: Exchange, status: int, finished: float) -> None:
        """A request answered: its status, route, decision and timings."""

    @abstractmethod
    def unparsable(self, status: int) -> None:
        """A request refused before it could be read (a broken request line, a header too
        large): no route, method or exchange, but a denial all the same."""

    @abstractmethod
    def rate_limit_rejected(self, route: str, policy: str) -> None: ...

    @abstractmethod
    def reloaded(self, applied: bool) -> None: ...

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    @abstractmethod
    def start(self) -> None:
        """Start what runs beside the requests, if anything (in the event loop)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop it, leaving every count where a later scrape finds it."""


# ---------------------------------------------------------------------------- one process


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], StateCounts]) -> None:
        self._read = read

    def describe(self) -> list[Metric]:
        return []  # names are not registered up front: the state may not exist yet

    def collect(self) -> Iterator[Metric]:
        state = self._read()
        fetches = CounterMetricFamily(
            PREFIX + "jwks_fetches", HELP["jwks_fetches"], labels=["issuer"]
        )
        failures = CounterMetricFamily(
            PREFIX + "jwks_fetch_failures", HELP["jwks_fetch_failures"], labels=["issuer"]
        )
        introspection = CounterMetricFamily(
            PREFIX + "introspection_requests",
            HELP["introspection_requests"],
            labels=["issuer", "outcome"],
        )
        hits = CounterMetricFamily(
            PREFIX + "introspection_cache_hits", HELP["introspection_cache_hits"], labels=["issuer"]
        )
        for counts in state.issuers:
            if counts.jwks_fetches is not None:
                fetches.add_metric([counts.issuer], counts.jwks_fetches)
                failures.add_metric([counts.issuer], counts.jwks_failures or 0)
            if counts.introspection_active is not None:
                for outcome, value in counts.introspection():
                    introspection.add_metric([counts.issuer, outcome], value)
                hits.add_metric([counts.issuer], counts.introspection_cache_hits or 0)
        yield from (fetches, failures, introspection, hits)
        yield from _revocation_families(state.issuers)
        for name, value in (
            ("token_cache_hits", state.token_cache_hits),
            ("token_cache_misses", state.token_cache_misses),
        ):
            yield CounterMetricFamily(PREFIX + name, HELP[name], value=value)
        yield GaugeMetricFamily(
            PREFIX + "token_cache_entries",
            HELP["token_cache_entries"],
            value=state.token_cache_entries,
        )
        backend_errors = CounterMetricFamily(
            PREFIX + "rate_limit_backend_errors",
            HELP["rate_limit_backend_errors"],
            labels=["backend"],
        )
        backend_errors.add_metric([state.rate_limit_backend], state.rate_limit_backend_errors)
        yield backend_errors
        yield GaugeMetricFamily(
            PREFIX + "websockets_open", HELP["websockets_open"], value=state.websockets_open
        )


def _revocation_families(issuers: Iterable[IssuerCounts]) -> Iterator[Metric]:
    synced = GaugeMetricFamily(
        PREFIX + "revocation_stream_synced", HELP["revocation_stream_synced"], labels=["issuer"]
    )
    lag = GaugeMetricFamily(
        PREFIX + "revocation_stream_lag_seconds",
        HELP["revocation_stream_lag_seconds"],
        labels=["issuer"],
    )
    events = CounterMetricFamily(
        PREFIX + "revocation_events", HELP["revocation_events"], labels=["issuer", "outcome"]
    )
    entries = GaugeMetricFamily(
        PREFIX + "revocation_entries", HELP["revocation_entries"], labels=["issuer"]
    )
    dropped = CounterMetricFamily(
        PREFIX + "revocation_entries_dropped",
        HELP["revocation_entries_dropped"],
        labels=["issuer"],
    )
    for counts in issuers:
        if counts.revocation_stream_synced is None:
            continue
        issuer = counts.issuer
        synced.add_metric([issuer], counts.revocation_stream_synced)
        lag.add_metric([issuer], counts.revocation_stream_lag)
        events.add_metric([issuer, "applied"], counts.revocation_events_applied)
        events.add_metric([issuer, "rejected"], counts.revocation_events_rejected)
        entries.add_metric([issuer], counts.revocation_entries)
        dropped.add_metric([issuer], counts.revocation_entries_dropped)
    yield from (synced, lag, events, entries, dropped)


_BOUNDS = Bounds(LATENCY_BUCKETS)


class ProcessMetrics(Metrics):
    """The counts of this process alone, in plain dicts (a request costs a few dict lookups
    and additions), turned into Prometheus text on scrape."""

    def __init__(self, read_state: Callable[[], StateCounts]) -> None:
        super().__init__()
        self._requests: dict[tuple[str, str, str, int, str], int] = {}
        self._denials: dict[tuple[str, str, str, str], int] = {}
        self._durations: dict[str, tuple[PlainHistogram, PlainHistogram]] = {}
        self._upstream_errors: dict[tuple[str, str], int] = {}
        self._rate_limited: dict[tuple[str, str], int] = {}
        self._reloads: dict[str, int] = {"applied": 0, "rejected": 0}
        self.registry.register(_RequestCollector(self))
        self.registry.register(_StateCollector(read_state))

    def observe(self, exchange: Exchange, status: int, finished: float) -> None:
        route = exchange.route
        method = exchange.method
        if method not in KNOWN_METHODS:
            method = "OTHER"
        mode = exchange.mode
        key = (mode, route, method, status, exchange.decision)
        requests = self._requests
        requests[key] = requests.get(key, 0) + 1
        timing = self._durations.get(route)
        if timing is None:
            timing = self._durations[route] = (PlainHistogram(_BOUNDS), PlainHistogram(_BOUNDS))
        timing[0].observe(finished - exchange.started)
        upstream = exchange.upstream_seconds
        if upstream is not None:
            timing[1].observe(upstream)
        if exchange.upstream_error is not None:
            _count(self._upstream_errors, (route, exchange.upstream_error))
        if exchange.reason is not None:
            _count(self._denials, (mode, route, exchange.decision, exchange.reason))

    def unparsable(self, status: int) -> None:
        _count(self._requests, (PROXY, UNMATCHED, "OTHER", status, DENY))
        _count(self._denials, (PROXY, UNMATCHED, DENY, "unparsable"))

    def rate_limit_rejected(self, route: str, policy: str) -> None:
        _count(self._rate_limited, (route, policy))

    def reloaded(self, applied: bool) -> None:
        _count(self._reloads, "applied" if applied else "rejected")

    def start(self) -> None:
        pass  # everything is counted on the request path or read at scrape time

    async def close(self) -> None:
        pass


def _count(table: dict[Any, int], key: Any) -> None:
    table[key] = table.get(key, 0) + 1


class _RequestCollector(Collector):
    def __init__(self, metrics: ProcessMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        requests = CounterMetricFamily(
            PREFIX + "requests",
            HELP["requests"],
            labels=["mode", "route", "method", "status", "decision"],
        )
        for (mode, route, method, status, decision), value in list(m._requests.items()):
            requests.add_metric([mode, route, method, str(status), decision], value)
        yield requests
        denials = CounterMetricFamily(
            PREFIX + "denials", HELP["denials"], labels=["mode", "route", "decision", "reason"]
        )
        for denial, value in list(m._denials.items()):
            denials.add_metric(list(denial), value)
        yield denials
        total = HistogramMetricFamily(
            PREFIX + "request_duration_seconds", HELP["request_duration_seconds"], labels=["route"]
        )
        upstream = HistogramMetricFamily(
            PREFIX + "upstream_duration_seconds",
            HELP["upstream_duration_seconds"],
            labels=["route"],
        )
        for route, (whole, part) in list(m._durations.items()):
            total.add_metric([route], whole.buckets(), whole.sum)
            if any(part.counts):
                upstream.add_metric([route], part.buckets(), part.sum)
        yield total
        yield upstream
        tables: tuple[tuple[str, list[str], dict[tuple[str, str], int]], ...] = (
            ("upstream_errors", ["route", "kind"], m._upstream_errors),
            ("rate_limit_rejections", ["route", "policy"], m._rate_limited),
        )
        for name, names, table in tables:
            family = CounterMetricFamily(PREFIX + name, HELP[name], labels=names)
            for key, value in list(table.items()):
                family.add_metric(list(key), value)
            yield family
        reloads = CounterMetricFamily(
            PREFIX + "config_reloads", HELP["config_reloads"], labels=["result"]
        )
        for result, value in m._reloads.items():
            reloads.add_metric([result], value)
        yield reloads


# ---------------------------------------------------------------------------- workers

_Child = TypeVar("_Child", Counter, Histogram)


class SharedMetrics(Metrics):
    """The counts of every worker of one supervisor, added up on each scrape.

    Each worker writes its own memory-mapped files in `directory` (the values
    prometheus-client gives its metrics when PROMETHEUS_MULTIPROC_DIR is set), so a worker
    that is killed leaves its counts behind for the sum. The request path counts in plain
    numbers, as `ProcessMetrics` does, and the counts of the requests that ended in one turn
    of the event loop are written at the start of the next (`_write_pending`), before the
    worker reads any new request: a scrape any worker answers once a request's answer has
    been sent sees it counted, and a worker killed loses at most the counts of that turn.
    """

    def __init__(self, read_state: Callable[[], StateCounts], directory: str) -> None:
        super().__init__()
        if os.environ.get(SHARED_DIRECTORY) != directory or not getattr(
            values.ValueClass, "_multiprocess", False
        ):
            raise RuntimeError(
                f"{SHARED_DIRECTORY} must name {directory} before prometheus-client is imported"
            )
        self._read_state = read_state
        self._requests_family = _counter(
            "requests", "mode", "route", "method", "status", "decision"
        )
        self._denials_family = _counter("denials", "mode", "route", "decision", "reason")
        self._total_family = _histogram("request_duration_seconds")
        self._upstream_family = _histogram("upstream_duration_seconds")
        self._errors_family = _counter("upstream_errors", "route", "kind")
        self._limited_family = _counter("rate_limit_rejections", "route", "policy")
        self._reloads_family = _counter("config_reloads", "result")
        for result in ("applied", "rejected"):
            self._reloads_family.labels(result)  # shown at 0 before the first reload
        # The metric of each label set once looked up: a request does no label lookup.
        self._requests: dict[tuple[str, str, str, int, str], Counter] = {}
        self._denials: dict[tuple[str, str, str, str], Counter] = {}
        self._totals: dict[str, Histogram] = {}
        self._upstream_times: dict[str, Histogram] = {}
        self._errors: dict[tuple[str, str], Counter] = {}
        # Figures of the live state: counters grow by what they grew since the last share.
        self._state_counters = {
            "jwks_fetches": _counter("jwks_fetches", "issuer"),
            "jwks_fetch_failures": _counter("jwks_fetch_failures", "issuer"),
            "introspection_requests": _counter("introspection_requests", "issuer", "outcome"),
            "introspection_cache_hits": _counter("introspection_cache_hits", "issuer"),
            "token_cache_hits": _counter("token_cache_hits"),
            "token_cache_misses": _counter("token_cache_misses"),
            "rate_limit_backend_errors": _counter("rate_limit_backend_errors", "backend"),
            "revocation_events": _counter("revocation_events", "issuer", "outcome"),
            "revocation_entries_dropped": _counter("revocation_entries_dropped", "issuer"),
        }
        self._revocation_gauges = {
            "revocation_stream_synced": _issuer_gauge("revocation_stream_synced", "livemin"),
            "revocation_stream_lag_seconds": _issuer_gauge(
                "revocation_stream_lag_seconds", "livemax"
            ),
            "revocation_entries": _issuer_gauge("revocation_entries", "livemax"),
        }
        self._shared: dict[tuple[str, tuple[str, ...]], int] = {}
        # Counted since the last write to the files.
        self._pending_requests: dict[tuple[str, str, str, int, str], int] = {}
        self._pending_denials: dict[tuple[str, str, str, str], int] = {}
        self._pending_errors: dict[tuple[str, str], int] = {}
        self._pending_durations: dict[str, tuple[PlainHistogram, PlainHistogram]] = {}
        self._write_scheduled = False
        self._token_cache_entries = _live_gauge("token_cache_entries")
        self._websockets_open = _live_gauge("websockets_open")
        self._sharing: asyncio.Task[None] | None = None
        self.registry.register(_WorkerFiles(directory))

    # ------------------------------------------------------------------ request path

    def observe(self, exchange: Exchange, status: int, finished: float) -> None:
        route = exchange.route
        method = exchange.method
        if method not in KNOWN_METHODS:
            method = "OTHER"
        mode = exchange.mode
        key = (mode, route, method, status, exchange.decision)
        requests = self._pending_requests
        requests[key] = requests.get(key, 0) + 1
        timing = self._pending_durations.get(route)
        if timing is None:
            timing = self._pending_durations[route] = (
                PlainHistogram(_BOUNDS),
                PlainHistogram(_BOUNDS),
            )
        timing[0].observe(finished - exchange.started)
        upstream = exchange.upstream_seconds
        if upstream is not None:
            timing[1].observe(upstream)
        if exchange.upstream_error is not None:
            _count(self._pending_errors, (route, exchange.upstream_error))
        if exchange.reason is not None:
            _count(self._pending_denials, (mode, route, exchange.decision, exchange.reason))
        if not self._write_scheduled:
            self._write_scheduled = True
            asyncio.get_running_loop().call_soon(self._write_pending)

    def unparsable(self, status: int) -> None:
        key = (PROXY, UNMATCHED, "OTHER", status, DENY)
        _child(self._requests, self._requests_family, key, *key[:3], str(status), DENY).inc()
        denial = (PROXY, UNMATCHED, DENY, "unparsable")
        _child(self._denials, self._denials_family, denial, *denial).inc()

    def _write_pending(self) -> None:
        """Write what the request path counted since the last write to this worker's files."""
        self._write_scheduled = False
        if self._pending_requests:
            for key, count in self._pending_requests.items():
                mode, route, method, status, decision = key
                child = self._requests.get(key)
                if child is None:
                    child = self._requests[key] = self._requests_family.labels(
                        mode, route, method, str(status), decision
                    )
                child.inc(count)
            self._pending_requests.clear()
        if self._pending_durations:
            for route, (total, upstream) in self._pending_durations.items():
                if any(total.counts):
                    add_observations(_child(self._totals, self._total_family, route, route), total)
                if any(upstream.counts):
                    add_observations(
                        _child(self._upstream_times, self._upstream_family, route, route), upstream
                    )
            self._pending_durations.clear()
        if self._pending_errors:
            for (route, kind), count in self._pending_errors.items():
                _child(self._errors, self._errors_family, (route, kind), route, kind).inc(count)
            self._pending_errors.clear()
        if self._pending_denials:
            for denial, count in self._pending_denials.items():
                _child(self._denials, self._denials_family, denial, *denial).inc(count)
            self._pending_denials.clear()

    def rate_limit_rejected(self, route: str, policy: str) -> None:
        self._limited_family.labels(route, policy).inc()

    def reloaded(self, applied: bool) -> None:
        self._reloads_family.labels("applied" if applied else "rejected").inc()

    # ------------------------------------------------------------------ live state

    def share_state(self) -> None:
        """Write what the live state has counted to this worker's files."""
        state = self._read_state()
        grow = self._grow
        for counts in state.issuers:
            issuer = counts.issuer
            if counts.jwks_fetches is not None:
                grow("jwks_fetches", (issuer,), counts.jwks_fetches)
                grow("jwks_fetch_failures", (issuer,), counts.jwks_failures or 0)
            if counts.introspection_active is not None:
                for outcome, value in counts.introspection():
                    grow("introspection_requests", (issuer, outcome), value)
                grow("introspection_cache_hits", (issuer,), counts.introspection_cache_hits or 0)
            if counts.revocation_stream_synced is not None:
                grow("revocation_events", (issuer, "applied"), counts.revocation_events_applied)
                grow("revocation_events", (issuer, "rejected"), counts.revocation_events_rejected)
                grow("revocation_entries_dropped", (issuer,), counts.revocation_entries_dropped)
                gauges = self._revocation_gauges
                gauges["revocation_stream_synced"].labels(issuer).set(
                    counts.revocation_stream_synced
                )
                gauges["revocation_stream_lag_seconds"].labels(issuer).set(
                    counts.revocation_stream_lag
                )
                gauges["revocation_entries"].labels(issuer).set(counts.revocation_entries)
        grow("token_cache_hits", (), state.token_cache_hits)
        grow("token_cache_misses", (), state.token_cache_misses)
        grow(
            "rate_limit_backend_errors",
            (state.rate_limit_backend,),
            state.rate_limit_backend_errors,
        )
        self._token_cache_entries.set(state.token_cache_entries)
        self._websockets_open.set(state.websockets_open)

    def _grow(self, name: str, labels: tuple[str, ...], total: int) -> None:
        """Add to a shared counter what a live-state count grew by since it was last shared.
        A count that starts again lower (a key set replaced on reload) becomes the new
        baseline: what it grows by from there is added, and the shared counter never goes
        down."""
        key = (name, labels)
        before = self._shared.get(key, 0)
        if total > before:
            family = self._state_counters[name]
            (family.labels(*labels) if labels else family).inc(total - before)
        self._shared[key] = total

    def exposition(self) -> bytes:
        self._write_pending()
        self.share_state()
        return super().exposition()

    def start(self) -> None:
        self._sharing = asyncio.create_task(self._share_regularly(), name="metrics sharing")

    async def close(self) -> None:
        if self._sharing is not None:
            self._sharing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sharing
        self._write_pending()
        self.share_state()

    async def _share_regularly(self) -> None:
        while True:
            await asyncio.sleep(SHARE_INTERVAL.total_seconds())
            self.share_state()


def _counter(name: str, *labels: str) -> Counter:
    return Counter(PREFIX + name, HELP[name], labels, registry=None)


def _histogram(name: str) -> Histogram:
    return Histogram(PREFIX + name, HELP[name], ["route"], registry=None, buckets=LATENCY_BUCKETS)


def _live_gauge(name: str) -> Gauge:
    """A gauge summed over the workers alive (a dead worker's value is dropped)."""
    return Gauge(PREFIX + name, HELP[name], registry=None, multiprocess_mode="livesum")


def _issuer_gauge(name: str, mode: str) -> Gauge:
    """A gauge per issuer over the workers alive, combined by `mode` (livemin, livemax)."""
    return Gauge(PREFIX + name, HELP[name], ["issuer"], registry=None, multiprocess_mode=mode)  # type: ignore[arg-type]


def add_observations(histogram: Histogram, observed: PlainHistogram) -> None:
    """Add what `observed` counted to one label set of a prometheus-client histogram, as
    observing each value there would have: a bucket and the sum grow once per batch, not
    once per value. prometheus-client has no public call for it; the child's `_buckets`
    (one value per upper bound, +Inf last, not cumulative) and `_sum` are what its own
    `observe` adds to (tests/gateway/test_metrics_batch.py fails if a release changes that).
    """
    buckets = histogram._buckets
    for index, count in enumerate(observed.counts):
        if count:
            buckets[index].inc(count)
    histogram._sum.inc(observed.sum)


def _child(table: dict[Any, _Child], family: _Child, key: Any, *labels: str) -> _Child:
    """The metric of one label set, looked up once."""
    child = table.get(key)
    if child is None:
        child = table[key] = family.labels(*labels)
    return child


class _WorkerFiles(Collector):
    """Every worker's counts, read from the files in the shared directory and added up."""

    def __init__(self, directory: str) -> None:
        self._directory = directory

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        files = [
            path
            for pattern in _SHARED_FILES
            for path in glob.glob(os.path.join(self._directory, pattern))
        ]
        merged: Iterable[Metric] = MultiProcessCollector.merge(  # type: ignore[no-untyped-call]
            files, accumulate=True
        )
        return sorted(merged, key=lambda metric: metric.name)


# ---------------------------------------------------------------------------- the supervisor


@contextlib.contextmanager
def shared_directory() -> Iterator[str]:
    """A private directory (mode 0700) for the metric files of the workers about to be
    started, named in the environment they inherit; removed with its files at the end."""
    directory = tempfile.mkdtemp(prefix="portcullis-gateway-metrics-")
    os.environ[SHARED_DIRECTORY] = directory
    try:
        yield directory
    finally:
        os.environ.pop(SHARED_DIRECTORY, None)
        shutil.rmtree(directory, ignore_errors=True)


def worker_exited(pid: int) -> None:
    """A worker is gone: its gauges leave the sum (its open WebSockets and cached tokens went
    with it); its counters stay in it, so no total goes down."""
    directory = os.environ.get(SHARED_DIRECTORY)
    if directory is not None:
        mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]
