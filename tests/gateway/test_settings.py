"""gateway.settings: every key validated, every problem reported as FILE:LINE: message."""

from __future__ import annotations

import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from gateway import settings
from gateway.settings import (
    Address,
    ForwardSettings,
    IdentityHeaders,
    IssuerSettings,
    JwksSettings,
    Limits,
    RouteSettings,
    ScopeRule,
    UpstreamSettings,
)
from portcullis.yamlconf import ConfigError

FILE = "gw.yaml"

VALID = """\
listen: "0.0.0.0:8080"
admin_listen: "127.0.0.1:9901"
realm: orders
upstream:
  url: "http://127.0.0.1:8081/"
  connect_timeout: 2s
  read_timeout: 30s
  max_connections: 64
  preserve_host: true
issuers:
  - issuer: "https://auth.example.com"
    audiences: [orders-api, billing-api]
    algorithms: [ES256, RS256, EdDSA]
    leeway: 30s
    mode: jwt
  - issuer: "http://10.1.2.3:9000"
    audiences: [internal]
    jwks_uri: "http://10.1.2.3:9000/keys"
    allow_http: true
    require_typ: false
jwks: {min_ttl: 1m, max_ttl: 1h, refetch_cooldown: 10s, fetch_timeout: 250ms, max_backoff: 2m}
identity_headers:
  subject: X-User
  claims: {X-Auth-Email: email}
forward: {strip_authorization: true, request_id_header: X-Trace, buffer_size: 128KiB}
limits: {max_line_size: 16KiB, max_headers: 50, max_body_size: 10MiB, idle_timeout: 100ms}
token_cache_size: 1000
workers: 2
shutdown_grace: 5s
log_level: debug
unmatched: deny
routes:
  - {name: health, path: /healthz, auth: none}
  - name: orders-read
    path: "/orders/**"
    methods: [GET, HEAD]
    scopes: {any: ["orders:read", "orders:admin"]}
  - name: orders-write
    path: "/orders/{id}"
    methods: [PUT, DELETE]
    issuers: ["https://auth.example.com"]
    audience: billing-api
    scopes: {all: ["orders:write"]}
    max_body_size: 1KiB
  - {name: rest, path: "/**"}
"""


def line_of(text: str, marker: str, occurrence: int = 1) -> int:
    """1-based line of the `occurrence`-th line containing `marker`."""
    hits = [n for n, line in enumerate(text.splitlines(), 1) if marker in line]
    return hits[occurrence - 1]


