"""Prometheus metrics of the authorization server, served at `/metrics` on the admin listener.

Counted in plain dicts as things happen (a request costs a dict lookup and an addition) and
turned into metric families by prometheus-client when scraped:
  portcullis_authserver_requests_total{endpoint, status}    endpoint: the route's name;
                                                            `unmatched` for no route,
                                                            `unparsable` for a request
                                                            the parser refused
  portcullis_authserver_request_duration_seconds{endpoint, path, method, status_class}
                                                            histogram; path: the route's
                                                            template (/register/{client_id})
  portcullis_authserver_tokens_issued_total{grant_type}
  portcullis_authserver_refresh_reuse_detected_total         a rotated token shown again
  portcullis_authserver_logins_failed_total                 wrong username or password
  portcullis_authserver_logins_throttled_total              refused by login_throttle
  portcullis_authserver_store_call_duration_seconds{operation}   histogram
  portcullis_authserver_config_reloads_total{result}        applied | rejected
  portcullis_authserver_client_metadata_documents_total{result}   fetched | timeout |
                                                            too_large | redirect | status |
                                                            not_json | invalid | address_refused |
                                                            host_denied | dns_failed |
                                                            connect_failed | server_error |
                                                            blocked | invalid_url
  portcullis_authserver_dpop_proofs_total{endpoint, result}  token | userinfo | admin; accepted |
                                                            invalid | nonce_required | replayed
  portcullis_authserver_second_factor_attempts_total{factor, outcome}
                                                            totp | recovery_code | passkey;
                                                            succeeded | failed | throttled |
                                                            replayed
  portcullis_authserver_second_factor_changes_total{factor, change}
                                                            totp | recovery_code | passkey;
                                                            enrolled | removed | renewed
  portcullis_authserver_federation_stale_documents_total{provider, document}
                                                            provider: a configured name;
                                                            discovery | jwks
  portcullis_build_info{version}                            always 1

Every label has a bounded set of values: endpoints are the names of the routes (`unmatched`
for paths no route serves), paths the templates of the routes (never the path a request
named: `unmatched` again), methods the standard ones (any other is `OTHER`), statuses three
digits and status classes `1xx` to `5xx`, grant types the ones the token endpoint dispatches
to, operations the Store's method names, factors, outcomes, changes and documents the
values named above (any other is refused: a programming error, not a label), providers the
names the configuration gives them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from aiohttp.web import AbstractRoute
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from portcullis.buildinfo import BuildInfo
from portcullis.histogram import Bounds, PlainHistogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "portcullis_authserver_"
# From a read that SQLite answers from its page cache to a write that waits out the busy
# timeout: every store call falls within the buckets.
STORE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
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
)
_BOUNDS = Bounds(STORE_BUCKETS)
# From a discovery document served from memory to a sign-in's password check queued behind
# others (scrypt, tens of milliseconds each) or a store call waiting out its timeout.
REQUEST_BUCKETS = (
    0.0005,
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
)
_REQUEST_BOUNDS = Bounds(REQUEST_BUCKETS)
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# The second factors, what became of an attempt with one, and what changed of a user's.
FACTORS = frozenset({"totp", "recovery_code", "passkey"})
FACTOR_OUTCOMES = frozenset({"succeeded", "failed", "throttled", "replayed"})
FACTOR_CHANGES = frozenset({"enrolled", "removed", "renewed"})
STALE_DOCUMENTS = frozenset({"discovery", "jwks"})


def _bounded(value: str, allowed: frozenset[str], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"{what} {value!r} is not one of {sorted(allowed)}")
    return value


class Metrics:
    """What the server counts; one instance for the life of the process (reloads keep it)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests: dict[tuple[str, int], int] = {}
        # (endpoint, method, status // 100) -> its histogram; the path label is the
        # endpoint's route template, learnt at its first request.
        self.request_times: dict[tuple[str, str, int], PlainHistogram] = {}
        self.route_templates: dict[str, str] = {}
        self.tokens_issued: dict[str, int] = {}
        self.refresh_reuse_detected = 0
        self.logins_failed = 0
        self.logins_throttled = 0
        self.store_calls: dict[str, PlainHistogram] = {}
        self.reloads: dict[str, int] = {"applied": 0, "rejected": 0}
        self.dpop_proofs: dict[tuple[str, str], int] = {}
        self.metadata_documents: dict[str, int] = {}
        self.factor_attempts: dict[tuple[str, str], int] = {}
        self.factor_changes: dict[tuple[str, str], int] = {}
        self.stale_documents: dict[tuple[str, str], int] = {}
        self.registry.register(_Collector(self))
        self.registry.register(BuildInfo())

    def request(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def request_time(
        self, endpoint: str, route: AbstractRoute, method: str, status: int, seconds: float
    ) -> None:
        key = (endpoint, method if method in _METHODS else "OTHER", status // 100)
        histogram = self.request_times.get(key)
        if histogram is None:
            histogram = self.request_times[key] = PlainHistogram(_REQUEST_BOUNDS)
            if endpoint not in self.route_templates:
                resource = route.resource if route.name else None
                self.route_templates[endpoint] = (
                    resource.canonical if resource is not None else "unmatched"
                )
        histogram.observe(seconds)

    def token_issued(self, grant_type: str) -> None:
        self.tokens_issued[grant_type] = self.tokens_issued.get(grant_type, 0) + 1

    def refresh_reused(self) -> None:
        self.refresh_reuse_detected += 1

    def login_failed(self) -> None:
        self.logins_failed += 1

    def login_throttled(self) -> None:
        self.logins_throttled += 1

    def store_call(self, operation: str, seconds: float) -> None:
        histogram = self.store_calls.get(operation)
        if histogram is None:
            histogram = self.store_calls[operation] = PlainHistogram(_BOUNDS)
        histogram.observe(seconds)

    def dpop_proof(self, endpoint: str, result: str) -> None:
        key = (endpoint, result)
        self.dpop_proofs[key] = self.dpop_proofs.get(key, 0) + 1

    def metadata_document(self, result: str) -> None:
        """A Client ID Metadata Document fetched (`fetched`) or refused (why)."""
        self.metadata_documents[result] = self.metadata_documents.get(result, 0) + 1

    def count_factor(self, factor: str, outcome: str) -> None:
        """An attempt at a sign-in's second step with `factor` (`totp`, `recovery_code`,
        `passkey`) and how it went (`succeeded`, `failed`, `throttled`, `replayed`)."""
        key = (_bounded(factor, FACTORS, "factor"), _bounded(outcome, FACTOR_OUTCOMES, "outcome"))
        self.factor_attempts[key] = self.factor_attempts.get(key, 0) + 1

    def factor_changed(self, factor: str, change: str) -> None:
        """A user's `factor` `enrolled`, `removed`, or (recovery codes) `renewed`."""
        key = (_bounded(factor, FACTORS, "factor"), _bounded(change, FACTOR_CHANGES, "change"))
        self.factor_changes[key] = self.factor_changes.get(key, 0) + 1

    def stale_document(self, provider: str, document: str) -> None:
        """An upstream provider's `discovery` document or `jwks` used past its age because
        fetching it again failed (stale-if-error)."""
        key = (provider, _bounded(document, STALE_DOCUMENTS, "document"))
        self.stale_documents[key] = self.stale_documents.get(key, 0) + 1

    def reloaded(self, applied: bool) -> None:
        self.reloads["applied" if applied else "rejected"] += 1

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Collector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        # A request's status is a number; every other label value is a string already.
        yield _counters(
            "requests",
            "Requests answered, by endpoint (route name) and status.",
            ["endpoint", "status"],
            {(endpoint, str(status)): n for (endpoint, status), n in list(m.requests.items())},
        )
        durations = HistogramMetricFamily(
            PREFIX + "request_duration_seconds",
            "Time from a request's arrival to its answer, by endpoint (route name), path (the"
            " route's template), method and status class.",
            labels=["endpoint", "path", "method", "status_class"],
        )
        templates = m.route_templates
        for (endpoint, method, status_class), histogram in list(m.request_times.items()):
            durations.add_metric(
                [endpoint, templates.get(endpoint, "unmatched"), method, f"{status_class}xx"],
                histogram.buckets(),
                histogram.sum,
            )
        yield durations
        yield _counters(
            "tokens_issued",
            "Successful token responses, by grant type.",
            ["grant_type"],
            m.tokens_issued,
        )
        yield CounterMetricFamily(
            PREFIX + "refresh_reuse_detected",
            "Rotated or revoked refresh tokens presented again (their family was revoked).",
            value=m.refresh_reuse_detected,
        )
        yield CounterMetricFamily(
            PREFIX + "logins_failed",
            "Sign-ins refused for a wrong username or password.",
            value=m.logins_failed,
        )
        yield CounterMetricFamily(
            PREFIX + "logins_throttled",
            "Sign-ins refused unchecked because of too many recent failures.",
            value=m.logins_throttled,
        )
        store = HistogramMetricFamily(
            PREFIX + "store_call_duration_seconds",
            "Time a store call took, waiting for the store's worker included, by operation.",
            labels=["operation"],
        )
        for operation, histogram in list(m.store_calls.items()):
            store.add_metric([operation], histogram.buckets(), histogram.sum)
        yield store
        yield _counters(
            "config_reloads",
            "Configuration reloads, by result (applied, rejected).",
            ["result"],
            m.reloads,
        )
        yield _counters(
            "dpop_proofs",
            "DPoP proofs checked, by endpoint and result (accepted, invalid, nonce_required,"
            " replayed).",
            ["endpoint", "result"],
            m.dpop_proofs,
        )
        yield _counters(
            "client_metadata_documents",
            "Client ID Metadata Documents fetched, or refused and why.",
            ["result"],
            m.metadata_documents,
        )
        yield _counters(
            "second_factor_attempts",
            "Second steps of sign-ins, by factor (totp, recovery_code, passkey) and outcome"
            " (succeeded, failed, throttled, replayed).",
            ["factor", "outcome"],
            m.factor_attempts,
        )
        yield _counters(
            "second_factor_changes",
            "Second factors enrolled or removed, and recovery codes renewed, by factor.",
            ["factor", "change"],
            m.factor_changes,
        )
        yield _counters(
            "federation_stale_documents",
            "Upstream providers' discovery documents and key sets used past their age because"
            " fetching them again failed, by provider and document (discovery, jwks).",
            ["provider", "document"],
            m.stale_documents,
        )


def _counters(
    name: str, documentation: str, labels: list[str], counts: Mapping[Any, float]
) -> CounterMetricFamily:
    """A counter family of `counts`, keyed by its label value (one label) or a tuple of them
    in the order of `labels`. Read from a copy: a request may count while it is scraped."""
    family = CounterMetricFamily(PREFIX + name, documentation, labels=labels)
    for key, value in list(counts.items()):
        family.add_metric(list(key) if isinstance(key, tuple) else [key], value)
    return family
