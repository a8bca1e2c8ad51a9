"""Settings → records: the one place that turns the configuration file's shape into what the
running gateway reads (records.py). Each function copies its section field by field and
resolves the defaults other sections hold, so a new option is one field in records.py and
one line here (or none, where a record's fields are its section's own: `_copied`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from .core.records import (
    AccessLogOptions,
    Bucket,
    BucketStore,
    Cors,
    Forwarding,
    IdentityHeaders,
    Introspection,
    Issuer,
    KeySetTiming,
    Mcp,
    McpCall,
    Proofs,
    RequestPath,
    Resource,
    RevocationEvents,
    Route,
    Scopes,
    WebSocket,
)
from .settings import (
    AccessLogSettings,
    CorsSettings,
    IntrospectionSettings,
    IssuerSettings,
    LimitRule,
    McpSettings,
    RevocationEventsSettings,
    RouteSettings,
    ScopeRule,
    Settings,
    WebSocketSettings,
)
from .settings import IdentityHeaders as IdentityHeaderSettings

T = TypeVar("T")


def _copied(record: type[T], section: Any, **resolved: Any) -> T:
    """A record whose fields not `resolved` are the section's fields of the same names."""
    names = (f.name for f in dataclasses.fields(record))  # type: ignore[arg-type]
    values = {name: getattr(section, name) for name in names if name not in resolved}
    return record(**values, **resolved)


def key_set_timing(settings: Settings) -> KeySetTiming:
    return _copied(KeySetTiming, settings.jwks)


def cors(given: CorsSettings) -> Cors:
    return _copied(Cors, given)


def bucket(given: LimitRule) -> Bucket:
    return _copied(Bucket, given)


def bucket_store(settings: Settings) -> BucketStore:
    return _copied(BucketStore, settings.rate_limits)


def websocket(given: WebSocketSettings) -> WebSocket:
    return _copied(WebSocket, given)


def access_log(given: AccessLogSettings) -> AccessLogOptions:
    return _copied(AccessLogOptions, given)


def identity_headers(given: IdentityHeaderSettings) -> IdentityHeaders:
    return _copied(IdentityHeaders, given)


def request_path(settings: Settings) -> RequestPath:
    limits = settings.rate_limits
    return RequestPath(
        realm=settings.realm,
        fold_case=settings.upstream.path_case == "insensitive",
        monitor=settings.mode == "monitor",
        trusted_proxies=settings.trusted_proxies,
        limit_headers=limits.headers,
        pre_auth=bucket(limits.pre_auth) if limits.pre_auth is not None else None,
        on_backend_error=limits.on_backend_error,
        max_body_size=settings.limits.max_body_size,
        traceparent=settings.forward.traceparent,
        proofs=_copied(Proofs, settings.dpop),
    )


def forwarding(settings: Settings) -> Forwarding:
    up, forward, limits = settings.upstream, settings.forward, settings.limits
    return Forwarding(
        upstream_url=up.url,
        preserve_host=up.preserve_host,
        server_name=up.server_name,
        pool_timeout=up.pool_timeout,
        strip_authorization=forward.strip_authorization,
        buffer_size=forward.buffer_size,
        body_timeout=limits.body_timeout,
        body_total_timeout=limits.body_total_timeout,
        request_id_header=forward.request_id_header,
        traceparent=forward.traceparent,
        strip_method_override=forward.strip_method_override,
        trusted_proxies=settings.trusted_proxies,
        identity=identity_headers(settings.identity_headers),
        principals_reused=settings.token_cache_size > 0
        or any(issuer.mode != "jwt" for issuer in settings.issuers),
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


def resource_path(given: RouteSettings) -> str:
    """The path of the protected resource a route belongs to: its own `resource`, else its
    path's literal segments up to the first `{name}` or `**` ("" for the root)."""
    return given.resource_path


def resources(settings: Settings) -> tuple[Resource, ...]:
    """The protected resources the routes define (RFC 9728), one per origin and path, in
    the order their first route comes: what each route's rules accept, brought together."""
    named = {given.path.rstrip("/"): given for given in settings.resources}
    every_issuer = tuple(i.issuer for i in settings.issuers)
    groups: dict[tuple[str | None, str], list[RouteSettings]] = {}
    for given in settings.routes:
        if given.auth == "none":
            continue
        origin = given.public_url or settings.public_url
        groups.setdefault((origin, resource_path(given)), []).append(given)
    made = []
    for (origin, path), routes in groups.items():
        issuers = dict.fromkeys(i for r in routes for i in (r.issuers or every_issuer))
        scopes = {s for r in routes if r.scopes is not None for s in r.scopes.scopes}
        scopes |= {
            s for r in routes if r.mcp is not None for c in r.mcp.calls for s in c.scopes.scopes
        }
        # RFC 9728 §2: a scope of the authorization server's own (offline_access asks for
        # refresh tokens) is no scope of this resource.
        scopes.discard("offline_access")
        dpop_issuers = {i.issuer for i in settings.issuers if i.dpop == "required"}
        extra = named.get(path)
        made.append(
            Resource(
                path=path,
                origin=origin,
                issuers=tuple(issuers),
                scopes=tuple(sorted(scopes)),
                dpop_required=all(
                    r.dpop_required or set(r.issuers or every_issuer) <= dpop_issuers
                    for r in routes
                ),
                name=extra.name if extra is not None else None,
                documentation=extra.documentation if extra is not None else None,
            )
        )
    return tuple(made)


def mcp(given: McpSettings, settings: Settings) -> Mcp:
    return Mcp(
        calls=tuple(
            McpCall(method=c.method, name=c.name, scopes=scopes(c.scopes)) for c in given.calls
        ),
        max_message_size=given.max_message_size or settings.forward.buffer_size,
    )


def route(given: RouteSettings, settings: Settings) -> Route:
    """`given` with what it leaves out taken from the rest of `settings`."""
    limit = settings.rate_limits.default if given.rate_limit is None else given.rate_limit
    given_cors = settings.cors if given.cors is None else given.cors
    origin = given.public_url or settings.public_url
    protected = given.auth != "none"
    path = resource_path(given) if protected else None
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
        rate_limit=bucket(limit) if limit else None,
        cors=cors(given_cors) if given_cors else None,
        websocket=websocket(own) if (own := settings.websocket_of(given)) is not None else None,
        allow_body_on_get=given.allow_body_on_get,
        client_cert=given.needs_client_cert,
        dpop=given.dpop,
        public_url=origin,
        resource=path,
        resource_uri=origin + path if path is not None and origin is not None else None,
        mcp=mcp(given.mcp, settings) if given.mcp is not None else None,
    )


def scopes(given: ScopeRule) -> Scopes:
    return Scopes(mode=given.mode, scopes=given.scopes)