def problems(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        settings.load_text(text, FILE, env or {})
    return [str(p) for p in caught.value.problems]


def config(
    routes: str = "  - {name: rest, path: /**}\n", extra: str = "", issuers: str = ""
) -> str:
    """A minimal valid file; `routes` and `issuers` are YAML list items, `extra` top-level keys."""
    issuers = issuers or '  - {issuer: "https://auth.example.com", audiences: [api]}\n'
    return (
        f'upstream: {{url: "http://127.0.0.1:8081"}}\nissuers:\n{issuers}{extra}routes:\n{routes}'
    )


# ---------------------------------------------------------------------------- valid files


def test_full_valid_config_parses_into_the_expected_dataclasses() -> None:
    got = settings.load_text(VALID, FILE, {})
    assert got.file == FILE
    assert got.listen == Address("0.0.0.0", 8080)
    assert got.admin_listen == Address("127.0.0.1", 9901)
    assert got.realm == "orders"
    assert got.upstream == UpstreamSettings(
        url="http://127.0.0.1:8081",
        connect_timeout=timedelta(seconds=2),
        read_timeout=timedelta(seconds=30),
        max_connections=64,
        preserve_host=True,
    )
    assert got.issuers == (
        IssuerSettings(
            issuer="https://auth.example.com",
            audiences=("orders-api", "billing-api"),
            algorithms=("ES256", "RS256", "EdDSA"),
            leeway=timedelta(seconds=30),
            line=line_of(VALID, "https://auth.example.com"),
        ),
        IssuerSettings(
            issuer="http://10.1.2.3:9000",
            audiences=("internal",),
            jwks_uri="http://10.1.2.3:9000/keys",
            require_typ=False,
            allow_http=True,
            line=line_of(VALID, 'issuer: "http://10.1.2.3:9000"'),
        ),
    )
    assert got.jwks == JwksSettings(
        min_ttl=timedelta(minutes=1),
        max_ttl=timedelta(hours=1),
        refetch_cooldown=timedelta(seconds=10),
        fetch_timeout=timedelta(milliseconds=250),
        max_backoff=timedelta(minutes=2),
    )
    assert got.identity_headers == IdentityHeaders(
        subject="X-User", claims={"X-Auth-Email": "email"}
    )
    assert got.forward == ForwardSettings(
        strip_authorization=True, request_id_header="X-Trace", buffer_size=128 * 1024
    )
    assert got.limits == Limits(
        max_line_size=16 * 1024,
        max_headers=50,
        max_body_size=10 * 1024**2,
        idle_timeout=timedelta(milliseconds=100),
    )
    assert (got.token_cache_size, got.workers, got.log_level) == (1000, 2, "debug")
    assert got.shutdown_grace == timedelta(seconds=5)
    assert got.routes == (
        RouteSettings(name="health", path="/healthz", auth="none", line=line_of(VALID, "health")),
        RouteSettings(
            name="orders-read",
            path="/orders/**",
            methods=frozenset({"GET", "HEAD"}),
            scopes=ScopeRule(any_of=frozenset({"orders:read", "orders:admin"})),
            line=line_of(VALID, "name: orders-read"),
        ),
        RouteSettings(
            name="orders-write",
            path="/orders/{id}",
            methods=frozenset({"PUT", "DELETE"}),
            issuers=("https://auth.example.com",),
            audience="billing-api",
            scopes=ScopeRule(all_of=frozenset({"orders:write"})),
            max_body_size=1024,
            line=line_of(VALID, "name: orders-write"),
        ),
        RouteSettings(name="rest", path="/**", line=line_of(VALID, "name: rest")),
    )
    assert got.issuer("https://auth.example.com") is got.issuers[0]
    assert got.issuer("https://other.example.com") is None


def test_minimal_config_gets_the_documented_defaults() -> None:
    got = settings.load_text(config(), FILE, {})
    assert got.listen == Address("0.0.0.0", 8080)
    assert got.admin_listen == Address("127.0.0.1", 9901)
    assert got.issuers[0].algorithms == ("RS256", "ES256", "EdDSA")
    assert got.issuers[0].leeway == timedelta(seconds=30)
    assert got.issuers[0].require_typ is True
    assert got.jwks == JwksSettings()
    assert got.identity_headers == IdentityHeaders()
    assert got.limits == Limits()
    assert got.routes[0].methods is None and got.routes[0].auth == "required"


def test_environment_variables_fill_settings_with_their_types() -> None:
    text = config(extra='listen: "127.0.0.1:${PORT}"\nworkers: ${WORKERS:-3}\n')
    got = settings.load_text(text, FILE, {"PORT": "18080"})
    assert got.listen == Address("127.0.0.1", 18080)
    assert got.workers == 3


def test_ipv6_listen_address_is_accepted() -> None:
    got = settings.load_text(config(extra='listen: "[::1]:8443"\n'), FILE, {})
    assert got.listen == Address("::1", 8443)
    assert str(got.listen) == "[::1]:8443"


@pytest.mark.parametrize(
    "issuer", ["http://127.0.0.1:9000", "http://localhost:9000", "http://[::1]:9000"]
)
def test_plain_http_issuer_on_loopback_is_accepted(issuer: str) -> None:
    got = settings.load_text(
        config(issuers=f'  - {{issuer: "{issuer}", audiences: [api]}}\n'), FILE, {}
    )
    assert got.issuers[0].issuer == issuer


def test_check_returns_no_problem_for_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(VALID)
    assert settings.check(str(path), {}) == []
    assert settings.load(str(path), {}).file == str(path)


# ---------------------------------------------------------------------------- unknown keys


def test_unknown_keys_at_every_level_are_reported_on_their_own_line() -> None:
    text = textwrap.dedent(
        """\
        listn: "0.0.0.0:8080"
        upstream:
          url: "http://127.0.0.1:8081"
          conect_timeout: 2s
        issuers:
          - issuer: "https://auth.example.com"
            audiences: [api]
            audience: api
        jwks: {min_tl: 1m}
        identity_headers: {subjet: X-User}
        forward: {strip_auth: true}
        limits: {max_body: 1KiB}
        routes:
          - name: r
            path: /**
            scopes: {any: [a], none: [b]}
            method: [GET]
        """
    )
    found = problems(text)
    expected = [
        (1, "config: unknown key 'listn'"),
        (4, "upstream: unknown key 'conect_timeout'"),
        (8, "issuers[0]: unknown key 'audience'"),
        (9, "jwks: unknown key 'min_tl'"),
        (10, "identity_headers: unknown key 'subjet'"),
        (11, "forward: unknown key 'strip_auth'"),
        (12, "limits: unknown key 'max_body'"),
        (16, "route 'r'.scopes: unknown key 'none'"),
        (17, "route 'r': unknown key 'method'"),
    ]
    assert [(int(p.split(":")[1]), p.split(": ", 1)[1].split(";")[0]) for p in found] == expected
    assert all(p.startswith(f"{FILE}:") for p in found)


def test_unknown_key_message_names_the_keys_that_are_known() -> None:
    found = problems(config(routes="  - {name: r, path: /**, scope: {any: [a]}}\n"))
    assert found == [
        f"{FILE}:5: route 'r': unknown key 'scope'; known keys: allow_body_on_get, audience, "
        "auth, client_cert, cors, dpop, issuers, max_body_size, mcp, methods, mode, name, "
        "path, path_params, public_url, rate_limit, resource, scopes, websocket; "
        "did you mean 'scopes'?"
    ]


# ---------------------------------------------------------------------------- values


def test_bad_durations_are_reported_with_their_lines() -> None:
    text = config(
        issuers='  - issuer: "https://auth.example.com"\n    audiences: [api]\n    leeway: 30\n',
        extra="shutdown_grace: 5 minutes\njwks: {min_ttl: 10x}\n",
    )
    found = problems(text)
    assert found == [
        f"{FILE}:5: issuers[0].leeway: 30 is not a duration "
        "(write it like 30s, 5m, 250ms, 2h or 14d)",
        f"{FILE}:6: config.shutdown_grace: '5 minutes' is not a duration "
        "(write it like 30s, 5m, 250ms, 2h or 14d)",
        f"{FILE}:7: jwks.min_ttl: '10x' is not a duration "
        "(write it like 30s, 5m, 250ms, 2h or 14d)",
    ]


def test_jwks_min_ttl_above_max_ttl_is_refused() -> None:
    assert problems(config(extra="jwks: {min_ttl: 2h, max_ttl: 1h}\n")) == [
        f"{FILE}:4: jwks: min_ttl must not exceed max_ttl"
    ]


def test_unknown_algorithm_is_refused_naming_the_supported_ones() -> None:
    text = config(
        issuers='  - issuer: "https://auth.example.com"\n    audiences: [api]\n'
        "    algorithms: [ES256, RS257]\n"
    )
    assert problems(text) == [
        f"{FILE}:5: issuers[0].algorithms[1]: unknown algorithm 'RS257'; supported: "
        + ", ".join(settings.SUPPORTED_ALGORITHMS)
    ]


@pytest.mark.parametrize("alg", ["none", "HS256", "HS384", "HS512", "hs256"])
def test_unsigned_and_symmetric_algorithms_are_refused_with_the_reason(alg: str) -> None:
    text = config(
        issuers='  - issuer: "https://auth.example.com"\n    audiences: [api]\n'
        f"    algorithms: [{alg}]\n"
    )
    assert problems(text) == [
        f"{FILE}:5: issuers[0].algorithms[0]: {alg} cannot be used: tokens are verified with "
        "the issuer's public keys, and symmetric or unsigned tokens would let anyone with the "
        "key set forge them"
    ]


def test_empty_algorithm_list_is_refused() -> None:
    text = config(
        issuers='  - issuer: "https://auth.example.com"\n    audiences: [api]\n    algorithms: []\n'
    )
    assert problems(text) == [f"{FILE}:5: issuers[0].algorithms: list at least one"]


@pytest.mark.parametrize("audiences", ["", "    audiences: []\n"])
def test_issuer_without_audiences_is_refused(audiences: str) -> None:
    text = config(issuers=f'  - issuer: "https://auth.example.com"\n{audiences}')
    assert problems(text) == [
        f"{FILE}:3: issuers[0]: audiences is required (RFC 9068 §4: aud is checked)"
    ]


def test_plain_http_issuer_off_loopback_is_refused_unless_allowed() -> None:
    refused = config(issuers='  - {issuer: "http://auth.example.com", audiences: [api]}\n')
    assert problems(refused) == [
        f"{FILE}:3: issuers[0].issuer: 'http://auth.example.com' uses plain http; tokens and "
        "keys must come over https (set allow_http: true only inside a trusted network)"
    ]
    allowed = config(
        issuers='  - {issuer: "http://auth.example.com", audiences: [api], allow_http: true}\n'
    )
    assert settings.load_text(allowed, FILE, {}).issuers[0].allow_http is True


def test_plain_http_jwks_uri_off_loopback_is_refused() -> None:
    text = config(
        issuers='  - issuer: "https://auth.example.com"\n    audiences: [api]\n'
        '    jwks_uri: "http://keys.example.com/jwks"\n'
    )
    found = problems(text)
    assert len(found) == 1
    assert found[0].startswith(f"{FILE}:5: issuers[0].jwks_uri: ")
    assert "uses plain http" in found[0]


@pytest.mark.parametrize(
    ("issuer", "fragment"),
    [
        ("auth.example.com", "is not an http(s) URL"),
        ("ftp://auth.example.com", "is not an http(s) URL"),
        ("https://auth.example.com/?x=1", "must not have a query or fragment"),
    ],
)
def test_issuer_that_is_not_a_plain_https_url_is_refused(issuer: str, fragment: str) -> None:
    found = problems(config(issuers=f'  - {{issuer: "{issuer}", audiences: [api]}}\n'))
    assert len(found) == 1
    assert found[0].startswith(f"{FILE}:3: issuers[0].issuer: ")
    assert fragment in found[0]


def test_duplicate_issuer_is_reported_on_the_second_with_the_first_line() -> None:
    issuers = (
        '  - {issuer: "https://auth.example.com", audiences: [a]}\n'
        '  - {issuer: "https://other.example.com", audiences: [b]}\n'
        '  - {issuer: "https://auth.example.com", audiences: [c]}\n'
    )
    assert problems(config(issuers=issuers)) == [
        f"{FILE}:5: issuers[2]: https://auth.example.com is already listed on line 3"
    ]


def test_missing_or_empty_issuers_and_routes_are_refused() -> None:
    text = 'upstream: {url: "http://127.0.0.1:8081"}\n'
    assert problems(text) == [
        f"{FILE}:1: config: issuers is required (a list of trusted token issuers)",
        f"{FILE}:1: config: routes is required (unmatched requests are denied)",
    ]
    assert problems(text + "issuers: []\nroutes: []\n") == [f"{FILE}:2: issuers: list at least one"]


def test_missing_upstream_or_upstream_url_is_refused() -> None:
    without = config().replace('upstream: {url: "http://127.0.0.1:8081"}\n', "")
    assert problems(without) == [f"{FILE}:1: config: upstream is required (the API requests go to)"]
    assert problems(config().replace('{url: "http://127.0.0.1:8081"}', "{read_timeout: 1s}")) == [
        f"{FILE}:1: upstream: url is required"
    ]
    assert problems(config().replace("http://127.0.0.1:8081", "http://127.0.0.1:8081/?a=b")) == [
        f"{FILE}:1: upstream.url: must not have a query or fragment"
    ]


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("8080", "is not host:port"),
        (":8080", "has no host"),
        ("0.0.0.0:0", "is not host:port"),
        ("0.0.0.0:70000", "is not host:port"),
        ("0.0.0.0:http", "is not host:port"),
    ],
)
def test_bad_listen_address_is_refused(value: str, fragment: str) -> None:
    found = problems(config(extra=f'listen: "{value}"\n'))
    assert len(found) == 1
    assert found[0].startswith(f"{FILE}:4: config.listen: ")
    assert fragment in found[0]


