"""What the running gateway knows of a trusted issuer and of a route, apart from the shape of
the configuration file.

The settings (settings.py) are the YAML's shape: optional keys, defaults that live in other
sections, spellings chosen for people. The records here are what the request path reads:
every default already resolved (a route's mode, body limit, CORS, rate limit and WebSocket
options), so a step never consults the file's layout. `adapter.py` is the one place that
builds records from settings; a new option is a field here and a line there.

Nothing below the composition root (app.py) and adapter.py imports the settings: each part
of the running gateway is given the record of what it reads (tests/test_architecture.py
keeps it so).

Pure: no aiohttp, no I/O.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from portcullis.addresses import IPNetwork
from portcullis.yamlconf import Rate

# The rate-limit keys that need a verified token (claim:NAME too).
IDENTITY_LIMIT_KEYS = ("subject", "client_id")


@dataclass(frozen=True, slots=True)
class KeySetTiming:
    """How issuers' key sets are kept (jwks.py): never fetched on a request but for one
    throttled refetch on an unknown kid."""

    min_ttl: timedelta
    max_ttl: timedelta
    refetch_cooldown: timedelta
    fetch_timeout: timedelta
    max_backoff: timedelta


@dataclass(frozen=True, slots=True)
class Cors:
    """A route's answers to CORS preflights and the fields of its actual answers (cors.py)."""

    allow_origins: tuple[str, ...]
    allow_methods: tuple[str, ...]
    allow_headers: tuple[str, ...]
    expose_headers: tuple[str, ...]
    allow_credentials: bool
    max_age: timedelta


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket (ratelimit.py): `burst` requests at once, refilled at `rate`, one per
    key (subject, client_id, ip, route, header:NAME, claim:NAME)."""

    rate: Rate
    burst: int
    key: str

    @property
    def needs_token(self) -> bool:
        return self.key in IDENTITY_LIMIT_KEYS or self.key.startswith("claim:")


@dataclass(frozen=True, slots=True)
class BucketStore:
    """Where the buckets live: in memory (`max_keys` of them) or in Redis."""

    backend: str  # memory, or a redis:// / rediss:// / unix:// URL
    timeout: timedelta
    max_keys: int
    max_connections: int
    key_prefix: str

    @property
    def redis(self) -> bool:
        return self.backend != "memory"


@dataclass(frozen=True, slots=True)
class WebSocket:
    """How a route's WebSocket sessions are relayed (forward.py)."""

    close_on_token_expiry: bool
    max_message_size: int
    heartbeat: timedelta | None


@dataclass(frozen=True, slots=True)
class AccessLogOptions:
    """The line per request (accesslog.py)."""

    enabled: bool
    output: str  # stderr, stdout or a file path
    include_query: bool
    subject: Literal["plain", "hashed", "omitted"]
    subject_hash_key: str
    flush_interval: timedelta


@dataclass(frozen=True, slots=True)
class IdentityHeaders:
    """The headers that carry the verified identity upstream (and to front proxies)."""

    subject: str
    client_id: str
    scopes: str
    issuer: str
    claims: Mapping[str, str]  # header name -> claim name
    client_cert_subject: str | None
    client_cert_san: str | None

    def names(self) -> tuple[str, ...]:
        return identity_header_names(self)

    @property
    def client_cert(self) -> bool:
        return self.client_cert_subject is not None or self.client_cert_san is not None


def identity_header_names(ids: IdentityHeaders | Any) -> tuple[str, ...]:
    """Every identity header's name, in order: the four fixed ones, the claims', the
    certificate's (for the record and for the settings section of the same fields)."""
    certificate = (ids.client_cert_subject, ids.client_cert_san)
    fixed = (ids.subject, ids.client_id, ids.scopes, ids.issuer)
    return (*fixed, *ids.claims, *(h for h in certificate if h is not None))


@dataclass(frozen=True, slots=True)
class Proofs:
    """How DPoP proofs are checked (RFC 9449), the replay cache apart."""

    proof_max_age: timedelta
    leeway: timedelta
    algorithms: tuple[str, ...]
    nonce: bool
    nonce_lifetime: timedelta
    nonce_key: str  # "": a random key per process


@dataclass(frozen=True, slots=True)
class RequestPath:
    """What the steps of a request read besides the routes and issuers (pipeline.py)."""

    realm: str
    fold_case: bool  # rules match the path in lower case (upstream.path_case: insensitive)
    monitor: bool  # the whole gateway in monitor mode
    trusted_proxies: tuple[IPNetwork, ...]
    limit_headers: bool  # RateLimit-Policy and RateLimit fields on answers
    pre_auth: Bucket | None  # charged per client address before a token is verified
    on_backend_error: Literal["allow", "deny"]  # when the buckets' store cannot answer
    max_body_size: int | None
    traceparent: bool
    proofs: Proofs


@dataclass(frozen=True, slots=True)
class Forwarding:
    """How admitted requests reach the upstream and its answers come back (forward.py)."""

    upstream_url: str
    preserve_host: bool
    server_name: str | None  # None: the URL's host
    pool_timeout: timedelta
    strip_authorization: bool
    buffer_size: int
    body_timeout: timedelta
    body_total_timeout: timedelta
    request_id_header: str
    traceparent: bool
    strip_method_override: bool
    trusted_proxies: tuple[IPNetwork, ...]
    identity: IdentityHeaders
    # Whether a principal serves more than one request (a cache gives it out again): only
    # then are its identity headers worth remembering.
    principals_reused: bool


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
class McpCall:
    """Scopes a JSON-RPC call needs: by its method and, for tools/call, prompts/get and
    resources/read, a glob on the name (or URI) it acts on (None: every name)."""

    method: str
    name: str | None
    scopes: Scopes
    # The glob compiled once, by fnmatch's case-sensitive rules (fnmatch.fnmatchcase).
    pattern: re.Pattern[str] | None = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        glob = None if self.name is None else re.compile(fnmatch.translate(self.name))
        object.__setattr__(self, "pattern", glob)


@dataclass(frozen=True, slots=True)
class Mcp:
    """A route that serves an MCP server (Streamable HTTP)."""

    calls: tuple[McpCall, ...]  # the first that matches decides
    max_message_size: int  # the most of a POST body read to decide its call


@dataclass(frozen=True, slots=True)
class Resource:
    """A protected resource (RFC 9728): where its routes are, and what its metadata says."""

    path: str  # "" for the root; no trailing slash
    origin: str | None  # scheme://host[:port] it is reached at; None: each request's own
    issuers: tuple[str, ...]  # authorization_servers
    scopes: tuple[str, ...]  # scopes_supported, sorted
    dpop_required: bool  # every route of it takes DPoP-bound tokens only
    name: str | None
    documentation: str | None

    @property
    def metadata_path(self) -> str:
        """RFC 9728 §3.1: the well-known path, with the resource's path after it."""
        return "/.well-known/oauth-protected-resource" + self.path


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
    rate_limit: Bucket | None  # None: not limited
    cors: Cors | None  # None: no CORS answers
    websocket: WebSocket | None  # None: upgrades not proxied
    allow_body_on_get: bool
    client_cert: bool  # a verified TLS client certificate is required
    dpop: Literal["required", "allowed"]  # required: DPoP-bound tokens with their proof only
    public_url: str | None  # scheme://host[:port] clients reach it at; None: the request's
    resource: str | None = None  # its protected resource's path (None: a public route)
    resource_uri: str | None = None  # that resource's canonical URI, when the origin is known
    mcp: Mcp | None = None  # None: not an MCP server

    @property
    def dpop_required(self) -> bool:
        return self.dpop == "required"
