"""The gateway's configuration, declared once: each section a frozen dataclass whose fields
carry their documentation, parser and bounds (portcullis.sections reads them from YAML with
FILE:LINE problems, and describes them as JSON Schema and the README's reference).

`load(path)` reads, interpolates `${VAR}` and `${file:PATH}`, validates every key (unknown
keys are errors), and checks the route table for duplicates and rules shadowed by an earlier
one (gateway.core.rules). Nothing here does I/O beyond reading the file and the files it names
(secrets, certificates and keys, which are loaded as the gateway would load them), so
`portcullis-gateway check` and the running gateway agree.

A key is one line in the section that holds it; what spans several keys is its `validate`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal
from urllib.parse import urlsplit

from portcullis import sections, tls, yamlconf
from portcullis.addresses import Address, IPNetwork, address, is_loopback, network, split_url
from portcullis.extras import missing_driver
from portcullis.sections import (
    Check,
    FrozenDict,
    accepts,
    named,
    section,
    section_line,
    setting,
    source_file,
)
from portcullis.tls import VerifyingServerTls
from portcullis.yamlconf import ConfigError, LocatedList, Rate

from .core import rules
from .core.records import IDENTITY_LIMIT_KEYS, identity_header_names
from .core.rules import HTTP_METHOD

# RFC 7518 §3.1 asymmetric algorithms plus EdDSA (RFC 8037). Symmetric (HS*) and `none` can
# never be verified against a public key set (RFC 8725 §3.1, §3.2), so they are not offered.
SUPPORTED_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
DEFAULT_ALGORITHMS = ("RS256", "ES256", "EdDSA")
HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
# Identity headers are stripped from every request: naming one of these would strip what HTTP
# or the gateway itself needs.
RESERVED_HEADERS = frozenset({
    "host", "authorization", "content-length", "content-type", "transfer-encoding", "connection",
    "upgrade", "te", "trailer", "keep-alive", "proxy-authorization", "cookie", "expect", "via",
    "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "forwarded", "x-request-id",
})
_FRAMING_OR_ROUTING = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer",
    "keep-alive", "expect", "authorization", "proxy-authorization",
})
SCOPE_TOKEN = re.compile(r"^[\x21\x23-\x5B\x5D-\x7E]+$")  # RFC 6749 §3.3 scope-token
SERVER_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")  # a DNS name, for SNI
LIMIT_KEYS = ("subject", "client_id", "ip", "route")
ZERO = timedelta(0)


# ---------------------------------------------------------------------------- values


def _text(value: Any, pattern: re.Pattern[str], problem: str) -> str:
    text = yamlconf.non_empty_string(value)
    if not pattern.match(text):
        raise ValueError(f"{text!r} {problem}")
    return text


@accepts({"type": "string", "title": "header name", "pattern": HEADER_NAME.pattern})
def header(value: Any) -> str:
    return _text(value, HEADER_NAME, "is not a valid header name")


@accepts({"type": "string", "title": "method", "pattern": HTTP_METHOD.pattern})
def method(value: Any) -> str:
    return _text(value, HTTP_METHOD, "is not an HTTP method in upper case")


@accepts({"type": "string", "title": "scope", "pattern": SCOPE_TOKEN.pattern})
def scope(value: Any) -> str:
    return _text(value, SCOPE_TOKEN, "is not a scope (no spaces, quotes or backslashes)")


@accepts({"type": "string", "title": "host name", "pattern": SERVER_NAME.pattern})
def server_name(value: Any) -> str:
    return _text(value, SERVER_NAME, "is not a host name (no scheme, port or path)")


@accepts({"type": "string"})
def header_or_star(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    return text if text == "*" else header(text)


@accepts({"type": "string"})
def realm(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if not re.fullmatch(r"[\x20\x21\x23-\x5B\x5D-\x7E]+", text):
        raise ValueError("may contain printable ASCII except quotes and backslashes")
    return text


@accepts({"type": "string", "pattern": r"^([\x21-\x7E]([\x20-\x7E]*[\x21-\x7E])?)?$"})
def server_header(value: Any) -> str:
    """RFC 9110 §10.2.4: product tokens and comments; here any visible ASCII with inner
    spaces, so the value can never break the header section. Empty: no Server field."""
    text = yamlconf.string(value)
    if text and not re.fullmatch(r"[\x21-\x7E](?:[\x20-\x7E]*[\x21-\x7E])?", text):
        raise ValueError("may contain printable ASCII only, without spaces at either end")
    return text


@accepts({"type": "string", "title": "URL", "pattern": "://"})
def url(value: Any) -> str:
    """An http(s) URL without query or fragment; whether plain http is allowed is the
    issuer's `allow_http` (checked by its section)."""
    text, parts = split_url(value)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ValueError(f"{text!r} is not an http(s) URL")
    if parts.query or parts.fragment:
        raise ValueError(f"{text!r} must not have a query or fragment")
    return text