@pytest.mark.parametrize(
    ("listen", "admin"),
    [
        ("127.0.0.1:8080", "127.0.0.1:8080"),
        ("0.0.0.0:8080", "127.0.0.1:8080"),
        ("127.0.0.1:9901", "[::]:9901"),
    ],
)
def test_admin_listen_that_would_share_the_public_socket_is_refused(
    listen: str, admin: str
) -> None:
    text = config(extra=f'listen: "{listen}"\nadmin_listen: "{admin}"\n')
    assert problems(text) == [f"{FILE}:5: admin_listen must differ from listen"]


def test_admin_listen_on_another_port_or_host_is_accepted() -> None:
    text = config(extra='listen: "127.0.0.1:8080"\nadmin_listen: "127.0.0.2:8080"\n')
    assert settings.load_text(text, FILE, {}).admin_listen == Address("127.0.0.2", 8080)


def test_identity_headers_must_be_valid_and_distinct() -> None:
    text = config(
        extra="identity_headers:\n  subject: X-Auth-Scopes\n  claims: {'Bad Header': email}\n"
    )
    assert problems(text) == [
        f"{FILE}:5: identity_headers: two identity values use the same header",
        f"{FILE}:6: identity_headers.claims: 'Bad Header' is not a valid header name",
    ]


