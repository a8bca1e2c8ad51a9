"""The gateway's configuration: frozen dataclasses built from YAML, every problem with FILE:LINE.

`load(path)` reads, interpolates `${VAR}` and `${file:PATH}`, validates every key (unknown
keys are errors), and checks the route table for duplicates and rules shadowed by an earlier
one. Nothing here does I/O beyond reading the file and the files it names (secrets,
certificates and keys, which are loaded as the gateway would load them), so
`portcullis-gateway check` and the running gateway agree.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal
from urllib.parse import urlsplit

from portcullis import tls, yamlconf
from portcullis.addresses import IPNetwork, network
from portcullis.tls import ServerTls
from portcullis.yamlconf import ConfigError, LocatedMap, Rate, Reader, Section

from . import rules

# RFC 7518 §3.1 asymmetric algorithms plus EdDSA (RFC 8037). Symmetric (HS*) and `none` can
# never be verified against a public key set (RFC 8725 §3.1, §3.2), so they are not offered.
SUPPORTED_ALGORITHMS = (
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "ES512",
    "EdDSA",
)
DEFAULT_ALGORITHMS = ("RS256", "ES256", "EdDSA")
HTTP_METHOD = re.compile(r"^[A-Z][A-Z0-9!#$%&'*+.^_`|~-]*$")
HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
RESERVED_HEADERS = frozenset(
    {
        "host",
        "authorization",
        "content-length",
        "content-type",
        "transfer-encoding",
        "connection",
        "upgrade",
        "te",
        "trailer",
        "keep-alive",
        "proxy-authorization",
        "cookie",
        "expect",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "forwarded",
        "via",
        "x-request-id",
    }
)
SCOPE_TOKEN = re.compile(r"^[\x21\x23-\x5B\x5D-\x7E]+$")  # RFC 6749 §3.3 scope-token
SERVER_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")  # a DNS name, for SNI


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class UpstreamSettings:
    url: str
    connect_timeout: timedelta = timedelta(seconds=2)
    read_timeout: timedelta = timedelta(seconds=30)
    max_connections: int = 256
    preserve_host: bool = False
    # sensitive: rules compare paths as written; insensitive: in lower case, for upstreams
    # that serve /Docs and /docs as one resource.
    path_case: str = "sensitive"
    # How long a request waits for a free pooled connection before 503 (all are in use).
    pool_timeout: timedelta = timedelta(seconds=5)
    # https upstreams: the CA its certificate chains to (default: the system's), the name
    # it is checked against and sent as SNI (default: the URL's host), a client certificate.
    ca_file: str | None = None
    server_name: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


@dataclass(frozen=True)
class IntrospectionSettings:
    """How the gateway asks an issuer about a token (RFC 7662), with its own credentials."""

    client_id: str
    client_secret: str = field(repr=False)
    url: str | None = None  # None: the introspection_endpoint of the discovery document
    cache_ttl: timedelta = timedelta(seconds=10)  # active answers, never beyond the token's exp
    inactive_cache_ttl: timedelta = timedelta(seconds=2)
    cache_size: int = 10_000
    timeout: timedelta = timedelta(seconds=2)
    max_connections: int = 32
    max_pending: int = 1024  # distinct tokens being asked about at once; more get 503


@dataclass(frozen=True)
class IssuerSettings:
    issuer: str
    audiences: tuple[str, ...]
    jwks_uri: str | None = None
    algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS
    leeway: timedelta = timedelta(seconds=30)
    require_typ: bool = True
    allow_http: bool = False
    line: int = 0
    # jwt: JWTs verified locally; introspection: every token asked about at the issuer;
    # auto: JWTs locally, any other token by introspection.
    mode: str = "jwt"
    introspection: IntrospectionSettings | None = None
    ca_file: str | None = None  # for discovery, JWKS and introspection; default: system CAs

    @property
    def uses_keys(self) -> bool:
        return self.mode in ("jwt", "auto")

    @property
    def takes_opaque_tokens(self) -> bool:
        return self.mode in ("introspection", "auto")


@dataclass(frozen=True)
class JwksSettings:
    min_ttl: timedelta = timedelta(minutes=5)
    max_ttl: timedelta = timedelta(hours=24)
    refetch_cooldown: timedelta = timedelta(seconds=30)
    fetch_timeout: timedelta = timedelta(seconds=5)
    max_backoff: timedelta = timedelta(minutes=1)


@dataclass(frozen=True)
class IdentityHeaders:
    subject: str = "X-Auth-Subject"
    client_id: str = "X-Auth-Client-Id"
    scopes: str = "X-Auth-Scopes"
    issuer: str = "X-Auth-Issuer"
    claims: tuple[tuple[str, str], ...] = ()  # (header, claim name)
    # Of a client certificate the gateway's TLS listener verified; None: not sent.
    client_cert_subject: str | None = None  # the subject DN (RFC 4514)
    client_cert_san: str | None = None  # the subject alternative names

    def names(self) -> tuple[str, ...]:
        return (
            self.subject,
            self.client_id,
            self.scopes,
            self.issuer,
            *(header for header, _ in self.claims),
            *(h for h in (self.client_cert_subject, self.client_cert_san) if h is not None),
        )

    @property
    def client_cert(self) -> bool:
        return self.client_cert_subject is not None or self.client_cert_san is not None


@dataclass(frozen=True)
class ForwardSettings:
    strip_authorization: bool = False
    request_id_header: str = "X-Request-Id"
    buffer_size: int = 64 * 1024  # bodies with a Content-Length up to this are sent in one piece
    traceparent: bool = True  # W3C Trace Context: propagated upstream, created when absent
    # X-HTTP-Method-Override and its kin are dropped: a route's methods are checked on the
    # method the gateway saw, and an upstream honouring the header would run another one.
    strip_method_override: bool = True


@dataclass(frozen=True)
class Limits:
    max_line_size: int = 8 * 1024
    max_field_size: int = 8 * 1024
    max_headers: int = 100
    max_body_size: int | None = None
    idle_timeout: timedelta = timedelta(seconds=60)
    body_timeout: timedelta = timedelta(seconds=30)  # the longest pause inside a body
    body_total_timeout: timedelta = timedelta(minutes=5)  # the whole body, however it trickles
    max_bodies_per_client: int = 32  # bodies arriving at once from one address; 0: no cap
    max_connections: int = 10_000  # client connections per process; more are closed at once


@dataclass(frozen=True)
class ScopeRule:
    mode: str  # "any" or "all"
    scopes: frozenset[str]


LIMIT_KEYS = ("subject", "client_id", "ip", "route")
LIMIT_KEY_PREFIXES = ("header:", "claim:")
IDENTITY_LIMIT_KEYS = ("subject", "client_id")  # and claim:NAME: they need a verified token


@dataclass(frozen=True)
class LimitRule:
    """A token bucket: `burst` requests at once, refilled at `rate`, one bucket per key."""

    rate: Rate
    burst: int
    key: str  # subject | client_id | ip | route | header:NAME | claim:NAME
    line: int = 0

    @property
    def needs_token(self) -> bool:
        return self.key in IDENTITY_LIMIT_KEYS or self.key.startswith("claim:")


@dataclass(frozen=True)
class RateLimitSettings:
    backend: str = "memory"  # or redis://host:port/db, rediss://..., unix:///path
    default: LimitRule | None = None
    pre_auth: LimitRule | None = None  # per client address, charged before verifying a token
    on_backend_error: str = "allow"  # allow | deny, when the shared backend cannot answer
    timeout: timedelta = timedelta(milliseconds=100)
    max_keys: int = 100_000  # buckets the memory backend holds at most
    max_connections: int = 32  # to Redis, per gateway process
    key_prefix: str = "portcullis:rl:"
    headers: bool = True  # RateLimit-Policy / RateLimit on answers

    @property
    def redis(self) -> bool:
        return self.backend != "memory"


@dataclass(frozen=True)
class CorsSettings:
    allow_origins: tuple[str, ...]  # exact origins, or ("*",)
    allow_methods: tuple[str, ...] = ("GET", "HEAD", "POST")
    allow_headers: tuple[str, ...] = ("Authorization", "Content-Type")
    expose_headers: tuple[str, ...] = ()
    allow_credentials: bool = False
    max_age: timedelta = timedelta(minutes=10)
    line: int = 0


@dataclass(frozen=True)
class WebSocketSettings:
    close_on_token_expiry: bool = False
    max_message_size: int = 4 * 1024 * 1024
    heartbeat: timedelta | None = None  # ping both peers this often when set


@dataclass(frozen=True)
class AccessLogSettings:
    # Off without an access_log section: a line per request costs a few percent of the
    # gateway's throughput, so it is asked for, not imposed. A section turns it on.
    enabled: bool = False
    output: str = "stderr"  # stderr | stdout | a file path (appended to)
    include_query: bool = False
    subject: str = "plain"  # plain | hashed | omitted
    subject_hash_key: str = field(default="", repr=False)
    flush_interval: timedelta = timedelta(milliseconds=200)


@dataclass(frozen=True)
class ReloadSettings:
    watch: bool = True  # reload when the file changes, besides on SIGHUP
    interval: timedelta = timedelta(seconds=1)


@dataclass(frozen=True)
class RouteSettings:
    name: str
    path: str
    methods: frozenset[str] | None = None  # None: every method
    auth: str = "required"
    issuers: tuple[str, ...] | None = None
    audience: str | None = None
    scopes: ScopeRule | None = None
    max_body_size: int | None = None
    line: int = 0
    mode: str | None = None  # enforce | monitor; None: the global mode
    rate_limit: LimitRule | Literal[False] | None = None  # None: the default; False: none
    cors: CorsSettings | Literal[False] | None = None  # None: the global cors; False: none
    websocket: WebSocketSettings | None = None  # None: upgrades are not proxied
    path_params: str = "refuse"  # refuse | allow: requests with `;` path parameters
    allow_body_on_get: bool = False  # a body on GET or HEAD is refused (400) unless true
    client_cert: bool = False  # True: only requests with a verified client certificate


@dataclass(frozen=True)
class Settings:
    file: str
    upstream: UpstreamSettings
    issuers: tuple[IssuerSettings, ...]
    routes: tuple[RouteSettings, ...]
    listen: Address = Address("0.0.0.0", 8080)
    admin_listen: Address = Address("127.0.0.1", 9901)
    realm: str = "portcullis"
    server_header: str = ""  # the Server field of the gateway's own answers; "": none
    unmatched: str = "deny"
    jwks: JwksSettings = field(default_factory=JwksSettings)
    identity_headers: IdentityHeaders = field(default_factory=IdentityHeaders)
    forward: ForwardSettings = field(default_factory=ForwardSettings)
    limits: Limits = field(default_factory=Limits)
    token_cache_size: int = 100_000
    workers: int = 1
    shutdown_grace: timedelta = timedelta(seconds=20)
    log_level: str = "info"
    mode: str = "enforce"  # enforce | monitor
    rate_limits: RateLimitSettings = field(default_factory=RateLimitSettings)
    trusted_proxies: tuple[IPNetwork, ...] = ()
    cors: CorsSettings | None = None
    websocket: WebSocketSettings = field(default_factory=WebSocketSettings)
    access_log: AccessLogSettings = field(default_factory=AccessLogSettings)
    reload: ReloadSettings = field(default_factory=ReloadSettings)
    tls: ServerTls | None = None  # of the public listener; None: plain HTTP

    def issuer(self, url: str) -> IssuerSettings | None:
        return next((i for i in self.issuers if i.issuer == url), None)


# ---------------------------------------------------------------------------- loading


def load(path: str, env: Mapping[str, str] | None = None, *, secrets: bool = True) -> Settings:
    """Read and validate a gateway config file; raise ConfigError listing every problem.

    `secrets=False` is for commands that use no secret and serve nothing (`explain` without
    a token): secrets and key material are then neither read nor required.
    """
    return parse(yamlconf.load_file(path, env, keep_incomplete=True), path, secrets=secrets)


def load_text(
    text: str, file: str = "<text>", env: Mapping[str, str] | None = None, *, secrets: bool = True
) -> Settings:
    return parse(yamlconf.load_text(text, file, env, keep_incomplete=True), file, secrets=secrets)


def parse(data: LocatedMap, file: str, *, secrets: bool = True) -> Settings:
    reader = Reader(file, data.incomplete, secrets=secrets)
    top = Section(reader, data, "config")
    upstream = _upstream(reader, top)
    issuers = _issuers(reader, top)
    websocket = _websocket(reader, top)
    settings = Settings(
        file=file,
        upstream=upstream or UpstreamSettings(url="http://invalid"),
        issuers=issuers,
        routes=_routes(reader, top, issuers, websocket),
        listen=top.get("listen", _address, Settings.listen),
        admin_listen=top.get("admin_listen", _address, Settings.admin_listen),
        realm=top.get("realm", _realm, Settings.realm),
        server_header=top.get("server_header", _server_header, ""),
        unmatched=top.get("unmatched", yamlconf.one_of("deny"), "deny"),
        jwks=_jwks(reader, top),
        identity_headers=_identity_headers(reader, top),
        forward=_forward(reader, top),
        limits=_limits(reader, top),
        token_cache_size=top.get("token_cache_size", yamlconf.integer(0, 10_000_000), 100_000),
        workers=top.get("workers", yamlconf.integer(1, 256), 1),
        shutdown_grace=top.get("shutdown_grace", yamlconf.duration, Settings.shutdown_grace),
        log_level=top.get(
            "log_level", yamlconf.one_of("debug", "info", "warning", "error"), "info"
        ),
        mode=top.get("mode", yamlconf.one_of("enforce", "monitor"), "enforce"),
        rate_limits=_rate_limits(reader, top),
        trusted_proxies=top.list_of("trusted_proxies", network),
        cors=_global_cors(reader, top),
        websocket=websocket,
        access_log=_access_log(reader, top),
        reload=_reload(reader, top),
        tls=(
            tls.parse_server(reader, top.raw("tls"), "tls", top.line_of("tls"), client_auth=True)
            if top.has("tls")
            else None
        ),
    )
    top.finish()
    if _overlap(settings.listen, settings.admin_listen):
        reader.problem(top.line_of("admin_listen"), "admin_listen must differ from listen")
    _check_client_cert_use(reader, top, settings)
    # Routes with a broken path are already left out, so the rest can be checked now and
    # every problem of the file is reported in one run.
    fold_case = settings.upstream.path_case == "insensitive"
    for conflict in rules.find_conflicts(settings.routes, fold_case=fold_case):
        reader.problem(conflict.line, conflict.message)
    reader.raise_if_any()
    return settings


def _check_client_cert_use(reader: Reader, top: Section, settings: Settings) -> None:
    """Client certificates are known only when the gateway's own listener verifies them."""
    if settings.tls is not None and settings.tls.client_ca_file is not None:
        return
    need = "needs tls.client_ca_file (the gateway's listener verifies client certificates)"
    headers = settings.identity_headers
    if headers.client_cert:
        reader.problem(top.line_of("identity_headers"), f"identity_headers: client_cert_* {need}")
    for route in settings.routes:
        if route.client_cert:
            reader.problem(route.line, f"route {route.name!r}: client_cert: required {need}")