@accepts({"type": "string", "title": "URL", "pattern": "://"})
def upstream_url(value: Any) -> str:
    text, parts = split_url(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{text!r} is not an http(s) URL")
    if parts.query or parts.fragment:
        raise ValueError("must not have a query or fragment")
    return text.rstrip("/")


def _plain_http(url: str | None) -> str | None:
    """Why `url` may not be used unless `allow_http` is set, if it may not."""
    parts = urlsplit(url or "")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        return (
            f"{url!r} uses plain http; tokens and keys must come over https "
            "(set allow_http: true only inside a trusted network)"
        )
    return None


@accepts({"enum": list(SUPPORTED_ALGORITHMS)})
def algorithm(value: Any) -> str:
    name = yamlconf.string(value)
    if name == "none" or name.upper() in ("HS256", "HS384", "HS512"):
        raise ValueError(
            f"{name} cannot be used: tokens are verified with the issuer's public keys, "
            "and symmetric or unsigned tokens would let anyone with the key set forge them"
        )
    if name not in SUPPORTED_ALGORITHMS:
        raise ValueError(
            f"unknown algorithm {name!r}; supported: {', '.join(SUPPORTED_ALGORITHMS)}"
        )
    return name


@accepts({"type": "string", "title": "path template", "pattern": "^/"})
def path_template(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    rules.Pattern.parse(text)  # refused here, on its line, rather than when compiled
    return text


@accepts({"type": "string", "pattern": r"^(subject|client_id|ip|route|header:.+|claim:.+)$"})
def limit_key(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if text in LIMIT_KEYS:
        return text
    kind, _, name = text.partition(":")
    if kind == "header":
        return f"header:{header(name).lower()}"
    if kind == "claim":
        if not name.strip():
            raise ValueError("claim: needs a claim name, like claim:tenant")
        return text
    raise ValueError(f"{text!r} is not one of {', '.join(LIMIT_KEYS)}, header:NAME, claim:NAME")


@accepts({"type": "string", "pattern": r"^(memory|rediss?://.+|unix:///?.+)$"})
def backend(value: Any) -> str:
    text, parts = split_url(value)
    if text == "memory" or (parts.scheme in ("redis", "rediss") and parts.hostname):
        return text
    if parts.scheme == "unix" and parts.path:
        return text
    raise ValueError(f"{text!r} is neither memory nor a redis://, rediss:// or unix:// URL")


@accepts({"type": "string", "pattern": r"^(rediss?://.+|unix:///?.+)$"})
def redis_url(value: Any) -> str:
    text, parts = split_url(value)
    if (parts.scheme in ("redis", "rediss") and parts.hostname) or (
        parts.scheme == "unix" and parts.path
    ):
        return text
    raise ValueError(f"{text!r} is not a redis://, rediss:// or unix:// URL")


@accepts({"type": "string", "title": "origin", "pattern": r"^(\*|[^:/]+://[^/]+)$"})
def origin(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if text == "*":
        return text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username:
        parts = parts._replace(path="?")  # refused below with the same words
    if parts.path or parts.query or parts.fragment:
        raise ValueError(
            f"{text!r} is not an origin (scheme://host[:port], no path or trailing slash)"
        )
    # Browsers send scheme and host in lower case (RFC 6454 §6.2).
    return text.lower()


@accepts({"type": "string", "title": "URL", "pattern": "^https?://[^/]+/?$"})
@accepts({"type": "string", "pattern": r"^(/[A-Za-z0-9._~!$&'()*+,;=:@%-]+)*/?$"})
def resource_path(value: Any) -> str:
    """A resource's path: literal segments, no trailing slash (RFC 9728 §1.2: the resource
    identifier has no fragment, and its canonical form no trailing slash)."""
    text = yamlconf.non_empty_string(value)
    if not re.fullmatch(r"(/[A-Za-z0-9._~!$&'()*+,;=:@%-]+)*/?", text) or "/." in text:
        raise ValueError(f"{text!r} is not a path of literal segments")
    return text.rstrip("/")


def public_url(value: Any) -> str:
    """scheme://host[:port], as clients write it: where the gateway is reached from outside."""
    text, parts = split_url(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{text!r} is not an http(s) URL")
    if parts.username or parts.password or parts.path not in ("", "/"):
        raise ValueError(f"{text!r} must be scheme://host[:port] alone (no user, path or query)")
    if parts.query or parts.fragment:
        raise ValueError(f"{text!r} must be scheme://host[:port] alone (no user, path or query)")
    return text.rstrip("/")


# ---------------------------------------------------------------------------- upstream


@section
class UpstreamSettings:
    """The API that requests go to."""

    url: str = setting("Base URL of the API (http or https).", parser=upstream_url)
    connect_timeout: timedelta = setting("Time to connect.", default=timedelta(seconds=2))
    read_timeout: timedelta = setting("Time for the answer to start.", default=timedelta(seconds=30))
    max_connections: int = setting("Pooled connections per process.", default=256, minimum=1, maximum=100_000)
    preserve_host: bool = setting("Send the client's Host instead of the URL's host.", default=False)
    path_case: Literal["sensitive", "insensitive"] = setting("How rules compare paths: as written, or in lower case for an API that serves /Docs as /docs.", default="sensitive")
    pool_timeout: timedelta = setting("Wait for a free pooled connection, then 503.", default=timedelta(seconds=5), more_than=ZERO)
    ca_file: str | None = setting("https: CA its certificate chains to; the system's when absent.", default=None)
    server_name: str | None = setting("https: name checked and sent as SNI; the URL's host when absent.", default=None, parser=server_name)
    cert_file: str | None = setting("https: client certificate (PEM) to present.", default=None)
    key_file: str | None = setting("https: its private key (PEM).", default=None)

    def validate(self, check: Check) -> None:
        """TLS options need an https URL, a client certificate needs its key, and every file
        named must load as the gateway will load it."""
        options = [k for k in ("ca_file", "server_name", "cert_file", "key_file") if check.has(k)]
        if options and urlsplit(self.url).scheme != "https":
            for key in options:
                check.problem("only with an https:// url", key=key)
            return
        if (self.cert_file is None) != (self.key_file is None):
            missing = "key_file" if self.key_file is None else "cert_file"
            check.problem(
                f"a client certificate needs both cert_file and key_file ({missing} is missing)"
            )
            return
        if check.secrets and self.ca_file is not None:
            tls.check_ca(check, "ca_file", self.ca_file)
        if check.secrets and self.cert_file is not None and self.key_file is not None:
            tls.check_client_pair(check, self.cert_file, self.key_file)


# ---------------------------------------------------------------------------- issuers


@section
class IntrospectionSettings:
    """How the gateway asks the issuer about a token (RFC 7662), with its own credentials."""

    client_id: str = setting("The gateway's client_id at the issuer.")
    client_secret: str = setting("Its client secret.", secret=True, from_file=True)
    url: str | None = setting("Introspection endpoint; discovery's when absent.", default=None, parser=url)
    cache_ttl: timedelta = setting("How long an active answer is kept (never past exp).", default=timedelta(seconds=10))
    inactive_cache_ttl: timedelta = setting("How long an inactive answer is kept.", default=timedelta(seconds=2))
    cache_size: int = setting("Answers kept at most.", default=10_000, minimum=0, maximum=10**7)
    timeout: timedelta = setting("Time the issuer gets to answer.", default=timedelta(seconds=2), more_than=ZERO)
    max_connections: int = setting("Connections to the issuer per process.", default=32, minimum=1, maximum=10_000)
    max_pending: int = setting("Distinct tokens asked about at once; more get 503 at once.", default=1024, minimum=1, maximum=1_000_000)
    cache: str | None = setting("redis://host:port/db (or rediss://, unix://): answers shared by every gateway using it; none when absent.", default=None, parser=redis_url)
    cache_key_prefix: str = setting("Prefix of its Redis keys.", default="portcullis:introspection:", parser=yamlconf.string)
    cache_timeout: timedelta = setting("Time Redis gets to answer; then the issuer is asked.", default=timedelta(milliseconds=100), more_than=ZERO)

    def validate(self, check: Check) -> None:
        # The driver is imported only when serving: check tells what run would stop on.
        if check.secrets and self.cache is not None and (problem := missing_driver("redis", "redis")):
            check.problem(f"a Redis cache {problem}", key="cache")


@section
class RevocationEventsSettings:
    """The issuer's stream of revocation events (Security Event Tokens over Server-Sent
    Events), read with the gateway's credentials: revoked tokens are refused within about a
    second, even where JWTs are verified locally."""

    client_id: str = setting("The gateway's client_id at the issuer (a client allowed to introspect).")
    client_secret: str = setting("Its client secret (sent with HTTP Basic).", secret=True, from_file=True)
    url: str | None = setting("The stream's URL; discovery's revocation_events_endpoint when absent.", default=None, parser=url)
    on_stream_down: Literal["serve", "fail"] = setting("While the stream is down: serve (tokens verified as usual, logged and counted) or fail (503 for this issuer's tokens once it has been down max_stream_lag).", default="serve")
    max_stream_lag: timedelta = setting("How long the stream may be down before on_stream_down: fail refuses.", default=timedelta(seconds=30), more_than=ZERO)
    max_entries: int = setting("Revoked tokens and cut-offs kept at most; beyond it those expiring first are dropped (logged and counted).", default=100_000, minimum=1, maximum=10**8)
    idle_timeout: timedelta = setting("Silence (no event, no heartbeat) after which the connection is made again.", default=timedelta(seconds=45), more_than=ZERO)
    max_backoff: timedelta = setting("Longest wait between reconnection attempts.", default=timedelta(seconds=10), more_than=ZERO)


@section
class IssuerSettings:
    """A trusted token issuer; its discovery document gives jwks_uri and introspection_endpoint."""

    issuer: str = setting("The issuer's URL, exactly as in `iss`.", parser=url)
    # Required, but checked by validate(): a missing list leaves the rest of the issuer checked.
    audiences: tuple[str, ...] = setting("Values of `aud` accepted; required (RFC 9068 §4).", default=())
    jwks_uri: str | None = setting("Key set URL; discovery's jwks_uri when absent.", default=None, parser=url)
    algorithms: tuple[str, ...] = setting("Signature algorithms accepted.", default=DEFAULT_ALGORITHMS, parser=algorithm, min_items=1)
    leeway: timedelta = setting("Clock skew allowed on exp, nbf and iat.", default=timedelta(seconds=30))
    require_typ: bool = setting("Require `typ: at+jwt` (RFC 9068 §2.1).", default=True)
    allow_http: bool = setting("Allow plain http URLs off loopback (trusted networks only).", default=False)
    line: int = section_line()
    mode: Literal["jwt", "introspection", "auto"] = setting("jwt: verified locally; introspection: asked about; auto: JWTs locally, other tokens asked about.", default="jwt")
    introspection: IntrospectionSettings | None = setting("Needed by modes introspection and auto.", default=None)
    ca_file: str | None = setting("CA for discovery, keys and introspection; the system's when absent.", default=None)
    dpop: Literal["required", "allowed"] = setting("required: this issuer's tokens are accepted only DPoP-bound, with their proof.", default="allowed")
    revocation_events: RevocationEventsSettings | None = setting("Subscribe to the issuer's revocation events.", default=None)

    @property
    def uses_keys(self) -> bool:
        return self.mode in ("jwt", "auto")

    @property
    def takes_opaque_tokens(self) -> bool:
        return self.mode in ("introspection", "auto")

    def validate(self, check: Check) -> None:
        if not self.audiences:
            check.problem("audiences is required (RFC 9068 §4: aud is checked)")
        for key in ("issuer", "jwks_uri"):
            if not self.allow_http and (problem := _plain_http(getattr(self, key))):
                check.problem(problem, key=key)
        if check.has("introspection") and self.mode == "jwt":
            check.problem("only used with mode introspection or auto", key="introspection")
        elif self.takes_opaque_tokens and not check.has("introspection"):
            check.problem_at(
                check.line_of("mode"),
                f"{check.where}: mode {self.mode} needs an introspection section "
                "(client_id and client_secret of the gateway)",
            )
        url = self.introspection.url if self.introspection else None
        if self.introspection and not self.allow_http and (problem := _plain_http(url)):
            check.within(self.introspection).problem(problem, key="url")
        events = self.revocation_events
        if events and not self.allow_http and (problem := _plain_http(events.url)):
            check.within(events).problem(problem, key="url")
        if self.ca_file is not None and check.secrets:
            tls.check_ca(check, "ca_file", self.ca_file)


@section
class JwksSettings:
    """How key sets are cached: never fetched on a request but for one throttled refetch on an
    unknown kid."""

    min_ttl: timedelta = setting("Shortest time a key set is kept.", default=timedelta(minutes=5))
    max_ttl: timedelta = setting("Longest time a key set is kept.", default=timedelta(hours=24))
    refetch_cooldown: timedelta = setting("Least time between refetches for an unknown kid.", default=timedelta(seconds=30))
    fetch_timeout: timedelta = setting("Time a fetch may take.", default=timedelta(seconds=5))
    max_backoff: timedelta = setting("Longest wait between retries after failures.", default=timedelta(minutes=1))

    def validate(self, check: Check) -> None:
        if self.min_ttl > self.max_ttl:
            check.problem("min_ttl must not exceed max_ttl")


# ---------------------------------------------------------------------------- forwarding


@section
class IdentityHeaders:
    """Headers carrying the verified identity upstream; clients' copies are always removed."""

    subject: str = setting("For the token's `sub`.", default="X-Auth-Subject", parser=header)
    client_id: str = setting("For the client.", default="X-Auth-Client-Id", parser=header)
    scopes: str = setting("For the scopes, space-separated.", default="X-Auth-Scopes", parser=header)
    issuer: str = setting("For the issuer.", default="X-Auth-Issuer", parser=header)
    claims: Mapping[str, str] = setting("More: header name to claim name.", default_factory=FrozenDict, keys=header)
    client_cert_subject: str | None = setting("For a verified client certificate's subject DN.", default=None, parser=header)
    client_cert_san: str | None = setting("For its subject alternative names.", default=None, parser=header)

    def names(self) -> tuple[str, ...]:
        return identity_header_names(self)

    @property
    def client_cert(self) -> bool:
        return self.client_cert_subject is not None or self.client_cert_san is not None

    def validate(self, check: Check) -> None:
        lowered = [n.lower().replace("_", "-") for n in self.names()]
        if len(set(lowered)) != len(lowered):
            check.problem("two identity values use the same header")
        for name in sorted(set(lowered) & RESERVED_HEADERS):
            check.problem(f"{name} cannot carry an identity")


@section
class ForwardSettings:
    """How requests are passed on."""

    strip_authorization: bool = setting("Remove Authorization before forwarding.", default=False)
    request_id_header: str = setting("Request id, kept or created.", default="X-Request-Id", parser=header)
    buffer_size: int = setting("Bodies with a Content-Length up to this go in one piece.", default=64 * 1024, parser=yamlconf.size)
    traceparent: bool = setting("W3C Trace Context: propagated, created when absent.", default=True)
    # The methods a route names are checked on the method the gateway saw: an upstream that
    # honoured X-HTTP-Method-Override would run another one.
    strip_method_override: bool = setting("Drop X-HTTP-Method-Override and its kin.", default=True)

    def validate(self, check: Check) -> None:
        # The request id goes upstream as a header the gateway sets: one that frames the
        # message or routes it would change how the upstream reads the request.
        if self.request_id_header.lower().replace("_", "-") in _FRAMING_OR_ROUTING:
            check.problem(f"{self.request_id_header} cannot carry the request id", key="request_id_header")


@section
class Limits:
    """Bounds on what clients send."""

    max_line_size: int = setting("Longest request line.", default=8 * 1024, parser=yamlconf.size)
    max_field_size: int = setting("Longest header.", default=8 * 1024, parser=yamlconf.size)
    max_headers: int = setting("Most headers.", default=100, minimum=1, maximum=10_000)
    max_body_size: int | None = setting("Largest body (413); none when absent.", default=None, parser=yamlconf.size)
    idle_timeout: timedelta = setting("Idle keep-alive connections are closed.", default=timedelta(seconds=60))
    body_timeout: timedelta = setting("Longest pause inside a body.", default=timedelta(seconds=30))
    body_total_timeout: timedelta = setting("A whole body, however it trickles.", default=timedelta(minutes=5), more_than=ZERO)
    max_bodies_per_client: int = setting("Bodies at once from one address; 0: any.", default=32, minimum=0, maximum=1_000_000)
    max_connections: int = setting("Client connections per process.", default=10_000, minimum=1, maximum=10**7)


# ---------------------------------------------------------------------------- rate limits


def _default_burst(values: Mapping[str, Any]) -> int:
    rate = values.get("rate")
    return max(1, math.ceil(rate.count)) if isinstance(rate, Rate) else 1


@section
class LimitRule:
    """A token bucket: `burst` requests at once, refilled at `rate`, one bucket per key."""

    rate: Rate = setting("Refill rate, like 100/s or 3/10s.")
    burst: int = setting("Bucket size; the rate's count when absent.", derive=_default_burst, minimum=1, maximum=10**9)
    key: str = setting("subject, client_id, ip, route, header:NAME or claim:NAME.", default="subject", parser=limit_key)
    line: int = section_line()

    @property
    def needs_token(self) -> bool:
        return self.key in IDENTITY_LIMIT_KEYS or self.key.startswith("claim:")


@section
class PreAuthLimit(LimitRule):
    """A token bucket per client address, charged before a token is verified."""

    key: Literal["ip"] = setting("Always ip: nothing else is known yet.", default="ip")


@section
class RateLimitSettings:
    """Rate limiting: buckets in memory, or shared in Redis."""

    backend: str = setting("memory, redis://host:port/db, rediss://... or unix:///path.", default="memory", parser=backend)
    default: LimitRule | None = setting("For routes without their own.", default=None)
    pre_auth: PreAuthLimit | None = setting("Per client address, before verifying a token.", default=None)
    on_backend_error: Literal["allow", "deny"] = setting("When Redis cannot answer.", default="allow")
    timeout: timedelta = setting("Time Redis gets to answer.", default=timedelta(milliseconds=100), more_than=ZERO)
    max_keys: int = setting("Buckets the memory backend keeps.", default=100_000, minimum=1, maximum=10**8)
    max_connections: int = setting("Connections to Redis per process.", default=32, minimum=1, maximum=10_000)
    key_prefix: str = setting("Prefix of Redis keys.", default="portcullis:rl:", parser=yamlconf.string)
    headers: bool = setting("RateLimit-Policy and RateLimit headers on answers.", default=True)

    @property
    def redis(self) -> bool:
        return self.backend != "memory"

    def validate(self, check: Check) -> None:
        # The driver is imported only when serving: check tells what run would stop on.
        if check.secrets and self.redis and (problem := missing_driver("redis", "redis")):
            check.problem(f"a Redis backend {problem}", key="backend")


# ---------------------------------------------------------------------------- CORS, WebSockets


@section
class CorsSettings:
    """Answers to browsers' CORS preflights, and the headers on actual responses."""

    allow_origins: tuple[str, ...] = setting("Exact origins (scheme://host[:port]), or [*].", parser=origin, min_items=1)
    allow_methods: tuple[str, ...] = setting("Methods allowed.", default=("GET", "HEAD", "POST"), parser=method)
    allow_headers: tuple[str, ...] = setting("Request headers allowed, or *.", default=("Authorization", "Content-Type"), parser=header_or_star)
    expose_headers: tuple[str, ...] = setting("Response headers scripts may read.", default=(), parser=header)
    allow_credentials: bool = setting("Allow cookies and client certificates.", default=False)
    max_age: timedelta = setting("How long a preflight's answer is kept.", default=timedelta(minutes=10))
    line: int = section_line()

    def validate(self, check: Check) -> None:
        if "*" in self.allow_origins and len(self.allow_origins) > 1:
            check.problem("* stands alone", key="allow_origins")
        if "*" in self.allow_origins and self.allow_credentials:
            # Fetch §3.2.5: browsers refuse a credentialed answer with a wildcard origin.
            check.problem_at(
                check.line_of("allow_credentials"),
                f"{check.where}: allow_credentials cannot be used with allow_origins: [*]; "
                "list the origins",
            )


@section
class WebSocketSettings:
    """Upgrades proxied on routes with `websocket`."""

    close_on_token_expiry: bool = setting("Close when the token expires.", default=False)
    max_message_size: int = setting("Largest message either way.", default=4 * 1024**2, parser=yamlconf.size)
    heartbeat: timedelta | None = setting("Ping both peers this often; never when absent.", default=None, more_than=ZERO)


@section
class RouteWebSocket:
    """A route's changes to the global websocket settings."""

    close_on_token_expiry: bool | None = setting("As in websocket.", default=None)
    max_message_size: int | None = setting("As in websocket.", default=None, parser=yamlconf.size)
    heartbeat: timedelta | None = setting("As in websocket.", default=None, more_than=ZERO)


# ---------------------------------------------------------------------------- logs, reload


@section
class AccessLogSettings:
    """A line per request: asked for, not imposed (it costs a few percent of throughput)."""

    enabled: bool = setting("Whether lines are written.", default=True)
    output: str = setting("stderr, stdout or a file path (appended to).", default="stderr")
    include_query: bool = setting("Log query strings too.", default=False)
    subject: Literal["plain", "hashed", "omitted"] = setting("How subjects are logged.", default="plain")
    subject_hash_key: str = setting("Key of the subjects' hash.", default="", secret=True, from_file=True)
    flush_interval: timedelta = setting("How often lines are written out.", default=timedelta(milliseconds=200))

    def validate(self, check: Check) -> None:
        if self.subject == "hashed" and not self.subject_hash_key:
            check.problem_at(
                check.line_of("subject"),
                f"{check.where}: subject: hashed needs subject_hash_key (a secret, so that "
                "subjects cannot be recovered by hashing guesses)",
            )


@section
class ReloadSettings:
    """Reloading the file while serving (also on SIGHUP)."""

    watch: bool = setting("Reload when the file changes.", default=True)
    interval: timedelta = setting("How often the file is looked at.", default=timedelta(seconds=1), minimum=timedelta(milliseconds=10))


# ---------------------------------------------------------------------------- front proxies


@section
class ExtAuthzSettings:
    """Decisions served to front proxies (nginx auth_request, Traefik and Caddy forward auth,
    Envoy ext_authz) on a listener of their own: allow or deny, nothing forwarded."""

    listen: Address = setting("Where the front proxies ask; never the public listener.", parser=address)
    trusted_callers: tuple[IPNetwork, ...] = setting("Addresses of the front proxies; any other caller gets 403.", parser=network, min_items=1)
    line: int = section_line()


# ---------------------------------------------------------------------------- DPoP


@section
class DpopSettings:
    """DPoP (RFC 9449): the proof that a client holds the key its token is bound to."""

    proof_max_age: timedelta = setting("How old a proof may be (by its iat).", default=timedelta(seconds=60), more_than=ZERO)
    leeway: timedelta = setting("Clock skew allowed on a proof's iat, either way.", default=timedelta(seconds=5))
    algorithms: tuple[str, ...] = setting("Proof signature algorithms accepted.", default=SUPPORTED_ALGORITHMS, parser=algorithm, min_items=1)
    replay_cache_size: int = setting("Proofs the memory replay cache holds; past it new proofs get 503.", default=200_000, minimum=1, maximum=10**8)
    replay_key_prefix: str = setting("Prefix of the replay cache's Redis keys.", default="portcullis:dpop:", parser=yamlconf.string)
    nonce: bool = setting("Require server-provided nonces in proofs (RFC 9449 §9), given in DPoP-Nonce.", default=False)
    nonce_lifetime: timedelta = setting("How long a nonce is accepted.", default=timedelta(minutes=5), minimum=timedelta(seconds=4))
    nonce_key: str = setting("Key nonces are made with, the same on every replica; a random one per process when empty.", default="", secret=True, from_file=True)


# ---------------------------------------------------------------------------- routes


@section
class ScopeRule:
    """Scopes a token must carry: `any` one of them, or `all`."""

    any_of: frozenset[str] | None = setting("Any one of these.", default=None, key="any", parser=scope, min_items=1)
    all_of: frozenset[str] | None = setting("All of these.", default=None, key="all", parser=scope, min_items=1)

    @property
    def mode(self) -> Literal["any", "all"]:
        return "all" if self.all_of is not None else "any"

    @property
    def scopes(self) -> frozenset[str]:
        return self.all_of if self.all_of is not None else self.any_of or frozenset()

    def validate(self, check: Check) -> None:
        if (self.any_of is None) == (self.all_of is None):
            check.problem("give exactly one of any or all")


# MCP methods (Model Context Protocol, 2025-06-18 to 2026-07-28) a client sends a server;
# a rule naming another is reported by `check` (a typo would never match).
MCP_METHODS = frozenset({
    "initialize", "ping", "tools/list", "tools/call", "resources/list", "resources/read",
    "resources/templates/list", "resources/subscribe", "resources/unsubscribe", "prompts/list",
    "prompts/get", "completion/complete", "logging/setLevel", "tasks/get", "tasks/list",
    "tasks/result", "tasks/cancel", "subscriptions/listen", "notifications/initialized",
    "notifications/cancelled", "notifications/progress", "notifications/roots/list_changed",
})
# The methods whose params name what they act on (`Mcp-Name`): a tool, a prompt, a resource.
MCP_NAMED_METHODS = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri",
                     "resources/subscribe": "uri", "resources/unsubscribe": "uri"}


@accepts({"type": "string", "pattern": r"^[A-Za-z0-9_./:*?-]+$"})
def mcp_name(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if not re.fullmatch(r"[A-Za-z0-9_./:*?-]+", text):
        raise ValueError(f"{text!r} is not a name pattern (letters, digits, _ . / : - and * ?)")
    return text


@section
class McpCallRule:
    """Scopes a JSON-RPC call needs, by method and, for a tool, prompt or resource, its name."""

    method: str = setting("The JSON-RPC method, as tools/call.", parser=yamlconf.non_empty_string)
    scopes: ScopeRule = setting("Scopes the call needs, beyond the route's.")
    name: str | None = setting("A glob (* and ?) on the tool or prompt name, or the resource URI; every name when absent.", default=None, parser=mcp_name)
    line: int = section_line()

    def validate(self, check: Check) -> None:
        if self.method not in MCP_METHODS:
            check.problem(f"{self.method} is not an MCP method a client sends", key="method")
        if self.name is not None and self.method not in MCP_NAMED_METHODS:
            check.problem(f"{self.method} names nothing to match", key="name")


@section
class McpSettings:
    """The route serves an MCP server (Streamable HTTP): the client's credentials never go
    upstream, and each JSON-RPC call can need scopes of its own."""

    calls: tuple[McpCallRule, ...] = setting("Rules in order, the first that matches a call decides; calls no rule matches need only the route's scopes.", default=())
    max_message_size: int | None = setting("Largest JSON-RPC message read to decide a call (413 over it); forward.buffer_size when absent.", default=None, parser=yamlconf.size)

    def validate(self, check: Check) -> None:
        for later_index, later in enumerate(self.calls):
            for earlier in self.calls[:later_index]:
                if earlier.method == later.method and _name_covers(earlier.name, later.name):
                    check.problem_at(
                        later.line,
                        f"{check.where}.calls: the rule for {later.method} "
                        f"{later.name or '(every name)'} is never reached: the rule on line "
                        f"{earlier.line} takes its calls first",
                    )
                    break


def _name_covers(outer: str | None, inner: str | None) -> bool:
    """Whether every name `inner` matches is matched by `outer` (decided for the common
    shapes: every name, the same pattern, a prefix with `*`)."""
    if outer is None or outer == "*" or outer == inner:
        return True
    if inner is None:
        return False
    if outer.endswith("*") and not any(c in outer[:-1] for c in "*?"):
        return inner.startswith(outer[:-1])
    return not any(c in inner for c in "*?") and fnmatch.fnmatchcase(inner, outer)


@section
class ResourceSettings:
    """What the protected resource metadata (RFC 9728) says of a resource beyond what the
    routes give: its name and documentation."""

    path: str = setting("The resource's path, as its routes give it (/mcp for routes under /mcp).", parser=yamlconf.non_empty_string)
    name: str | None = setting("resource_name: a name for people.", default=None, parser=yamlconf.non_empty_string)
    documentation: str | None = setting("resource_documentation: a URL of documentation for developers.", default=None, parser=yamlconf.non_empty_string)
    line: int = section_line()


@section
class RouteSettings:
    """A rule for the requests it matches; the first rule that matches decides."""

    name: str = setting("Names the rule in logs, metrics and errors.")
    path: str = setting("Path template: /literal, {name} for a segment, a last ** for any.", parser=path_template)
    methods: frozenset[str] | None = setting("Methods matched (GET takes HEAD); all when absent.", default=None, parser=method, min_items=1)
    auth: Literal["required", "none"] = setting("Whether a token is needed.", default="required")
    issuers: tuple[str, ...] | None = setting("Issuers accepted; all when absent.", default=None)
    audience: str | None = setting("The `aud` needed; the issuer's audiences when absent.", default=None)
    scopes: ScopeRule | None = setting("Scopes the token must carry.", default=None)
    max_body_size: int | None = setting("Largest body; limits.max_body_size when absent.", default=None, parser=yamlconf.size)
    line: int = section_line()
    mode: Literal["enforce", "monitor"] | None = setting("The global mode when absent.", default=None)
    rate_limit: LimitRule | Literal[False] | None = setting("false for none; rate_limits.default when absent.", default=None)
    cors: CorsSettings | Literal[False] | None = setting("false for none; the global cors when absent.", default=None)
    websocket: RouteWebSocket | Literal[True, False] | None = setting("Proxy upgrades: true, or changes to the global websocket.", default=None)
    path_params: Literal["refuse", "allow"] = setting("`;` path parameters: refused, or matched without.", default="refuse")
    allow_body_on_get: bool = setting("Accept a body on GET and HEAD (400 otherwise).", default=False)
    client_cert: Literal["required", "optional"] = setting("required: a verified client certificate.", default="optional")
    dpop: Literal["required", "allowed"] = setting("required: DPoP-bound tokens only; allowed: bearer tokens too (a bound token always needs its proof).", default="allowed")
    public_url: str | None = setting("scheme://host[:port] clients reach this route at; the global public_url when absent.", default=None, parser=public_url)
    resource: str | None = setting("The path of the protected resource it belongs to (RFC 9728); its path up to the first {name} or ** when absent.", default=None, parser=resource_path)
    mcp: McpSettings | None = setting("An MCP server: no token passthrough, scopes per JSON-RPC call.", default=None)

    @property
    def dpop_required(self) -> bool:
        return self.dpop == "required"

    @property
    def needs_client_cert(self) -> bool:
        return self.client_cert == "required"

    @property
    def resource_path(self) -> str:
        """The path of the protected resource it belongs to: its own `resource`, else its
        path's literal segments up to the first `{name}` or `**` ("" for the root)."""
        if self.resource is not None:
            return self.resource
        literal = []
        for segment in self.path.strip("/").split("/"):
            if not segment or "{" in segment or "*" in segment:
                break
            literal.append(segment)
        return "".join("/" + segment for segment in literal)

    @property
    def resource_uri(self) -> str | None:
        """Known once the routes are resolved against the public URL (adapter.py)."""
        return None

    def validate(self, check: Check) -> None:
        if self.issuers == ():
            check.problem("list at least one issuer (or leave the key out for all)", key="issuers")
        if self.auth == "none":
            for key in ("issuers", "audience", "scopes", "dpop", "public_url", "resource", "mcp"):
                if check.has(key):
                    check.problem("means nothing with auth: none", key=key)
            if isinstance(self.rate_limit, LimitRule) and self.rate_limit.needs_token:
                check.problem_at(
                    check.line_of("rate_limit"),
                    f"{check.where}.rate_limit.key: {self.rate_limit.key} needs a token, and "
                    "this route has auth: none (use ip, route or header:NAME)",
                )


# ---------------------------------------------------------------------------- the file


@section
class Settings:
    """Configuration of the Portcullis gateway."""

    file: str = source_file()
    upstream: UpstreamSettings = setting("The API requests go to.", hint="the API requests go to")
    issuers: tuple[IssuerSettings, ...] = setting("Trusted token issuers.", min_items=1, hint="a list of trusted token issuers")
    routes: tuple[RouteSettings, ...] = setting("Rules in order; no match: 404.", label=named("route", "name"), hint="unmatched requests are denied")
    listen: Address = setting("Where clients connect.", default=Address("0.0.0.0", 8080), parser=address)
    admin_listen: Address = setting("/healthz, /readyz and /metrics.", default=Address("127.0.0.1", 9901), parser=address)
    realm: str = setting("Realm of WWW-Authenticate challenges.", default="portcullis", parser=realm)
    server_header: str = setting("Server field of the gateway's own answers; empty: none.", default="", parser=server_header)
    unmatched: Literal["deny"] = setting("What unmatched requests get.", default="deny")
    jwks: JwksSettings = setting("Key set caching.", default_factory=JwksSettings)
    identity_headers: IdentityHeaders = setting("Identity sent upstream.", default_factory=IdentityHeaders)
    forward: ForwardSettings = setting("Forwarding.", default_factory=ForwardSettings)
    limits: Limits = setting("Bounds on requests.", default_factory=Limits)
    token_cache_size: int = setting("Verified tokens kept.", default=100_000, minimum=0, maximum=10**7)
    workers: int = setting("Processes sharing the port.", default=1, minimum=1, maximum=256)
    shutdown_grace: timedelta = setting("Time requests in flight get on shutdown.", default=timedelta(seconds=20))
    log_level: Literal["debug", "info", "warning", "error"] = setting("Least severity logged.", default="info")
    mode: Literal["enforce", "monitor"] = setting("monitor: refusals logged, requests forwarded.", default="enforce")
    rate_limits: RateLimitSettings = setting("Rate limiting.", default_factory=RateLimitSettings)
    trusted_proxies: tuple[IPNetwork, ...] = setting("Peers whose X-Forwarded-For is believed.", default=(), parser=network)
    cors: CorsSettings | None = setting("CORS for every route; none when absent.", default=None)
    websocket: WebSocketSettings = setting("For routes with websocket.", default_factory=WebSocketSettings)
    access_log: AccessLogSettings | Literal[True, False] = setting("true, or a mapping; off when absent.", default=False)
    reload: ReloadSettings = setting("Reloading.", default_factory=ReloadSettings)
    tls: VerifyingServerTls | None = setting("HTTPS on the public listener.", default=None)
    ext_authz: ExtAuthzSettings | None = setting("Decisions for front proxies; off when absent.", default=None)
    dpop: DpopSettings = setting("DPoP-bound tokens (RFC 9449).", default_factory=DpopSettings)
    public_url: str | None = setting("scheme://host[:port] clients reach the gateway at (behind a TLS terminator); the request's own when absent.", default=None, parser=public_url)
    resources: tuple[ResourceSettings, ...] = setting("Names and documentation of the protected resources the routes define.", default=())

    def issuer(self, url: str) -> IssuerSettings | None:
        return next((i for i in self.issuers if i.issuer == url), None)

    @property
    def request_log(self) -> AccessLogSettings:
        """The access log's settings (`enabled` false when it is off)."""
        if isinstance(self.access_log, AccessLogSettings):
            return self.access_log
        return AccessLogSettings(enabled=self.access_log)

    def websocket_of(self, route: RouteSettings) -> WebSocketSettings | None:
        """A route's WebSocket settings: the global ones with its changes; None when its
        upgrades are not proxied."""
        own = route.websocket
        if own is None or own is False:
            return None
        if own is True:
            return self.websocket
        changes = {k: v for k, v in dataclasses.asdict(own).items() if v is not None}
        return dataclasses.replace(self.websocket, **changes)

    def validate(self, check: Check) -> None:
        defined = {route.resource_path for route in self.routes if route.auth != "none"}
        for resource in self.resources:
            if resource.path.rstrip("/") not in defined:
                check.problem_at(
                    resource.line,
                    f"resources: no protected route belongs to {resource.path or '/'} "
                    "(a route's resource is its path up to the first {name} or **, or its "
                    "own `resource`)",
                )
        if _overlap(self.listen, self.admin_listen):
            check.problem_at(check.line_of("admin_listen"), "admin_listen must differ from listen")
        if self.ext_authz is not None:
            for name, other in (("listen", self.listen), ("admin_listen", self.admin_listen)):
                if _overlap(self.ext_authz.listen, other):
                    check.within(self.ext_authz).problem(f"must differ from {name}", key="listen")
        _check_issuers(self.issuers, check)
        _check_routes(self.routes, self.issuers, self.upstream.path_case, check)
        self._check_client_cert_use(check)

    @staticmethod
    def validate_partial(values: Mapping[str, Any], check: Check) -> None:
        """The checks across issuers and routes, for a file where another value was refused."""
        issuers: tuple[IssuerSettings, ...] | None = values.get("issuers")
        if issuers is not None:
            _check_issuers(issuers, check)
        upstream: UpstreamSettings | None = values.get("upstream")
        path_case = upstream.path_case if upstream is not None else "sensitive"
        _check_routes(values.get("routes", ()), issuers, path_case, check)

    def _check_client_cert_use(self, check: Check) -> None:
        """Client certificates are known only when the gateway's own listener verifies them."""
        if self.tls is not None and self.tls.client_ca_file is not None:
            return
        need = "needs tls.client_ca_file (the gateway's listener verifies client certificates)"
        if self.identity_headers.client_cert:
            check.problem_at(
                check.line_of("identity_headers"), f"identity_headers: client_cert_* {need}"
            )
        for route in self.routes:
            if route.needs_client_cert:
                check.problem_at(route.line, f"route {route.name!r}: client_cert: required {need}")


def _check_issuers(issuers: tuple[IssuerSettings, ...], check: Check) -> None:
    seen: dict[str, int] = {}
    for issuer in issuers:
        if issuer.issuer in seen:
            check.within(issuer).problem(
                f"{issuer.issuer} is already listed on line {seen[issuer.issuer]}"
            )
        seen.setdefault(issuer.issuer, issuer.line)
    opaque = [i for i in issuers if i.takes_opaque_tokens]
    for later in opaque[1:]:
        # A token that is not a JWT names no issuer: it could only be sent to one of them,
        # and sending it to an issuer that did not make it would hand the token over.
        check.problem_at(
            later.line,
            f"issuers: only one issuer may use mode introspection or auto "
            f"(already {opaque[0].issuer} on line {opaque[0].line})",
        )


def _check_route_names(written: Any, check: Check) -> None:
    """Each route name used once, judged on the routes as written: a route refused for
    another reason still holds its name."""
    if not isinstance(written, LocatedList):
        return
    first: dict[str, int] = {}
    for line, item in zip(written.item_lines, written, strict=True):
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str):
            continue
        if name in first:
            check.problem_at(line, f"route {name!r}: the name is already used on line {first[name]}")
        first.setdefault(name, line)


def _check_routes(
    routes: tuple[RouteSettings, ...],
    issuers: tuple[IssuerSettings, ...] | None,
    path_case: str,
    check: Check,
) -> None:
    """Names used once, issuers that are listed (unless the list was refused), no rule
    shadowed by an earlier one."""
    _check_route_names(check.written("routes"), check)
    known = None if issuers is None else {i.issuer for i in issuers}
    for route in routes:
        within = check.within(route)
        for issuer in route.issuers or ():
            if known is not None and issuer not in known:
                within.problem(f"{issuer} is not in the issuers list", key="issuers")
    for conflict in rules.find_conflicts(routes, fold_case=path_case == "insensitive"):
        check.problem_at(conflict.line, conflict.message)


_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*"})


def _overlap(a: Address, b: Address) -> bool:
    """Whether two listeners would claim the same socket (a wildcard host takes them all)."""
    if a.port != b.port:
        return False
    return a.host == b.host or a.host in _WILDCARD_HOSTS or b.host in _WILDCARD_HOSTS


# ---------------------------------------------------------------------------- loading


def load(path: str, env: Mapping[str, str] | None = None, *, secrets: bool = True) -> Settings:
    """Read and validate a gateway config file; raise ConfigError listing every problem.

    `secrets=False` is for commands that use no secret and serve nothing (`explain` without
    a token): secrets and key material are then neither read nor required.
    """
    return sections.load_file(Settings, path, env, secrets=secrets)


def load_text(
    text: str, file: str = "<text>", env: Mapping[str, str] | None = None, *, secrets: bool = True
) -> Settings:
    return sections.load_text(Settings, text, file, env, secrets=secrets)


def warnings(settings: Settings) -> list[str]:
    """What is valid but likely not meant, as `FILE:LINE: warning: message`."""
    found = []
    if settings.workers > 1 and not settings.rate_limits.redis:
        # RFC 9449 §11.1: a proof is accepted once; each worker remembers only its own.
        found.append(
            f"{settings.file}: warning: workers: {settings.workers} with the memory replay "
            "cache: each worker remembers only the DPoP proofs it saw, so a proof replayed to "
            "another worker is accepted; set rate_limits.backend to a redis:// URL to share it"
        )
    if settings.workers > 1 and settings.dpop.nonce and not settings.dpop.nonce_key:
        found.append(
            f"{settings.file}: warning: workers: {settings.workers} with dpop.nonce and no "
            "dpop.nonce_key: each worker makes nonces with its own random key and refuses "
            "the others'; set nonce_key (the same on every replica)"
        )
    found += _unlocated_dpop_routes(settings)
    found += _unjudged_mcp_routes(settings)
    if settings.upstream.path_case == "insensitive":
        return found
    return found + [
        f"{settings.file}:{variant.line}: warning: {variant.message}"
        for variant in rules.find_case_variants(settings.routes)
    ]


def _unlocated_dpop_routes(settings: Settings) -> list[str]:
    """Routes that require DPoP while the decision listener cannot tell the URL a proof names.

    A proof's htu must be the URL the client called (RFC 9449 §4.3 item 9). Asked through
    ext_authz, the gateway knows it only as the front proxy describes it: Traefik, Caddy and
    ingress-nginx give scheme and host, but nginx's auth_request subrequest carries the
    upstream's Host and Envoy asks over its own scheme, so every proof is refused there
    unless public_url names the URL. Only routes where DPoP is required are named: DPoP is
    allowed on every route by default, and a warning for each would be given to every
    forward-auth configuration, the correct ones included."""
    if settings.ext_authz is None or settings.public_url is not None:
        return []
    required_by = {i.issuer for i in settings.issuers if i.dpop == "required"}
    found = []
    for route in settings.routes:
        if route.auth == "none" or route.public_url is not None:
            continue
        accepted = set(route.issuers) if route.issuers is not None else required_by
        if route.dpop_required or accepted & required_by:
            found.append(
                f"{settings.file}:{route.line}: warning: route {route.name} requires DPoP and "
                "ext_authz is on with no public_url: behind nginx auth_request or Envoy the "
                "decision listener does not see the URL clients call, and refuses their "
                "proofs; set public_url (or the route's)"
            )
    return found


def _unjudged_mcp_routes(settings: Settings) -> list[str]:
    """Routes with MCP call rules while the decision listener is on.

    A call is judged from the POST's JSON-RPC body, which only Envoy's question carries (with
    `with_request_body`): asked about such a POST without it, the decision listener refuses
    it (it would otherwise allow every call on the route's scopes). The route is right for
    the gateway's own listener and for Envoy passing the body, so this is a warning, not a
    refusal of the file."""
    if settings.ext_authz is None:
        return []
    return [
        f"{settings.file}:{route.line}: warning: route {route.name} has mcp.calls and ext_authz "
        "is on: the decision listener never sees a request's body unless Envoy passes it "
        "(with_request_body), so it refuses this route's POSTs otherwise (403 "
        "mcp_calls_unjudged); have the front proxy pass the body or send the route's "
        "requests to the gateway's own listener instead of asking about them"
        for route in settings.routes
        if route.mcp is not None and route.mcp.calls
    ]


def check(path: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Every problem in the file as `FILE:LINE: message`; empty when it is valid."""
    try:
        load(path, env)
    except ConfigError as exc:
        return [str(p) for p in exc.problems]
    return []