@pytest.mark.parametrize("name", ["Authorization", "Host", "X-Forwarded-For", "Content_Length"])
def test_identity_headers_cannot_take_a_header_http_or_the_gateway_needs(name: str) -> None:
    text = config(extra=f"identity_headers:\n  subject: {name}\n")
    lowered = name.lower().replace("_", "-")
    assert problems(text) == [f"{FILE}:5: identity_headers: {lowered} cannot carry an identity"]


# ---------------------------------------------------------------------------- routes


def test_route_without_name_or_path_is_refused() -> None:
    routes = "  - {path: /a}\n  - {name: b}\n"
    assert problems(config(routes)) == [
        f"{FILE}:5: routes[0]: name is required",
        f"{FILE}:6: route 'b': path is required",
    ]


def test_duplicate_route_names_are_refused_with_the_first_line() -> None:
    routes = "  - {name: r, path: /a}\n  - {name: s, path: /b}\n  - {name: r, path: /c}\n"
    assert problems(config(routes)) == [f"{FILE}:7: route 'r': the name is already used on line 5"]


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("/a/**/b", "** may only be the last segment"),
        ("/{a}/x/{a}", "uses {a} twice"),
        ("/a/../b", "dot segments are not allowed"),
        ("/a/./b", "dot segments are not allowed"),
        ("/a//b", "empty segment (//)"),
        ("orders", "must start with /"),
        ("/a/*", "is neither literal nor {name}"),
        ("/a/{b", "is neither literal nor {name}"),
        ("/a?x=1", "without query or fragment"),
        ("/a/%2e", "characters a path cannot hold"),
        ("//**", "write /** rather than //**"),
    ],
)
def test_bad_path_template_is_refused_on_its_line(path: str, fragment: str) -> None:
    routes = f'  - name: r\n    path: "{path}"\n'
    found = problems(config(routes))
    assert len(found) == 1, found
    assert found[0].startswith(f"{FILE}:6: route 'r'.path: ")
    assert fragment in found[0]


