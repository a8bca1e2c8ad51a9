"""Settings shaped like the gateway's, declared with portcullis.sections, for its tests.

Durations, bounded integers, sizes, rates, enumerations (Literal and Enum), custom parsers
with their schema (host:port, URLs, header names, networks), a secret, nested and optional
sections, lists of sections with labels, a section or `false`, a mapping with parsed keys, a
renamed key, the section's line and file, and `validate()` rules within and across sections.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal
from urllib.parse import urlsplit

from portcullis import yamlconf
from portcullis.addresses import IPNetwork, network
from portcullis.sections import (
    Check,
    named,
    section,
    section_line,
    setting,
    source_file,
)
from portcullis.yamlconf import Rate


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def address(value: Any) -> Address:
    text = yamlconf.string(value)
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    if not host:
        raise ValueError(f"{text!r} has no host (use 0.0.0.0:{port} for every interface)")
    return Address(host, int(port))


ADDRESS = {"type": "string", "title": "host:port", "pattern": ":[0-9]+$"}


def url(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{text!r} is not an http(s) URL")
    if parts.query or parts.fragment:
        raise ValueError(f"{text!r} must not have a query or fragment")
    return text.rstrip("/")


URL = {"type": "string", "title": "URL", "pattern": "://"}

_TOKEN = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")


def header_name(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if not _TOKEN.match(text):
        raise ValueError(f"{text!r} is not a valid header name")
    return text


HEADER = {"type": "string", "title": "header name", "pattern": r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$"}


def method(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if not re.fullmatch(r"[A-Z]+", text):
        raise ValueError(f"{text!r} is not an HTTP method in upper case")
    return text


def path(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if not text.startswith("/"):
        raise ValueError(f"{text!r} does not start with /")
    return text


@section
class Upstream:
    """The API that requests go to."""

    url: str = setting("Base URL of the API.", parser=url, schema=URL)
    connect_timeout: timedelta = setting(
        "Time to open a connection.", default=timedelta(seconds=2), more_than=timedelta(0)
    )
    max_connections: int = setting(
        "Keep-alive pool towards the API.", default=256, minimum=1, maximum=100_000
    )
    path_case: Literal["sensitive", "insensitive"] = setting(
        "How rules compare paths.", default="sensitive"
    )


@section
class Introspection:
    """How tokens are asked about at the issuer (RFC 7662)."""

    client_id: str = setting("The gateway's client_id at the issuer.")
    client_secret: str = setting("Its secret.", secret=True)
    url: str | None = setting(
        "Introspection endpoint; discovery's when absent.", default=None, parser=url, schema=URL
    )
    cache_ttl: timedelta = setting("How long an answer is kept.", default=timedelta(seconds=10))


class Mode(enum.Enum):
    JWT = "jwt"
    INTROSPECTION = "introspection"
    AUTO = "auto"


@section
class Issuer:
    """A trusted token issuer."""

    issuer: str = setting("The issuer's URL, as in `iss`.", parser=url, schema=URL)
    audiences: tuple[str, ...] = setting(
        "Values of `aud` accepted.", min_items=1, hint="RFC 9068 §4: aud is checked"
    )
    algorithms: tuple[Literal["RS256", "ES256", "EdDSA"], ...] = setting(
        "Signature algorithms accepted.", default=("RS256", "ES256"), min_items=1
    )
    leeway: timedelta = setting("Clock skew allowed.", default=timedelta(seconds=30))
    mode: Mode = setting("How tokens are verified.", default=Mode.JWT)
    introspection: Introspection | None = setting("Needed by modes other than jwt.", default=None)
    line: int = section_line()

    def validate(self, check: Check) -> None:
        if (
            self.mode is not Mode.JWT
            and self.introspection is None
            and not check.has("introspection")
        ):
            check.problem(f"mode {self.mode.value} needs an introspection section", key="mode")


@section
class Jwks:
    """How key sets are cached."""

    min_ttl: timedelta = setting("Shortest time a key set is kept.", default=timedelta(minutes=5))
    max_ttl: timedelta = setting("Longest time a key set is kept.", default=timedelta(hours=24))

    def validate(self, check: Check) -> None:
        if self.min_ttl > self.max_ttl:
            check.problem("min_ttl must not exceed max_ttl")


@section
class IdentityHeaders:
    """Headers carrying the verified identity."""

    subject: str = setting(
        "Header for `sub`.", default="X-Auth-Subject", parser=header_name, schema=HEADER
    )
    claims: Mapping[str, str] = setting(
        "Header name to claim name.", default_factory=dict, keys=header_name
    )


@section
class LimitRule:
    """A token bucket."""

    rate: Rate = setting("Refill rate.")
    burst: int | None = setting(
        "Bucket size; the rate's count when absent.", default=None, minimum=1
    )
    key: Literal["subject", "client_id", "ip", "route"] = setting(
        "One bucket per this.", default="subject"
    )


@section
class RateLimits:
    """Rate limiting."""

    backend: str = setting("memory or redis://host:port/db.", default="memory")
    default: LimitRule | None = setting("Applied to routes without their own.", default=None)
    timeout: timedelta = setting(
        "Time the backend gets to answer.",
        default=timedelta(milliseconds=100),
        more_than=timedelta(0),
    )


@section
class ScopeRule:
    """Scopes a token must carry: `any` one of them, or `all`."""

    any_of: tuple[str, ...] | None = setting("Any one of these.", default=None, key="any")
    all_of: tuple[str, ...] | None = setting("All of these.", default=None, key="all")

    def validate(self, check: Check) -> None:
        if (self.any_of is None) == (self.all_of is None):
            check.problem("give exactly one of any or all")


@section
class Route:
    """A rule for the requests it matches."""

    name: str = setting("Names the rule in logs and metrics.")
    path: str = setting("Path template.", parser=path, schema={"type": "string", "pattern": "^/"})
    methods: frozenset[str] | None = setting(
        "Methods matched; every method when absent.",
        default=None,
        parser=method,
        schema={"type": "string", "pattern": "^[A-Z]+$"},
        min_items=1,
    )
    auth: Literal["required", "none"] = setting("Whether a token is needed.", default="required")
    issuers: tuple[str, ...] | None = setting("Issuers accepted here.", default=None, min_items=1)
    scopes: ScopeRule | None = setting("Scopes asked for.", default=None)
    max_body_size: int | None = setting("Largest request body.", default=None, parser=yamlconf.size)
    rate_limit: LimitRule | Literal[False] | None = setting(
        "This route's limit; false for none; the default when absent.", default=None
    )
    line: int = section_line()

    def validate(self, check: Check) -> None:
        if self.auth == "none":
            for key in ("issuers", "scopes"):
                if check.has(key):
                    check.problem("means nothing with auth: none", key=key)


@section
class Settings:
    """Configuration of a token-checking gateway."""

    file: str = source_file()
    upstream: Upstream = setting("Where requests go.", hint="the API requests go to")
    issuers: tuple[Issuer, ...] = setting(
        "Trusted issuers.", min_items=1, hint="a list of trusted token issuers"
    )
    routes: tuple[Route, ...] = setting(
        "Rules, tried in order.",
        label=named("route", "name"),
        hint="unmatched requests are denied",
    )
    listen: Address = setting(
        "Where clients connect.", default=Address("0.0.0.0", 8080), parser=address, schema=ADDRESS
    )
    admin_listen: Address = setting(
        "Health and metrics.", default=Address("127.0.0.1", 9901), parser=address, schema=ADDRESS
    )
    jwks: Jwks = setting("Key set caching.", default_factory=Jwks)
    identity_headers: IdentityHeaders = setting(
        "Identity sent upstream.", default_factory=IdentityHeaders
    )
    rate_limits: RateLimits = setting("Rate limiting.", default_factory=RateLimits)
    workers: int = setting("Processes sharing the port.", default=1, minimum=1, maximum=256)
    buffer_size: int = setting(
        "Bodies up to this move in one piece.", default=65536, parser=yamlconf.size
    )
    log_level: Literal["debug", "info", "warning", "error"] = setting(
        "Least severity logged.", default="info"
    )
    trusted_proxies: tuple[IPNetwork, ...] = setting(
        "Peers whose X-Forwarded-For is believed.",
        default=(),
        parser=network,
        schema={"type": "string", "title": "address or network"},
    )

    def validate(self, check: Check) -> None:
        if self.listen == self.admin_listen:
            written = "admin_listen" if check.has("admin_listen") else "listen"
            check.problem_at(check.line_of(written), "admin_listen must differ from listen")
        known = {i.issuer for i in self.issuers}
        names: dict[str, int] = {}
        for route in self.routes:
            within = check.within(route)
            if route.name in names:
                within.problem(f"the name is already used on line {names[route.name]}")
            names.setdefault(route.name, route.line)
            for issuer in route.issuers or ():
                if issuer not in known:
                    within.problem(f"{issuer} is not in the issuers list", key="issuers")
