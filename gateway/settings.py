"""The gateway's configuration: frozen dataclasses built from YAML, every problem with FILE:LINE.

`load(path)` reads, interpolates `${VAR}`, validates every key (unknown keys are errors), and
checks the route table for duplicates and rules shadowed by an earlier one. Nothing here does
I/O beyond reading the file, so `portcullis-gateway check` and the running gateway agree.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from portcullis import yamlconf
from portcullis.yamlconf import ConfigError, LocatedMap, Reader, Section

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

    def names(self) -> tuple[str, ...]:
        return (
            self.subject,
            self.client_id,
            self.scopes,
            self.issuer,
            *(header for header, _ in self.claims),
        )


@dataclass(frozen=True)
class ForwardSettings:
    strip_authorization: bool = False
    request_id_header: str = "X-Request-Id"
    buffer_size: int = 64 * 1024  # bodies with a Content-Length up to this are sent in one piece


@dataclass(frozen=True)
class Limits:
    max_line_size: int = 8 * 1024
    max_field_size: int = 8 * 1024
    max_headers: int = 100
    max_body_size: int | None = None
    idle_timeout: timedelta = timedelta(seconds=60)
    body_timeout: timedelta = timedelta(seconds=30)


@dataclass(frozen=True)
class ScopeRule:
    mode: str  # "any" or "all"
    scopes: frozenset[str]


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


@dataclass(frozen=True)
class Settings:
    file: str
    upstream: UpstreamSettings
    issuers: tuple[IssuerSettings, ...]
    routes: tuple[RouteSettings, ...]
    listen: Address = Address("0.0.0.0", 8080)
    admin_listen: Address = Address("127.0.0.1", 9901)
    realm: str = "portcullis"
    unmatched: str = "deny"
    jwks: JwksSettings = field(default_factory=JwksSettings)
    identity_headers: IdentityHeaders = field(default_factory=IdentityHeaders)
    forward: ForwardSettings = field(default_factory=ForwardSettings)
    limits: Limits = field(default_factory=Limits)
    token_cache_size: int = 100_000
    workers: int = 1
    shutdown_grace: timedelta = timedelta(seconds=20)
    log_level: str = "info"

    def issuer(self, url: str) -> IssuerSettings | None:
        return next((i for i in self.issuers if i.issuer == url), None)


# ---------------------------------------------------------------------------- loading


def load(path: str, env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate a gateway config file; raise ConfigError listing every problem."""
    return parse(yamlconf.load_file(path, env), path)


def load_text(text: str, file: str = "<text>", env: Mapping[str, str] | None = None) -> Settings:
    return parse(yamlconf.load_text(text, file, env), file)


def parse(data: LocatedMap, file: str) -> Settings:
    reader = Reader(file)
    top = Section(reader, data, "config")
    upstream = _upstream(reader, top)
    issuers = _issuers(reader, top)
    settings = Settings(
        file=file,
        upstream=upstream or UpstreamSettings(url="http://invalid"),
        issuers=issuers,
        routes=_routes(reader, top, issuers),
        listen=top.get("listen", _address, Settings.listen),
        admin_listen=top.get("admin_listen", _address, Settings.admin_listen),
        realm=top.get("realm", _realm, Settings.realm),
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
    )
    top.finish()
    if _overlap(settings.listen, settings.admin_listen):
        reader.problem(top.line_of("admin_listen"), "admin_listen must differ from listen")
    # Routes with a broken path are already left out, so the rest can be checked now and
    # every problem of the file is reported in one run.
    for conflict in rules.find_conflicts(settings.routes):
        reader.problem(conflict.line, conflict.message)
    reader.raise_if_any()
    return settings


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
    )
    sec.finish()
    return result


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
        mode = sec.get("mode", yamlconf.one_of("jwt"), "jwt")
        del mode  # only local JWT validation exists in this release
        entry = IssuerSettings(
            issuer=issuer or "",
            audiences=audiences,
            jwks_uri=jwks_uri,
            algorithms=algorithms or DEFAULT_ALGORITHMS,
            leeway=sec.get("leeway", yamlconf.duration, IssuerSettings.leeway),
            require_typ=sec.get("require_typ", yamlconf.boolean, True),
            allow_http=allow_http,
            line=line,
        )
        sec.finish()
        if issuer:
            if issuer in seen:
                reader.problem(
                    line, f"issuers[{index}]: {issuer} is already listed on line {seen[issuer]}"
                )
            seen[issuer] = line
        result.append(entry)
    if isinstance(raw, list) and not raw:
        reader.problem(top.line_of("issuers"), "config: issuers must list at least one issuer")
    return tuple(result)


def _jwks(reader: Reader, top: Section) -> JwksSettings:
    if not top.has("jwks"):
        top.raw("jwks")
        return JwksSettings()
    sec = reader.section(top.raw("jwks"), "jwks", top.line_of("jwks"))
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
    if not top.has("forward"):
        top.raw("forward")
        return ForwardSettings()
    sec = reader.section(top.raw("forward"), "forward", top.line_of("forward"))
    if sec is None:
        return ForwardSettings()
    d = ForwardSettings()
    result = ForwardSettings(
        strip_authorization=sec.get("strip_authorization", yamlconf.boolean, d.strip_authorization),
        request_id_header=sec.get("request_id_header", _header_name, d.request_id_header),
        buffer_size=sec.get("buffer_size", yamlconf.size, d.buffer_size),
    )
    sec.finish()
    return result


def _limits(reader: Reader, top: Section) -> Limits:
    if not top.has("limits"):
        top.raw("limits")
        return Limits()
    sec = reader.section(top.raw("limits"), "limits", top.line_of("limits"))
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
    )
    sec.finish()
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
    reader: Reader, top: Section, issuers: tuple[IssuerSettings, ...]
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
        )
        sec.finish()
        if path is not None:
            result.append(route)
    return tuple(result)


def check(path: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Every problem in the file as `FILE:LINE: message`; empty when it is valid."""
    try:
        load(path, env)
    except ConfigError as exc:
        return [str(p) for p in exc.problems]
    return []