@pytest.mark.parametrize(
    ("methods", "fragment"),
    [
        ("[get]", "methods[0]: 'get' is not an HTTP method in upper case"),
        ("[GET, 'PO ST']", "methods[1]: 'PO ST' is not an HTTP method in upper case"),
        ("[]", "methods: list at least one"),
        ("GET", "methods must be a list, got str 'GET'"),
    ],
)
def test_bad_methods_are_refused(methods: str, fragment: str) -> None:
    routes = f"  - name: r\n    path: /a\n    methods: {methods}\n"
    found = problems(config(routes))
    assert f"{FILE}:7: route 'r'.{fragment}" in found


@pytest.mark.parametrize(
    ("scopes", "expected"),
    [
        ("{any: [a], all: [b]}", "7: route 'r'.scopes: give exactly one of any or all"),
        ("{}", "7: route 'r'.scopes: give exactly one of any or all"),
        ("{any: []}", "7: route 'r'.scopes.any: list at least one"),
        ("{all: ['a b']}", "7: route 'r'.scopes.all[0]: 'a b' is not a scope"),
        ("[a]", "7: route 'r'.scopes must be a mapping, got a list"),
    ],
)
def test_bad_scope_rules_are_refused(scopes: str, expected: str) -> None:
    routes = f"  - name: r\n    path: /a\n    scopes: {scopes}\n"
    found = problems(config(routes))
    assert len(found) == 1, found
    assert found[0].startswith(f"{FILE}:{expected}")


