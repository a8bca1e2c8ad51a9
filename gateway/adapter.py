"""Settings → records: the one place that turns the configuration file's shape into what the
running gateway reads (records.py). Each function copies its section field by field and
resolves the defaults other sections hold, so a new option is one field in records.py and
one line here.
"""

from __future__ import annotations

from .records import Introspection, Issuer, RevocationEvents, Route, Scopes
from .settings import (
    IntrospectionSettings,
    IssuerSettings,
    RevocationEventsSettings,
    RouteSettings,
    ScopeRule,
    Settings,
)


def issuers(settings: Settings) -> tuple[Issuer, ...]:
    """The trusted issuers, in the file's order."""
    return tuple(issuer(i) for i in settings.issuers)


def routes(settings: Settings) -> tuple[Route, ...]:
    """The route rules, in the file's order (first match wins)."""
    return tuple(route(r, settings) for r in settings.routes)


def issuer(given: IssuerSettings) -> Issuer:
    return Issuer(
        issuer=given.issuer,
        audiences=given.audiences,
        jwks_uri=given.jwks_uri,
        algorithms=given.algorithms,
        leeway=given.leeway,
        require_typ=given.require_typ,
        allow_http=given.allow_http,
        mode=given.mode,
        introspection=introspection(given.introspection) if given.introspection else None,
        ca_file=given.ca_file,
        dpop=given.dpop,
        revocation_events=(
            revocation_events(given.revocation_events) if given.revocation_events else None
        ),
    )


def revocation_events(given: RevocationEventsSettings) -> RevocationEvents:
    return RevocationEvents(
        client_id=given.client_id,
        client_secret=given.client_secret,
        url=given.url,
        on_stream_down=given.on_stream_down,
        max_stream_lag=given.max_stream_lag,
        max_entries=given.max_entries,
        idle_timeout=given.idle_timeout,
        max_backoff=given.max_backoff,
    )


def introspection(given: IntrospectionSettings) -> Introspection:
    return Introspection(
        client_id=given.client_id,
        client_secret=given.client_secret,
        url=given.url,
        cache_ttl=given.cache_ttl,
        inactive_cache_ttl=given.inactive_cache_ttl,
        cache_size=given.cache_size,
        timeout=given.timeout,
        max_connections=given.max_connections,
        max_pending=given.max_pending,
        cache=given.cache,
        cache_key_prefix=given.cache_key_prefix,
        cache_timeout=given.cache_timeout,
    )


def route(given: RouteSettings, settings: Settings) -> Route:
    """`given` with what it leaves out taken from the rest of `settings`."""
    limit = settings.rate_limits.default if given.rate_limit is None else given.rate_limit
    cors = settings.cors if given.cors is None else given.cors
    return Route(
        name=given.name,
        path=given.path,
        methods=given.methods,
        auth=given.auth,
        issuers=given.issuers,
        audience=given.audience,
        path_params=given.path_params,
        line=given.line,
        scopes=scopes(given.scopes) if given.scopes is not None else None,
        monitor=(given.mode or settings.mode) == "monitor",
        max_body_size=(
            given.max_body_size
            if given.max_body_size is not None
            else settings.limits.max_body_size
        ),
        rate_limit=limit or None,
        cors=cors or None,
        websocket=settings.websocket_of(given),
        allow_body_on_get=given.allow_body_on_get,
        client_cert=given.needs_client_cert,
        dpop=given.dpop,
        public_url=given.public_url or settings.public_url,
    )


def scopes(given: ScopeRule) -> Scopes:
    return Scopes(mode=given.mode, scopes=given.scopes)