_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*"})


def _overlap(a: Address, b: Address) -> bool:
    """Whether two listeners would claim the same socket (a wildcard host takes them all)."""
    if a.port != b.port:
        return False
    return a.host == b.host or a.host in _WILDCARD_HOSTS or b.host in _WILDCARD_HOSTS


def _address(value: Any) -> Address:
    text = yamlconf.string(value)
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host:
        raise ValueError(f"{text!r} has no host (use 0.0.0.0:{port} for every interface)")
    return Address(host, int(port))


def _realm(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if not re.fullmatch(r"[\x20\x21\x23-\x5B\x5D-\x7E]+", text):
        raise ValueError("may contain printable ASCII except quotes and backslashes")
    return text


def _server_header(value: Any) -> str:
    """RFC 9110 §10.2.4: product tokens and comments; here any visible ASCII with inner
    spaces, so the value can never break the header section. Empty: no Server field."""
    text = yamlconf.string(value)
    if text and not re.fullmatch(r"[\x21-\x7E](?:[\x20-\x7E]*[\x21-\x7E])?", text):
        raise ValueError("may contain printable ASCII only, without spaces at either end")
    return text


def _is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url(value: Any, allow_http: bool) -> str:
    text = yamlconf.non_empty_string(value)
    parts = urlsplit(text)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ValueError(f"{text!r} is not an http(s) URL")
    if parts.scheme == "http" and not (allow_http or _is_loopback(parts.hostname)):
        raise ValueError(
            f"{text!r} uses plain http; tokens and keys must come over https "
            "(set allow_http: true only inside a trusted network)"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"{text!r} must not have a query or fragment")
    return text


def _upstream(reader: Reader, top: Section) -> UpstreamSettings | None:
    if not top.has("upstream"):
        reader.problem(top.line, "config: upstream is required (the API requests go to)")
        return None
    sec = reader.section(top.raw("upstream"), "upstream", top.line_of("upstream"))
    if sec is None:
        return None
    url = sec.get("url", yamlconf.non_empty_string)
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            reader.problem(sec.line_of("url"), f"upstream.url: {url!r} is not an http(s) URL")
        elif parts.query or parts.fragment:
            reader.problem(sec.line_of("url"), "upstream.url: must not have a query or fragment")
    result = UpstreamSettings(
        url=(url or "").rstrip("/"),
        connect_timeout=sec.get(
            "connect_timeout", yamlconf.duration, UpstreamSettings.connect_timeout
        ),
        read_timeout=sec.get("read_timeout", yamlconf.duration, UpstreamSettings.read_timeout),
        max_connections=sec.get("max_connections", yamlconf.integer(1, 100_000), 256),
        preserve_host=sec.get("preserve_host", yamlconf.boolean, False),
        path_case=sec.get(
            "path_case", yamlconf.one_of("sensitive", "insensitive"), UpstreamSettings.path_case
        ),
        pool_timeout=sec.get("pool_timeout", yamlconf.duration, UpstreamSettings.pool_timeout),
        ca_file=sec.get("ca_file", yamlconf.non_empty_string, None),
        server_name=sec.get("server_name", _server_name, None),
        cert_file=sec.get("cert_file", yamlconf.non_empty_string, None),
        key_file=sec.get("key_file", yamlconf.non_empty_string, None),
    )
    sec.finish()
    _check_upstream_tls(reader, sec, result)
    if result.pool_timeout <= timedelta(0):
        reader.problem(sec.line_of("pool_timeout"), "upstream.pool_timeout: must be more than 0s")
    return result


def _server_name(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if not SERVER_NAME.match(text):
        raise ValueError(f"{text!r} is not a host name (no scheme, port or path)")
    return text


def _check_upstream_tls(reader: Reader, sec: Section, up: UpstreamSettings) -> None:
    """TLS options need an https URL, a client certificate needs its key, and every file
    named must load as the gateway will load it."""
    options = [k for k in ("ca_file", "server_name", "cert_file", "key_file") if sec.has(k)]
    if options and urlsplit(up.url).scheme != "https":
        for key in options:
            reader.problem(sec.line_of(key), f"upstream.{key}: only with an https:// url")
        return
    if (up.cert_file is None) != (up.key_file is None):
        missing = "key_file" if up.key_file is None else "cert_file"
        reader.problem(
            sec.line,
            f"upstream: a client certificate needs both cert_file and "
            f"key_file ({missing} is missing)",
        )
        return
    if not reader.secrets:
        return
    if up.ca_file is not None:
        tls.check_ca(reader, sec, "ca_file", up.ca_file)
    if up.cert_file is not None and up.key_file is not None:
        tls.check_client_pair(reader, sec, up.cert_file, up.key_file)


def _algorithm(value: Any) -> str:
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


def _issuers(reader: Reader, top: Section) -> tuple[IssuerSettings, ...]:
    raw = top.raw("issuers")
    if raw is None:
        reader.problem(top.line, "config: issuers is required (a list of trusted token issuers)")
        return ()
    result: list[IssuerSettings] = []
    seen: dict[str, int] = {}
    for index, line, item in reader.items(raw, "issuers", top.line_of("issuers")):
        sec = reader.section(item, f"issuers[{index}]", line)
        if sec is None:
            continue
        allow_http = sec.get("allow_http", yamlconf.boolean, False)
        issuer = sec.get("issuer", functools.partial(_url, allow_http=allow_http))
        jwks_uri = sec.get("jwks_uri", functools.partial(_url, allow_http=allow_http), None)
        audiences = sec.list_of("audiences", yamlconf.non_empty_string)
        if not audiences and sec.has("issuer"):
            reader.problem(
                sec.line, f"issuers[{index}]: audiences is required (RFC 9068 §4: aud is checked)"
            )
        algorithms = sec.list_of("algorithms", _algorithm, DEFAULT_ALGORITHMS)
        if _empty_list(sec.raw("algorithms")):
            reader.problem(sec.line_of("algorithms"), f"issuers[{index}].algorithms: empty")
        mode = sec.get("mode", yamlconf.one_of("jwt", "introspection", "auto"), "jwt")
        introspection = None
        if sec.has("introspection"):
            introspection = _introspection(
                reader,
                sec.raw("introspection"),
                f"issuers[{index}].introspection",
                sec.line_of("introspection"),
                allow_http,
            )
            if mode == "jwt":
                reader.problem(
                    sec.line_of("introspection"),
                    f"issuers[{index}].introspection: only used with mode introspection or auto",
                )
        elif mode in ("introspection", "auto"):
            reader.problem(
                sec.line_of("mode"),
                f"issuers[{index}]: mode {mode} needs an introspection section "
                "(client_id and client_secret of the gateway)",
            )
        entry = IssuerSettings(
            issuer=issuer or "",
            audiences=audiences,
            jwks_uri=jwks_uri,
            algorithms=algorithms or DEFAULT_ALGORITHMS,
            leeway=sec.get("leeway", yamlconf.duration, IssuerSettings.leeway),
            require_typ=sec.get("require_typ", yamlconf.boolean, True),
            allow_http=allow_http,
            line=line,
            mode=mode or "jwt",
            introspection=introspection,
            ca_file=sec.get("ca_file", yamlconf.non_empty_string, None),
        )
        sec.finish()
        if entry.ca_file is not None and reader.secrets:
            tls.check_ca(reader, sec, "ca_file", entry.ca_file)
        if issuer:
            if issuer in seen:
                reader.problem(
                    line, f"issuers[{index}]: {issuer} is already listed on line {seen[issuer]}"
                )
            seen[issuer] = line
        result.append(entry)
    if isinstance(raw, list) and not raw:
        reader.problem(top.line_of("issuers"), "config: issuers must list at least one issuer")
    opaque = [i for i in result if i.takes_opaque_tokens]
    for later in opaque[1:]:
        # A token that is not a JWT names no issuer: it could only be sent to one of them,
        # and sending it to an issuer that did not make it would hand the token over.
        reader.problem(
            later.line,
            f"issuers: only one issuer may use mode introspection or auto "
            f"(already {opaque[0].issuer} on line {opaque[0].line})",
        )
    return tuple(result)


def _secret(value: Any) -> str:
    """A secret: its value never appears in a message."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be a non-empty string (quote it; the value is not shown)")
    return value


def _introspection(
    reader: Reader, raw: Any, where: str, line: int, allow_http: bool
) -> IntrospectionSettings | None:
    sec = reader.section(raw, where, line)
    if sec is None:
        return None
    d = IntrospectionSettings("", "")
    if not (sec.has("client_secret") or sec.has("client_secret_file")):
        reader.problem(sec.line, f"{where}: client_secret (or client_secret_file) is required")
    result = IntrospectionSettings(
        client_id=sec.get("client_id", yamlconf.non_empty_string),
        client_secret=sec.secret("client_secret", _secret) or "",
        url=sec.get("url", functools.partial(_url, allow_http=allow_http), None),
        cache_ttl=sec.get("cache_ttl", yamlconf.duration, d.cache_ttl),
        inactive_cache_ttl=sec.get("inactive_cache_ttl", yamlconf.duration, d.inactive_cache_ttl),
        cache_size=sec.get("cache_size", yamlconf.integer(0, 10_000_000), d.cache_size),
        timeout=sec.get("timeout", yamlconf.duration, d.timeout),
        max_connections=sec.get("max_connections", yamlconf.integer(1, 10_000), d.max_connections),
        max_pending=sec.get("max_pending", yamlconf.integer(1, 1_000_000), d.max_pending),
    )
    sec.finish()
    if result.timeout <= timedelta(0):
        reader.problem(sec.line_of("timeout"), f"{where}.timeout: must be more than 0s")
    return result


def _jwks(reader: Reader, top: Section) -> JwksSettings:
    sec = top.subsection("jwks")
    if sec is None:
        return JwksSettings()
    d = JwksSettings()
    result = JwksSettings(
        min_ttl=sec.get("min_ttl", yamlconf.duration, d.min_ttl),
        max_ttl=sec.get("max_ttl", yamlconf.duration, d.max_ttl),
        refetch_cooldown=sec.get("refetch_cooldown", yamlconf.duration, d.refetch_cooldown),
        fetch_timeout=sec.get("fetch_timeout", yamlconf.duration, d.fetch_timeout),
        max_backoff=sec.get("max_backoff", yamlconf.duration, d.max_backoff),
    )
    sec.finish()
    if result.min_ttl > result.max_ttl:
        reader.problem(sec.line, "jwks: min_ttl must not exceed max_ttl")
    return result


def _header_name(value: Any) -> str:
    name = yamlconf.non_empty_string(value)
    if not HEADER_NAME.match(name):
        raise ValueError(f"{name!r} is not a valid header name")
    return name


def _identity_headers(reader: Reader, top: Section) -> IdentityHeaders:
    if not top.has("identity_headers"):
        top.raw("identity_headers")
        return IdentityHeaders()
    sec = reader.section(
        top.raw("identity_headers"), "identity_headers", top.line_of("identity_headers")
    )
    if sec is None:
        return IdentityHeaders()
    d = IdentityHeaders()
    claims: list[tuple[str, str]] = []
    raw_claims = sec.raw("claims")
    if raw_claims is not None:
        claim_sec = reader.section(raw_claims, "identity_headers.claims", sec.line_of("claims"))
        if claim_sec is not None:
            for header in list(claim_sec.data):
                try:
                    _header_name(header)
                except ValueError as exc:
                    reader.problem(claim_sec.line_of(header), f"identity_headers.claims: {exc}")
                    claim_sec.raw(header)
                    continue
                claim = claim_sec.get(header, yamlconf.non_empty_string)
                if claim:
                    claims.append((header, claim))
    result = IdentityHeaders(
        subject=sec.get("subject", _header_name, d.subject),
        client_id=sec.get("client_id", _header_name, d.client_id),
        scopes=sec.get("scopes", _header_name, d.scopes),
        issuer=sec.get("issuer", _header_name, d.issuer),
        claims=tuple(claims),
        client_cert_subject=sec.get("client_cert_subject", _header_name, None),
        client_cert_san=sec.get("client_cert_san", _header_name, None),
    )
    sec.finish()
    lowered = [n.lower().replace("_", "-") for n in result.names()]
    if len(set(lowered)) != len(lowered):
        reader.problem(sec.line, "identity_headers: two identity values use the same header")
    for name in sorted(set(lowered) & RESERVED_HEADERS):
        # Identity headers are stripped from every request: naming one of these would strip
        # what HTTP or the gateway itself needs.
        reader.problem(sec.line, f"identity_headers: {name} cannot carry an identity")
    return result


def _forward(reader: Reader, top: Section) -> ForwardSettings:
    sec = top.subsection("forward")
    if sec is None:
        return ForwardSettings()
    d = ForwardSettings()
    result = ForwardSettings(
        strip_authorization=sec.get("strip_authorization", yamlconf.boolean, d.strip_authorization),
        request_id_header=sec.get("request_id_header", _header_name, d.request_id_header),
        buffer_size=sec.get("buffer_size", yamlconf.size, d.buffer_size),
        traceparent=sec.get("traceparent", yamlconf.boolean, d.traceparent),
        strip_method_override=sec.get(
            "strip_method_override", yamlconf.boolean, d.strip_method_override
        ),
    )
    sec.finish()
    return result


def _limits(reader: Reader, top: Section) -> Limits:
    sec = top.subsection("limits")
    if sec is None:
        return Limits()
    d = Limits()
    result = Limits(
        max_line_size=sec.get("max_line_size", yamlconf.size, d.max_line_size),
        max_field_size=sec.get("max_field_size", yamlconf.size, d.max_field_size),
        max_headers=sec.get("max_headers", yamlconf.integer(1, 10_000), d.max_headers),
        max_body_size=sec.get("max_body_size", yamlconf.size, None),
        idle_timeout=sec.get("idle_timeout", yamlconf.duration, d.idle_timeout),
        body_timeout=sec.get("body_timeout", yamlconf.duration, d.body_timeout),
        body_total_timeout=sec.get("body_total_timeout", yamlconf.duration, d.body_total_timeout),
        max_bodies_per_client=sec.get(
            "max_bodies_per_client", yamlconf.integer(0, 1_000_000), d.max_bodies_per_client
        ),
        max_connections=sec.get(
            "max_connections", yamlconf.integer(1, 10_000_000), d.max_connections
        ),
    )
    sec.finish()
    if result.body_total_timeout <= timedelta(0):
        reader.problem(
            sec.line_of("body_total_timeout"), "limits.body_total_timeout: must be more than 0s"
        )
    return result


def _empty_list(raw: Any) -> bool:
    """An explicitly empty list (`[]`); a bad item or a non-list is reported on its own."""
    return isinstance(raw, list) and not raw


def _method(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if not HTTP_METHOD.match(text):
        raise ValueError(f"{text!r} is not an HTTP method in upper case")
    return text


def _scope_rule(reader: Reader, raw: Any, where: str, line: int) -> ScopeRule | None:
    sec = reader.section(raw, where, line)
    if sec is None:
        return None
    modes = [m for m in ("any", "all") if sec.has(m)]
    rule = None
    if len(modes) != 1:
        reader.problem(sec.line, f"{where}: give exactly one of any or all")
    else:
        scopes = sec.list_of(modes[0], _scope_token)
        if _empty_list(sec.raw(modes[0])):
            reader.problem(sec.line_of(modes[0]), f"{where}.{modes[0]}: list at least one scope")
        rule = ScopeRule(modes[0], frozenset(scopes))
    for m in ("any", "all"):
        sec.raw(m)
    sec.finish()
    return rule


def _scope_token(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if not SCOPE_TOKEN.match(text):
        raise ValueError(f"{text!r} is not a scope (no spaces, quotes or backslashes)")
    return text


def _routes(
    reader: Reader,
    top: Section,
    issuers: tuple[IssuerSettings, ...],
    websocket: WebSocketSettings,
) -> tuple[RouteSettings, ...]:
    raw = top.raw("routes")
    if raw is None:
        reader.problem(top.line, "config: routes is required (unmatched requests are denied)")
        return ()
    known_issuers = {i.issuer for i in issuers}
    names: dict[str, int] = {}
    result: list[RouteSettings] = []
    for index, line, item in reader.items(raw, "routes", top.line_of("routes")):
        sec = reader.section(item, f"routes[{index}]", line)
        if sec is None:
            continue
        name = sec.get("name", yamlconf.non_empty_string)
        where = f"route {name!r}" if name else f"routes[{index}]"
        sec.where = where
        if name:
            if name in names:
                reader.problem(line, f"{where}: the name is already used on line {names[name]}")
            names[name] = line
        path = sec.get("path", yamlconf.non_empty_string)
        if path is not None:
            try:
                rules.Pattern.parse(path)
            except ValueError as exc:
                reader.problem(sec.line_of("path"), f"{where}.path: {exc}")
                path = None  # type: ignore[assignment]
        methods = sec.list_of("methods", _method) if sec.has("methods") else None
        if _empty_list(sec.raw("methods")):
            reader.problem(sec.line_of("methods"), f"{where}.methods: list at least one method")
        auth = sec.get("auth", yamlconf.one_of("required", "none"), "required")
        route_issuers = (
            sec.list_of("issuers", yamlconf.non_empty_string) if sec.has("issuers") else None
        )
        if _empty_list(sec.raw("issuers")):
            reader.problem(
                sec.line_of("issuers"),
                f"{where}.issuers: list at least one issuer (or leave the key out for all)",
            )
        for issuer in route_issuers or ():
            if issuer not in known_issuers:
                reader.problem(
                    sec.line_of("issuers"), f"{where}.issuers: {issuer} is not in the issuers list"
                )
        audience = sec.get("audience", yamlconf.non_empty_string, None)
        scopes = (
            _scope_rule(reader, sec.raw("scopes"), f"{where}.scopes", sec.line_of("scopes"))
            if sec.has("scopes")
            else None
        )
        if auth == "none":
            for key in ("issuers", "audience", "scopes"):
                if sec.has(key):
                    reader.problem(
                        sec.line_of(key), f"{where}.{key}: means nothing with auth: none"
                    )
        rate_limit: LimitRule | Literal[False] | None = None
        if sec.has("rate_limit"):
            raw_limit = sec.raw("rate_limit")
            if raw_limit is False:
                rate_limit = False
            else:
                rate_limit = _limit_rule(
                    reader, raw_limit, f"{where}.rate_limit", sec.line_of("rate_limit")
                )
                if rate_limit is not None and auth == "none" and rate_limit.needs_token:
                    reader.problem(
                        sec.line_of("rate_limit"),
                        f"{where}.rate_limit.key: {rate_limit.key} needs a token, and this "
                        "route has auth: none (use ip, route or header:NAME)",
                    )
        cors: CorsSettings | Literal[False] | None = None
        if sec.has("cors"):
            raw_cors = sec.raw("cors")
            cors = (
                False
                if raw_cors is False
                else _cors(reader, raw_cors, f"{where}.cors", sec.line_of("cors"))
            )
        route_websocket = None
        if sec.has("websocket"):
            route_websocket = _route_websocket(
                reader,
                sec.raw("websocket"),
                f"{where}.websocket",
                sec.line_of("websocket"),
                websocket,
            )
        route = RouteSettings(
            name=name or f"#{index}",
            path=path or "/",
            methods=frozenset(methods) if methods is not None else None,
            auth=auth,
            issuers=route_issuers,
            audience=audience,
            scopes=scopes,
            max_body_size=sec.get("max_body_size", yamlconf.size, None),
            line=line,
            mode=sec.get("mode", yamlconf.one_of("enforce", "monitor"), None),
            rate_limit=rate_limit,
            cors=cors,
            websocket=route_websocket,
            path_params=sec.get(
                "path_params", yamlconf.one_of("refuse", "allow"), RouteSettings.path_params
            ),
            allow_body_on_get=sec.get("allow_body_on_get", yamlconf.boolean, False),
            client_cert=sec.get("client_cert", yamlconf.one_of("required", "optional"), "")
            == "required",
        )
        sec.finish()
        if path is not None:
            result.append(route)
    return tuple(result)


# ---------------------------------------------------------------------------- rate limits


def _limit_key(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if text in LIMIT_KEYS:
        return text
    kind, _, name = text.partition(":")
    if kind == "header":
        _header_name(name)
        return f"header:{name.lower()}"
    if kind == "claim":
        if not name.strip():
            raise ValueError("claim: needs a claim name, like claim:tenant")
        return text
    raise ValueError(f"{text!r} is not one of {', '.join(LIMIT_KEYS)}, header:NAME, claim:NAME")


def _limit_rule(
    reader: Reader, raw: Any, where: str, line: int, *, fixed_key: str | None = None
) -> LimitRule | None:
    sec = reader.section(raw, where, line)
    if sec is None:
        return None
    rate = sec.get("rate", yamlconf.rate)
    burst = sec.get("burst", yamlconf.integer(1, 1_000_000_000), None)
    if fixed_key is None:
        key = sec.get("key", _limit_key, "subject")
    else:
        key = sec.get("key", yamlconf.one_of(fixed_key), fixed_key)
    sec.finish()
    if rate is None:
        return None
    if burst is None:
        burst = max(1, math.ceil(rate.count))
    return LimitRule(rate=rate, burst=burst, key=key or "subject", line=sec.line)


def _redis_url(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if text == "memory":
        return text
    parts = urlsplit(text)
    if parts.scheme in ("redis", "rediss") and parts.hostname:
        return text
    if parts.scheme == "unix" and parts.path:
        return text
    raise ValueError(f"{text!r} is neither memory nor a redis://, rediss:// or unix:// URL")


def _rate_limits(reader: Reader, top: Section) -> RateLimitSettings:
    sec = top.subsection("rate_limits")
    if sec is None:
        return RateLimitSettings()
    d = RateLimitSettings()
    default = (
        _limit_rule(reader, sec.raw("default"), "rate_limits.default", sec.line_of("default"))
        if sec.has("default")
        else None
    )
    pre_auth = (
        _limit_rule(
            reader,
            sec.raw("pre_auth"),
            "rate_limits.pre_auth",
            sec.line_of("pre_auth"),
            fixed_key="ip",
        )
        if sec.has("pre_auth")
        else None
    )
    result = RateLimitSettings(
        backend=sec.get("backend", _redis_url, d.backend),
        default=default,
        pre_auth=pre_auth,
        on_backend_error=sec.get(
            "on_backend_error", yamlconf.one_of("allow", "deny"), d.on_backend_error
        ),
        timeout=sec.get("timeout", yamlconf.duration, d.timeout),
        max_keys=sec.get("max_keys", yamlconf.integer(1, 100_000_000), d.max_keys),
        max_connections=sec.get("max_connections", yamlconf.integer(1, 10_000), d.max_connections),
        key_prefix=sec.get("key_prefix", yamlconf.string, d.key_prefix),
        headers=sec.get("headers", yamlconf.boolean, d.headers),
    )
    for key in ("default", "pre_auth"):
        sec.raw(key)
    sec.finish()
    if result.timeout <= timedelta(0):
        reader.problem(sec.line_of("timeout"), "rate_limits.timeout: must be more than 0s")
    return result


# ---------------------------------------------------------------------------- CORS


def _origin(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if text == "*":
        return text
    parts = urlsplit(text)
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path
        or parts.query
        or parts.fragment
        or parts.username
    ):
        raise ValueError(
            f"{text!r} is not an origin (scheme://host[:port], no path or trailing slash)"
        )
    # Browsers send scheme and host in lower case (RFC 6454 §6.2).
    return text.lower()


def _header_or_star(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    return text if text == "*" else _header_name(text)


def _cors(reader: Reader, raw: Any, where: str, line: int) -> CorsSettings | None:
    sec = reader.section(raw, where, line)
    if sec is None:
        return None
    d = CorsSettings(())
    if not sec.has("allow_origins"):
        reader.problem(sec.line, f"{where}: allow_origins is required")
    elif _empty_list(sec.raw("allow_origins")):
        reader.problem(sec.line_of("allow_origins"), f"{where}.allow_origins: list at least one")
    origins = sec.list_of("allow_origins", _origin)
    result = CorsSettings(
        allow_origins=origins,
        allow_methods=sec.list_of("allow_methods", _method, d.allow_methods),
        allow_headers=sec.list_of("allow_headers", _header_or_star, d.allow_headers),
        expose_headers=sec.list_of("expose_headers", _header_name, d.expose_headers),
        allow_credentials=sec.get("allow_credentials", yamlconf.boolean, d.allow_credentials),
        max_age=sec.get("max_age", yamlconf.duration, d.max_age),
        line=sec.line,
    )
    sec.finish()
    if "*" in result.allow_origins:
        if len(result.allow_origins) > 1:
            reader.problem(sec.line_of("allow_origins"), f"{where}.allow_origins: * stands alone")
        if result.allow_credentials:
            # Fetch §3.2.5: browsers refuse a credentialed answer with a wildcard origin.
            reader.problem(
                sec.line_of("allow_credentials"),
                f"{where}: allow_credentials cannot be used with allow_origins: [*]; "
                "list the origins",
            )
    return result


def _global_cors(reader: Reader, top: Section) -> CorsSettings | None:
    if not top.has("cors"):
        top.raw("cors")
        return None
    return _cors(reader, top.raw("cors"), "cors", top.line_of("cors"))


# ---------------------------------------------------------------------------- WebSockets


def _websocket_section(
    reader: Reader, raw: Any, where: str, line: int, base: WebSocketSettings
) -> WebSocketSettings:
    sec = reader.section(raw, where, line)
    if sec is None:
        return base
    result = WebSocketSettings(
        close_on_token_expiry=sec.get(
            "close_on_token_expiry", yamlconf.boolean, base.close_on_token_expiry
        ),
        max_message_size=sec.get("max_message_size", yamlconf.size, base.max_message_size),
        heartbeat=sec.get("heartbeat", yamlconf.duration, base.heartbeat),
    )
    sec.finish()
    if result.heartbeat is not None and result.heartbeat <= timedelta(0):
        reader.problem(sec.line_of("heartbeat"), f"{where}.heartbeat: must be more than 0s")
    return result


def _websocket(reader: Reader, top: Section) -> WebSocketSettings:
    if not top.has("websocket"):
        top.raw("websocket")
        return WebSocketSettings()
    return _websocket_section(
        reader, top.raw("websocket"), "websocket", top.line_of("websocket"), WebSocketSettings()
    )


def _route_websocket(
    reader: Reader, raw: Any, where: str, line: int, base: WebSocketSettings
) -> WebSocketSettings | None:
    """`true` takes the global settings, a mapping changes some of them, `false` is off."""
    if raw is True:
        return base
    if raw is False:
        return None
    return _websocket_section(reader, raw, where, line, base)


# ---------------------------------------------------------------------------- logs, reload


def _access_log(reader: Reader, top: Section) -> AccessLogSettings:
    if not top.has("access_log"):
        top.raw("access_log")
        return AccessLogSettings()
    raw = top.raw("access_log")
    if isinstance(raw, bool):
        return AccessLogSettings(enabled=raw)  # `access_log: true` for the defaults
    sec = reader.section(raw, "access_log", top.line_of("access_log"))
    if sec is None:
        return AccessLogSettings()
    d = AccessLogSettings()
    result = AccessLogSettings(
        enabled=sec.get("enabled", yamlconf.boolean, True),
        output=sec.get("output", yamlconf.non_empty_string, d.output),
        include_query=sec.get("include_query", yamlconf.boolean, d.include_query),
        subject=sec.get("subject", yamlconf.one_of("plain", "hashed", "omitted"), d.subject),
        subject_hash_key=sec.secret("subject_hash_key", _secret) or d.subject_hash_key,
        flush_interval=sec.get("flush_interval", yamlconf.duration, d.flush_interval),
    )
    sec.finish()
    if result.subject == "hashed" and not result.subject_hash_key:
        reader.problem(
            sec.line_of("subject"),
            "access_log: subject: hashed needs subject_hash_key (a secret, so that subjects "
            "cannot be recovered by hashing guesses)",
        )
    return result


def _reload(reader: Reader, top: Section) -> ReloadSettings:
    sec = top.subsection("reload")
    if sec is None:
        return ReloadSettings()
    d = ReloadSettings()
    result = ReloadSettings(
        watch=sec.get("watch", yamlconf.boolean, d.watch),
        interval=sec.get("interval", yamlconf.duration, d.interval),
    )
    sec.finish()
    if result.interval < timedelta(milliseconds=10):
        reader.problem(sec.line_of("interval"), "reload.interval: must be at least 10ms")
    return result


def warnings(settings: Settings) -> list[str]:
    """What is valid but likely not meant, as `FILE:LINE: warning: message`."""
    if settings.upstream.path_case == "insensitive":
        return []
    return [
        f"{settings.file}:{found.line}: warning: {found.message}"
        for found in rules.find_case_variants(settings.routes)
    ]


def check(path: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Every problem in the file as `FILE:LINE: message`; empty when it is valid."""
    try:
        load(path, env)
    except ConfigError as exc:
        return [str(p) for p in exc.problems]
    return []