def test_route_issuers_must_be_listed_issuers() -> None:
    routes = '  - name: r\n    path: /a\n    issuers: ["https://auth.example.com", "https://x.example"]\n'
    assert problems(config(routes)) == [
        f"{FILE}:7: route 'r'.issuers: https://x.example is not in the issuers list"
    ]


def test_route_with_an_empty_issuer_list_is_refused() -> None:
    routes = "  - name: r\n    path: /a\n    issuers: []\n"
    assert problems(config(routes)) == [
        f"{FILE}:7: route 'r'.issuers: list at least one issuer (or leave the key out for all)"
    ]


def test_issuers_audience_and_scopes_on_a_public_route_are_refused() -> None:
    routes = (
        "  - name: open\n    path: /open\n    auth: none\n"
        '    issuers: ["https://auth.example.com"]\n    audience: api\n    scopes: {any: [a]}\n'
    )
    assert problems(config(routes)) == [
        f"{FILE}:8: route 'open'.issuers: means nothing with auth: none",
        f"{FILE}:9: route 'open'.audience: means nothing with auth: none",
        f"{FILE}:10: route 'open'.scopes: means nothing with auth: none",
    ]


def test_unknown_auth_value_is_refused() -> None:
    routes = "  - {name: r, path: /a, auth: optional}\n"
    assert problems(config(routes)) == [
        f"{FILE}:5: route 'r'.auth: 'optional' is not one of required, none"
    ]


def test_shadowed_and_duplicate_routes_are_refused_with_both_lines() -> None:
    routes = (
        "  - {name: all-orders, path: /orders/**}\n"
        "  - {name: one-order, path: '/orders/{id}', methods: [GET]}\n"
        "  - {name: again, path: /orders/**}\n"
    )
    found = problems(config(routes))
    assert found == [
        f"{FILE}:6: route 'one-order' is shadowed by route 'all-orders' (line 5): every request "
        "it matches is taken by that earlier rule, so it can never apply; move it above or "
        "narrow the earlier rule",
        f"{FILE}:7: route 'again' duplicates route 'all-orders' (line 5): every request it "
        "matches is taken by that earlier rule, so it can never apply; move it above or narrow "
        "the earlier rule",
    ]


def test_a_rule_naming_get_shadows_a_later_head_rule() -> None:
    routes = (
        "  - {name: read, path: /orders/**, methods: [GET]}\n"
        "  - {name: peek, path: /orders/**, methods: [HEAD]}\n"
    )
    assert "route 'peek' is shadowed by route 'read' (line 5)" in problems(config(routes))[0]


def test_path_case_and_path_params_take_their_values_and_default_to_the_strict_ones() -> None:
    loaded = settings.load_text(
        config(
            routes="  - {name: m, path: /m/**, path_params: allow}\n  - {name: rest, path: /**}\n"
        ).replace('8081"}', '8081", path_case: insensitive}'),
        FILE,
        {},
    )
    assert loaded.upstream.path_case == "insensitive"
    assert [r.path_params for r in loaded.routes] == ["allow", "refuse"]
    default = settings.load_text(config(), FILE, {})
    assert default.upstream.path_case == "sensitive"
    assert default.routes[0].path_params == "refuse"


