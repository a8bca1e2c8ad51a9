"""gateway.adapter: the records the running gateway reads, built from the settings."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from gateway import adapter, settings
from gateway.core import policy, rules
from gateway.core.principal import Principal
from gateway.core.records import Bucket, Cors, Introspection, Issuer, Route, Scopes, WebSocket
from portcullis.yamlconf import Rate

AUTH = "https://auth.example.com"
OPAQUE = "https://opaque.example.com"

CONFIG = f"""
upstream: {{url: "http://127.0.0.1:8081"}}
mode: monitor
limits: {{max_body_size: 1000}}
rate_limits: {{default: {{rate: 10/s, burst: 5, key: subject}}}}
cors: {{allow_origins: ["https://app.example.com"]}}
websocket: {{close_on_token_expiry: true}}
issuers:
  - issuer: "{AUTH}"
    audiences: [orders-api]
    algorithms: [ES256]
    leeway: 5s
    require_typ: false
  - issuer: "{OPAQUE}"
    audiences: [orders-api]
    mode: introspection
    introspection: {{client_id: gateway, client_secret: s3cret, cache_ttl: 3s, max_pending: 7}}
routes:
  - {{name: health, path: /healthz, auth: none, rate_limit: false, cors: false}}
  - name: write
    path: "/orders/{{id}}"
    methods: [PUT]
    issuers: ["{AUTH}"]
    audience: orders-write
    scopes: {{all: ["orders:write"]}}
    mode: enforce
    max_body_size: 10
    rate_limit: {{rate: 1/s, burst: 2, key: ip}}
    websocket: {{close_on_token_expiry: false}}
    path_params: allow
    allow_body_on_get: true
  - {{name: rest, path: "/**", scopes: {{any: ["a", "b"]}}, websocket: true}}
