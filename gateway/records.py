"""What the running gateway knows of a trusted issuer and of a route, apart from the shape of
the configuration file.

The settings (settings.py) are the YAML's shape: optional keys, defaults that live in other
sections, spellings chosen for people. The records here are what the request path reads:
every default already resolved (a route's mode, body limit, CORS, rate limit and WebSocket
options), so a step never consults the file's layout. `adapter.py` is the one place that
builds records from settings; a new option is a field here and a line there.

A route's CORS, rate-limit and WebSocket options are the sections their own modules read
(cors.py, ratelimit.py, forward.py); they are held here as given, resolved.

Pure: no aiohttp, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .settings import CorsSettings, LimitRule, WebSocketSettings


@dataclass(frozen=True, slots=True)
class Introspection:
    """How the gateway asks one issuer about its tokens (RFC 7662), with its own credentials."""

    client_id: str
    client_secret: str
    url: str | None  # None: the issuer's discovery document names the endpoint
    cache_ttl: timedelta
    inactive_cache_ttl: timedelta
    cache_size: int
    timeout: timedelta
    max_connections: int
    max_pending: int
    cache: str | None  # redis://...: answers shared with other gateways; None: none
    cache_key_prefix: str
    cache_timeout: timedelta


@dataclass(frozen=True, slots=True)
class RevocationEvents:
    """The subscription to an issuer's revocation events (revocations.py)."""

    client_id: str
    client_secret: str
    url: str | None  # None: the issuer's discovery document names the stream
    on_stream_down: Literal["serve", "fail"]
    max_stream_lag: timedelta
    max_entries: int
    idle_timeout: timedelta
    max_backoff: timedelta


@dataclass(frozen=True, slots=True)
class Issuer:
    """A trusted issuer: how its tokens are verified."""

    issuer: str  # exactly as in `iss`
    audiences: tuple[str, ...]
    jwks_uri: str | None  # None: from discovery
    algorithms: tuple[str, ...]
    leeway: timedelta
    require_typ: bool
    allow_http: bool
    mode: Literal["jwt", "introspection", "auto"]
    introspection: Introspection | None
    ca_file: str | None  # None: the system's CAs
    dpop: Literal["required", "allowed"]  # required: its tokens DPoP-bound only (RFC 9449)
    revocation_events: RevocationEvents | None = None  # None: not subscribed

    @property
    def dpop_required(self) -> bool:
        return self.dpop == "required"

    @property
    def uses_keys(self) -> bool:
        return self.mode in ("jwt", "auto")

    @property
    def takes_opaque_tokens(self) -> bool:
        return self.mode in ("introspection", "auto")


@dataclass(frozen=True, slots=True)
class Scopes:
    """Scopes a token must carry on a route: `any` one of them, or `all`."""

    mode: Literal["any", "all"]
    scopes: frozenset[str]


@dataclass(frozen=True, slots=True)
class Route:
    """A route rule with its options resolved against the configuration's defaults. The
    first eight fields are what rules.py compiles (`rules.RouteSpec`)."""

    name: str
    path: str
    methods: frozenset[str] | None  # None: every method
    auth: Literal["required", "none"]
    issuers: tuple[str, ...] | None  # None: every issuer
    audience: str | None  # None: the issuer's audiences
    path_params: Literal["refuse", "allow"]
    line: int  # where the configuration file defines it
    scopes: Scopes | None
    monitor: bool  # refusals recorded, requests forwarded
    max_body_size: int | None  # None: unbounded
    rate_limit: LimitRule | None  # None: not limited
    cors: CorsSettings | None  # None: no CORS answers
    websocket: WebSocketSettings | None  # None: upgrades not proxied
    allow_body_on_get: bool
    client_cert: bool  # a verified TLS client certificate is required
    dpop: Literal["required", "allowed"]  # required: DPoP-bound tokens with their proof only
    public_url: str | None  # scheme://host[:port] clients reach it at; None: the request's

    @property
    def dpop_required(self) -> bool:
        return self.dpop == "required"