def test_bad_path_case_and_path_params_values_are_refused_on_their_lines() -> None:
    text = config(routes="  - {name: r, path: /**, path_params: strip}\n").replace(
        '8081"}', '8081", path_case: lower}'
    )
    assert problems(text) == [
        f"{FILE}:1: upstream.path_case: 'lower' is not one of sensitive, insensitive",
        f"{FILE}:5: route 'r'.path_params: 'strip' is not one of refuse, allow",
    ]


def test_with_case_ignored_rules_differing_only_in_case_are_duplicates() -> None:
    routes = "  - {name: upper, path: /Admin/**}\n  - {name: lower, path: /admin/**}\n"
    assert settings.load_text(config(routes), FILE, {}).routes[1].name == "lower"
    text = config(routes).replace('8081"}', '8081", path_case: insensitive}')
    assert [p.split("): ")[0] + ")" for p in problems(text)] == [
        f"{FILE}:6: route 'lower' duplicates route 'upper' (line 5)"
    ]


def test_a_template_with_a_semicolon_is_refused_as_unreachable() -> None:
    found = problems(config(routes='  - {name: r, path: "/a;v=1"}\n'))
    assert len(found) == 1
    assert found[0].startswith(f"{FILE}:5: route 'r'.path: ")
    assert "holds ';'" in found[0]


def test_warnings_name_a_public_rule_that_takes_case_variants_of_a_protected_one() -> None:
    routes = (
        "  - {name: internal, path: /docs/internal/**}\n"
        "  - {name: docs, path: /docs/**, auth: none}\n"
    )
    loaded = settings.load_text(config(routes), FILE, {})
    assert settings.warnings(loaded) == [
        f"{FILE}:6: warning: route 'docs' (auth: none) takes GET /docs/INTERNAL, which differs "
        "only in letter case from paths of the protected route 'internal' (line 5); if the "
        "upstream ignores case it serves both as one resource: set upstream.path_case: "
        "insensitive"
    ]
    ignoring = config(routes).replace('8081"}', '8081", path_case: insensitive}')
    assert settings.warnings(settings.load_text(ignoring, FILE, {})) == []


def test_route_conflicts_are_reported_together_with_other_problems() -> None:
    routes = "  - {name: a, path: /a/**}\n  - {name: b, path: /a/b}\n"
    found = problems(config(routes, extra="workers: 0\n"))
    assert [p.split(": ")[0] for p in found] == [f"{FILE}:4", f"{FILE}:7"]
    assert "config.workers: must be at least 1" in found[0]
    assert "route 'b' is shadowed by route 'a'" in found[1]


def test_every_problem_in_a_file_is_reported_at_once_in_line_order() -> None:
    text = textwrap.dedent(
        """\
        upstream: {url: "ftp://x", read_timeout: soon}
        issuers:
          - issuer: "http://auth.example.com"
            algorithms: [none]
        routes:
          - {name: r, path: "/a/**/b", methods: [get]}
          - {name: r, path: /b}
        log_level: loud
        """
    )
    found = problems(text)
    assert [int(p.split(":")[1]) for p in found] == sorted(int(p.split(":")[1]) for p in found)
    assert [p.split(":")[1] for p in found] == ["1", "1", "3", "3", "4", "6", "6", "7", "8"]
    assert "route 'r'.methods[0]: 'get' is not an HTTP method in upper case" in found[6]


