"""gateway.settings for introspection, rate limits, CORS, WebSockets, monitor mode, the access
log and reload: parsed into their dataclasses, every mistake reported as FILE:LINE: message."""

from __future__ import annotations

import ipaddress
from datetime import timedelta

import pytest

from gateway import settings
from gateway.settings import (
    AccessLogSettings,
    CorsSettings,
    IntrospectionSettings,
    LimitRule,
    PreAuthLimit,
    RateLimitSettings,
    ReloadSettings,
    WebSocketSettings,
)
from portcullis.yamlconf import ConfigError, Rate

FILE = "gw.yaml"

FULL = """\
upstream: {url: "http://127.0.0.1:8081"}
issuers:
  - issuer: "https://auth.example.com"
    audiences: [api]
    mode: auto
    introspection:
      client_id: gateway
      client_secret: "s3cret"
      cache_ttl: 5s
      inactive_cache_ttl: 500ms
      cache_size: 100
      timeout: 1s
      max_connections: 4
      max_pending: 64
  - {issuer: "https://other.example.com", audiences: [api]}
rate_limits:
  backend: "redis://127.0.0.1:6379/2"
  default: {rate: 100/s, burst: 200, key: subject}
  pre_auth: {rate: 20/s}
  on_backend_error: deny
  timeout: 50ms
  max_keys: 1000
  key_prefix: "gw:"
  headers: false
trusted_proxies: [10.0.0.0/8, "::1"]
cors:
  allow_origins: ["https://App.Example.com"]
  allow_credentials: true
mode: monitor
websocket: {close_on_token_expiry: true, max_message_size: 64KiB}
access_log: {output: /var/log/gw.log, include_query: true, subject: hashed, subject_hash_key: k}
reload: {watch: false, interval: 5s}
forward: {traceparent: false}
routes:
  - {name: ws, path: /ws, websocket: true, mode: enforce, cors: false, rate_limit: false}
  - name: ws2
    path: /ws2
    websocket: {close_on_token_expiry: false}
    rate_limit: {rate: 3/10s, burst: 5, key: "header:X-Api-Key"}
  - name: own-cors
    path: /own
    cors: {allow_origins: ["*"], allow_methods: [GET], max_age: 1m}
  - {name: rest, path: "/**"}
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        settings.load_text(text, FILE, {})
    return [str(p) for p in caught.value.problems]


def config(
    routes: str = "  - {name: rest, path: /**}\n", extra: str = "", issuers: str = ""
) -> str:
    issuers = issuers or '  - {issuer: "https://auth.example.com", audiences: [api]}\n'
    return (
        f'upstream: {{url: "http://127.0.0.1:8081"}}\nissuers:\n{issuers}{extra}routes:\n{routes}'
    )


def line_of(text: str, marker: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if marker in line)


def test_every_new_section_parses_into_its_dataclass():
    got = settings.load_text(FULL, FILE, {})
    first = got.issuers[0]
    assert (first.mode, first.uses_keys, first.takes_opaque_tokens) == ("auto", True, True)
    assert first.introspection == IntrospectionSettings(
        client_id="gateway",
        client_secret="s3cret",
        cache_ttl=timedelta(seconds=5),
        inactive_cache_ttl=timedelta(milliseconds=500),
        cache_size=100,
        timeout=timedelta(seconds=1),
        max_connections=4,
        max_pending=64,
    )
    assert "s3cret" not in repr(first)  # a secret never shows in a repr
    assert got.issuers[1].mode == "jwt" and got.issuers[1].introspection is None
    assert got.rate_limits == RateLimitSettings(
        backend="redis://127.0.0.1:6379/2",
        default=LimitRule(
            Rate(100, timedelta(seconds=1)), 200, "subject", line_of(FULL, "default:")
        ),
        pre_auth=PreAuthLimit(Rate(20, timedelta(seconds=1)), 20, "ip", line_of(FULL, "pre_auth:")),
        on_backend_error="deny",
        timeout=timedelta(milliseconds=50),
        max_keys=1000,
        key_prefix="gw:",
        headers=False,
    )
    assert got.trusted_proxies == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("::1/128"),
    )
    assert got.cors == CorsSettings(
        allow_origins=("https://app.example.com",),  # origins compare in lower case
        allow_credentials=True,
        line=line_of(FULL, "allow_origins"),
    )
    assert got.mode == "monitor"
    assert got.websocket == WebSocketSettings(True, 64 * 1024)
    assert got.access_log == AccessLogSettings(
        enabled=True,  # a section turns it on
        output="/var/log/gw.log",
        include_query=True,
        subject="hashed",
        subject_hash_key="k",
    )
    assert got.reload == ReloadSettings(watch=False, interval=timedelta(seconds=5))
    assert got.forward.traceparent is False
    ws, ws2, own, rest = got.routes
    assert (ws.mode, ws.cors, ws.rate_limit, got.websocket_of(ws)) == (
        "enforce",
        False,
        False,
        WebSocketSettings(True, 64 * 1024),  # `true` takes the global settings
    )
    assert got.websocket_of(ws2) == WebSocketSettings(False, 64 * 1024)  # a mapping changes some
    assert ws2.rate_limit == LimitRule(
        Rate(3, timedelta(seconds=10)), 5, "header:x-api-key", line_of(FULL, "rate: 3/10s")
    )
    assert own.cors == CorsSettings(
        allow_origins=("*",),
        allow_methods=("GET",),
        max_age=timedelta(minutes=1),
        line=line_of(FULL, "cors: {allow_origins"),
    )
    assert (rest.mode, rest.cors, rest.rate_limit, got.websocket_of(rest)) == (None,) * 4


def test_the_new_sections_have_the_documented_defaults():
    got = settings.load_text(config(), FILE, {})
    assert got.mode == "enforce"
    assert got.rate_limits == RateLimitSettings()
    assert (got.rate_limits.backend, got.rate_limits.on_backend_error) == ("memory", "allow")
    assert got.rate_limits.timeout == timedelta(milliseconds=100)
    assert got.trusted_proxies == ()
    assert got.cors is None
    assert got.websocket == WebSocketSettings(False, 4 * 1024 * 1024, None)
    assert got.request_log == AccessLogSettings(enabled=False)
    assert (got.request_log.enabled, got.request_log.output, got.request_log.subject) == (
        False,  # asked for, not imposed: a line per request has a cost
        "stderr",
        "plain",
    )
    assert settings.load_text(config(extra="access_log: true\n"), FILE, {}).request_log == (
        AccessLogSettings(enabled=True)
    )
    assert settings.load_text(
        config(extra="access_log: {enabled: false, output: x.log}\n"), FILE, {}
    ).access_log == AccessLogSettings(enabled=False, output="x.log")
    assert got.reload == ReloadSettings(watch=True, interval=timedelta(seconds=1))
    assert got.forward.traceparent is True
    intro = settings.load_text(
        config(
            issuers='  - {issuer: "https://a.example", audiences: [api], mode: introspection,'
            " introspection: {client_id: g, client_secret: s}}\n"
        ),
        FILE,
        {},
    ).issuers[0]
    assert intro.introspection == IntrospectionSettings("g", "s")
    assert intro.introspection.cache_ttl == timedelta(seconds=10)
    assert intro.introspection.inactive_cache_ttl == timedelta(seconds=2)
    assert (intro.uses_keys, intro.takes_opaque_tokens) == (False, True)
    assert settings.load_text(config(extra="access_log: false\n"), FILE, {}).request_log == (
        AccessLogSettings(enabled=False)
    )


def test_introspection_settings_must_fit_the_mode():
    text = config(
        issuers=(
            '  - {issuer: "https://a.example", audiences: [api], mode: introspection}\n'
            '  - {issuer: "https://b.example", audiences: [api],\n'
            "     introspection: {client_id: g, client_secret: s}}\n"
        )
    )
    assert problems(text) == [
        f"{FILE}:3: issuers[0]: mode introspection needs an introspection section "
        "(client_id and client_secret of the gateway)",
        f"{FILE}:5: issuers[1].introspection: only used with mode introspection or auto",
    ]


def test_max_pending_introspections_must_be_a_positive_count():
    text = config(
        issuers='  - {issuer: "https://a.example", audiences: [api], mode: introspection,\n'
        "     introspection: {client_id: g, client_secret: s, max_pending: 0}}\n"
    )
    [problem] = problems(text)
    assert problem.startswith(f"{FILE}:4: issuers[0].introspection.max_pending: ")


def test_only_one_issuer_may_take_tokens_that_are_not_jwts():
    section = "introspection: {client_id: g, client_secret: s}"
    text = config(
        issuers=(
            f'  - {{issuer: "https://a.example", audiences: [api], mode: auto, {section}}}\n'
            f'  - {{issuer: "https://b.example", audiences: [b], mode: introspection, {section}}}\n'
        )
    )
    assert problems(text) == [
        f"{FILE}:4: issuers: only one issuer may use mode introspection or auto "
        "(already https://a.example on line 3)"
    ]


def test_a_secret_that_is_not_a_string_is_refused_without_showing_it():
    text = config(
        issuers='  - {issuer: "https://a.example", audiences: [api], mode: auto,'
        " introspection: {client_id: g, client_secret: 918273645}}\n",
        extra="access_log: {subject: hashed, subject_hash_key: 5647382910}\n",
    )
    found = problems(text)
    assert found == [
        f"{FILE}:3: issuers[0].introspection.client_secret: must be a non-empty string "
        "(quote it; the value is not shown)",
        f"{FILE}:4: access_log.subject_hash_key: must be a non-empty string "
        "(quote it; the value is not shown)",
        f"{FILE}:4: access_log: subject: hashed needs subject_hash_key (a secret, so that "
        "subjects cannot be recovered by hashing guesses)",
    ]
    assert not any("918273645" in p or "5647382910" in p for p in found)


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ("{default: {rate: fast}}", "rate_limits.default.rate: 'fast' is not a rate"),
        ("{default: {rate: 1/s, key: user}}", "rate_limits.default.key: 'user' is not one of"),
        ("{default: {rate: 1/s, key: 'header:X Bad'}}", "'X Bad' is not a valid header name"),
        ("{default: {rate: 1/s, key: 'claim:'}}", "claim: needs a claim name"),
        ("{default: {rate: 1/s, burst: 0}}", "rate_limits.default.burst: must be at least 1"),
        (
            "{pre_auth: {rate: 1/s, key: subject}}",
            "rate_limits.pre_auth.key: 'subject' is not one of ip",
        ),
        ("{backend: 'mysql://db'}", "is neither memory nor a redis://, rediss:// or unix:// URL"),
        (
            "{on_backend_error: maybe}",
            "rate_limits.on_backend_error: 'maybe' is not one of allow, deny",
        ),
        ("{timeout: 0s}", "rate_limits.timeout: must be more than 0s"),
        ("{colour: red}", "rate_limits: unknown key 'colour'"),
    ],
)
def test_bad_rate_limit_settings_are_refused_on_their_line(limits, expected):
    text = config(extra=f"rate_limits: {limits}\n")
    found = problems(text)
    assert len(found) == 1, found
    assert found[0].startswith(f"{FILE}:4: ") and expected in found[0], found


def test_a_public_route_cannot_be_limited_by_an_identity_it_does_not_have():
    routes = "  - {name: pub, path: /pub, auth: none, rate_limit: {rate: 1/s, key: client_id}}\n"
    assert problems(config(routes)) == [
        f"{FILE}:5: route 'pub'.rate_limit.key: client_id needs a token, and this route has "
        "auth: none (use ip, route or header:NAME)"
    ]


@pytest.mark.parametrize(
    ("cors", "expected"),
    [
        ("{allow_methods: [GET]}", "cors: allow_origins is required"),
        ("{allow_origins: []}", "cors.allow_origins: list at least one"),
        ('{allow_origins: ["https://app.example.com/"]}', "is not an origin"),
        ('{allow_origins: ["app.example.com"]}', "is not an origin"),
        ('{allow_origins: ["*", "https://a.example"]}', "cors.allow_origins: * stands alone"),
        (
            '{allow_origins: ["*"], allow_credentials: true}',
            "cors: allow_credentials cannot be used with allow_origins: [*]",
        ),
        ('{allow_origins: ["https://a.example"], allow_methods: [get]}', "is not an HTTP method"),
    ],
)
def test_bad_cors_settings_are_refused_on_their_line(cors, expected):
    found = problems(config(extra=f"cors: {cors}\n"))
    assert len(found) == 1, found
    assert found[0].startswith(f"{FILE}:4: ") and expected in found[0], found


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("trusted_proxies: [10.0.0.0/33]", "trusted_proxies[0]: '10.0.0.0/33' is not an IP"),
        ("mode: audit", "config.mode: 'audit' is not one of enforce, monitor"),
        ("websocket: {heartbeat: 0s}", "websocket.heartbeat: must be more than 0s"),
        ("reload: {interval: 1ms}", "reload.interval: must be at least 10ms"),
        ("access_log: {subject: masked}", "access_log.subject: 'masked' is not one of"),
    ],
)
def test_bad_settings_elsewhere_are_refused_on_their_line(extra, expected):
    found = problems(config(extra=extra + "\n"))
    assert len(found) == 1, found
    assert found[0].startswith(f"{FILE}:4: ") and expected in found[0], found


def test_route_level_keys_are_validated_like_the_global_ones():
    routes = (
        "  - {name: a, path: /a, mode: loud}\n"
        "  - {name: b, path: /b, websocket: {close_on_token_expiry: often}}\n"
        "  - {name: c, path: /c, cors: {allow_origins: [nope]}}\n"
        "  - {name: d, path: /d, rate_limit: {burst: 2}}\n"
    )
    found = problems(config(routes))
    assert [p.split(": ", 1)[0] for p in found] == [
        f"{FILE}:5",
        f"{FILE}:6",
        f"{FILE}:7",
        f"{FILE}:8",
    ]
    assert "route 'a'.mode: 'loud' is not one of enforce, monitor" in found[0]
    assert "route 'b'.websocket.close_on_token_expiry: expected true or false" in found[1]
    assert "route 'c'.cors.allow_origins[0]: 'nope' is not an origin" in found[2]
    assert "route 'd'.rate_limit: rate is required" in found[3]