"""

LOADED = settings.load_text(CONFIG, "adapter.yaml", {})


def _route(name: str) -> Route:
    return next(r for r in adapter.routes(LOADED) if r.name == name)


def test_an_issuer_record_copies_every_setting_but_its_line() -> None:
    record = adapter.issuers(LOADED)[0]
    assert record == Issuer(
        issuer=AUTH,
        audiences=("orders-api",),
        jwks_uri=None,
        algorithms=("ES256",),
        leeway=timedelta(seconds=5),
        require_typ=False,
        allow_http=False,
        mode="jwt",
        introspection=None,
        ca_file=None,
        dpop="allowed",
    )
    assert record.uses_keys and not record.takes_opaque_tokens


def test_an_introspecting_issuer_gets_its_introspection_record() -> None:
    record = adapter.issuers(LOADED)[1]
    assert record.mode == "introspection" and record.takes_opaque_tokens
    assert not record.uses_keys
    given = LOADED.issuers[1].introspection
    assert given is not None
    assert record.introspection == Introspection(
        client_id="gateway",
        client_secret="s3cret",
        url=None,
        cache_ttl=timedelta(seconds=3),
        inactive_cache_ttl=given.inactive_cache_ttl,
        cache_size=given.cache_size,
        timeout=given.timeout,
        max_connections=given.max_connections,
        max_pending=7,
        cache=None,
        cache_key_prefix=given.cache_key_prefix,
        cache_timeout=given.cache_timeout,
    )


def test_records_name_every_setting_so_a_new_option_cannot_be_left_behind() -> None:
    # A field added to a settings section must reach its record (or be named here as one
    # the adapter resolves into another field).
    issuer_fields = {f.name for f in dataclasses.fields(Issuer)}
    assert {f.name for f in dataclasses.fields(settings.IssuerSettings)} - {"line"} == (
        issuer_fields
    )
    introspection_fields = {f.name for f in dataclasses.fields(Introspection)}
    assert {f.name for f in dataclasses.fields(settings.IntrospectionSettings)} == (
        introspection_fields
    )
    resolved = {"mode": "monitor"}
    # Derived from others: the resource's canonical URI (public_url and resource).
    derived = {"resource_uri"}
    route_fields = {f.name for f in dataclasses.fields(Route)}
    assert {
        resolved.get(f.name, f.name) for f in dataclasses.fields(settings.RouteSettings)
    } == route_fields - derived


def test_a_route_that_sets_nothing_takes_every_default() -> None:
    route = _route("rest")
    assert route.monitor is True  # the global mode
    assert route.max_body_size == 1000
    assert route.rate_limit == Bucket(Rate(10, timedelta(seconds=1)), 5, "subject")
    assert route.cors == Cors(
        ("https://app.example.com",),
        ("GET", "HEAD", "POST"),
        ("Authorization", "Content-Type"),
        (),
        False,
        timedelta(minutes=10),
    )
    assert route.websocket == WebSocket(True, 4 * 1024**2, None)
    assert route.scopes == Scopes("any", frozenset({"a", "b"}))
    assert route.methods is None and route.issuers is None and route.audience is None
    assert (route.auth, route.path_params, route.client_cert) == ("required", "refuse", False)
    assert route.allow_body_on_get is False


def test_a_route_that_sets_everything_keeps_its_own() -> None:
    route = _route("write")
    given = LOADED.routes[1]
    assert route.monitor is False
    assert route.max_body_size == 10
    assert route.rate_limit == Bucket(Rate(1, timedelta(seconds=1)), 2, "ip")
    assert route.cors == _route("rest").cors
    assert route.websocket == WebSocket(False, 4 * 1024**2, None)
    assert route.scopes == Scopes("all", frozenset({"orders:write"}))
    assert (route.methods, route.issuers, route.audience) == (
        frozenset({"PUT"}),
        (AUTH,),
        "orders-write",
    )
    assert (route.path_params, route.allow_body_on_get) == ("allow", True)
    assert route.line == given.line
    needs_cert = dataclasses.replace(given, client_cert="required")
    assert adapter.route(needs_cert, LOADED).client_cert is True


def test_false_turns_a_default_off() -> None:
    route = _route("health")
    assert route.auth == "none"
    assert route.rate_limit is None and route.cors is None and route.websocket is None


def test_rules_and_policy_decide_the_same_on_records_as_on_the_settings() -> None:
    from_records = rules.compile_rules(adapter.routes(LOADED), adapter.issuers(LOADED))
    from_settings = rules.compile_rules(LOADED.routes, LOADED.issuers)
    who = Principal(
        issuer=AUTH,
        subject="user-1",
        client_id="webapp",
        scopes=frozenset({"orders:write", "b"}),
        audiences=("orders-api",),
        expires_at=2_000_000_000.0,
        claims={},
    )
    for record_rule, settings_rule in zip(from_records.rules, from_settings.rules, strict=True):
        assert record_rule.audiences_by_issuer == settings_rule.audiences_by_issuer
        assert (record_rule.pattern, record_rule.methods) == (
            settings_rule.pattern,
            settings_rule.methods,
        )
        assert (record_rule.public, record_rule.path_params) == (
            settings_rule.public,
            settings_rule.path_params,
        )
        assert policy.decide(record_rule, who) == policy.decide(settings_rule, who)
    decided = [policy.decide(rule, who) for rule in from_records.rules]
    assert decided[1] == policy.Deny(
        401, "invalid_token", "the token is not meant for this API (audience)"
    )
    assert decided[2] == policy.Allow()


def test_dpop_and_public_url_reach_the_route_records() -> None:
    text = CONFIG.replace(
        "    allow_body_on_get: true\n",
        '    allow_body_on_get: true\n    dpop: required\n    public_url: "https://pay.example.com"\n',
    )
    loaded = settings.load_text(text + 'public_url: "https://api.example.com"\n', "a.yaml", {})
    write, rest = adapter.route(loaded.routes[1], loaded), adapter.route(loaded.routes[2], loaded)
    assert (write.dpop, write.dpop_required, write.public_url) == (
        "required",
        True,
        "https://pay.example.com",
    )
    assert (rest.dpop, rest.dpop_required, rest.public_url) == (
        "allowed",
        False,
        "https://api.example.com",
    )