def test_check_lists_every_problem_as_file_line_message(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(config(routes="  - {name: r, path: /a, colour: red}\n", extra="workers: x\n"))
    assert settings.check(str(path), {}) == [
        f"{path}:4: config.workers: expected an integer, got str 'x'",
        f"{path}:6: route 'r': unknown key 'colour'; known keys: allow_body_on_get, audience, "
        "auth, client_cert, cors, dpop, issuers, max_body_size, mcp, methods, mode, name, "
        "path, path_params, public_url, rate_limit, resource, scopes, websocket",
    ]


# ------------------------------------------------------------------- bodies, pool, connections


def test_body_pool_and_connection_limits_have_documented_defaults() -> None:
    got = settings.load_text(config(), FILE, {})
    assert got.upstream.pool_timeout == timedelta(seconds=5)
    assert got.limits.body_total_timeout == timedelta(minutes=5)
    assert got.limits.max_bodies_per_client == 32
    assert got.limits.max_connections == 10_000
    assert got.forward.strip_method_override is True
    assert got.routes[0].allow_body_on_get is False


def test_body_pool_and_connection_limits_are_read() -> None:
    text = config(
        routes="  - {name: search, path: /search, methods: [GET], allow_body_on_get: true}\n",
        extra="limits: {body_total_timeout: 90s, max_bodies_per_client: 0, max_connections: 500}\n"
        "forward: {strip_method_override: false}\n",
    ).replace(
        '{url: "http://127.0.0.1:8081"}', '{url: "http://127.0.0.1:8081", pool_timeout: 250ms}'
    )
    got = settings.load_text(text, FILE, {})
    assert got.upstream.pool_timeout == timedelta(milliseconds=250)
    assert got.limits.body_total_timeout == timedelta(seconds=90)
    assert (got.limits.max_bodies_per_client, got.limits.max_connections) == (0, 500)
    assert got.forward.strip_method_override is False
    assert got.routes[0].allow_body_on_get is True


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("limits: {body_total_timeout: 0s}", "limits.body_total_timeout: must be more than 0s"),
        ("limits: {max_bodies_per_client: -1}", "limits.max_bodies_per_client: must be at least 0"),
        ("limits: {max_connections: 0}", "limits.max_connections: must be at least 1"),
        (
            "forward: {strip_method_override: maybe}",
            "forward.strip_method_override: expected true or false, got str 'maybe'",
        ),
    ],
)
def test_bad_body_and_connection_limits_are_refused_on_their_line(
    extra: str, expected: str
) -> None:
    assert problems(config(extra=extra + "\n")) == [f"{FILE}:4: {expected}"]


def test_bad_pool_timeout_and_allow_body_on_get_are_refused_on_their_line() -> None:
    text = config(routes="  - {name: r, path: /**, allow_body_on_get: sometimes}\n").replace(
        '{url: "http://127.0.0.1:8081"}', '{url: "http://127.0.0.1:8081", pool_timeout: 0s}'
    )
    assert problems(text) == [
        f"{FILE}:1: upstream.pool_timeout: must be more than 0s",
        f"{FILE}:5: route 'r'.allow_body_on_get: expected true or false, got str 'sometimes'",
    ]


def test_server_header_is_none_by_default_and_must_be_a_plain_header_value() -> None:
    assert settings.load_text(config(), FILE, {}).server_header == ""
    got = settings.load_text(config(extra='server_header: "portcullis"\n'), FILE, {})
    assert got.server_header == "portcullis"
    text = config(extra='server_header: "bad\\r\\nX-Injected: 1"\n')
    assert problems(text) == [
        f"{FILE}:4: config.server_header: may contain printable ASCII only, without spaces at "
        "either end"
    ]


def test_every_algorithm_a_configuration_may_name_has_a_key_type_and_a_signature_check():
    # The issuers' `algorithms` and `dpop.algorithms` take these; tokens, events and proofs
    # are all checked by the kernel's JOSE (portcullis/jose.py).
    from gateway.verifiers.jwks import KEY_TYPE_OF_ALG
    from portcullis.dpop import ASYMMETRIC_ALGORITHMS
    from portcullis.jose import SIGNATURE_ALGORITHMS

    assert set(settings.SUPPORTED_ALGORITHMS) == SIGNATURE_ALGORITHMS
    assert set(KEY_TYPE_OF_ALG) == SIGNATURE_ALGORITHMS  # access tokens and events
    assert set(ASYMMETRIC_ALGORITHMS) == SIGNATURE_ALGORITHMS  # DPoP proofs
    assert not {"none", "HS256", "HS384", "HS512"} & SIGNATURE_ALGORITHMS
