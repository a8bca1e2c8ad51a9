"""portcullis.sections: settings declared once, read from YAML with FILE:LINE problems,
described as JSON Schema and as a Markdown reference."""

from __future__ import annotations

import ipaddress
import json
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, NewType

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from portcullis import sections, yamlconf
from portcullis.sections import Check, section, setting
from portcullis.yamlconf import ConfigError, Rate
from tests.hypothesis_profiles import examples

from . import schema_subset
from .sections_sample import (
    Address,
    IdentityHeaders,
    Introspection,
    Issuer,
    Jwks,
    LimitRule,
    Mode,
    RateLimits,
    Route,
    ScopeRule,
    Settings,
    Upstream,
)

FILE = "gw.yaml"
ENV = {"API_PORT": "8081", "GATEWAY_SECRET": "s3cret-from-env", "WORKERS": "2"}

VALID = """\
listen: "0.0.0.0:8080"
admin_listen: "127.0.0.1:9901"
upstream:
  url: "http://127.0.0.1:${API_PORT}/"
  connect_timeout: 250ms
  max_connections: 64
  path_case: insensitive
issuers:
  - issuer: "https://auth.example.com"
    audiences: [orders-api, billing-api]
    algorithms: [ES256, EdDSA]
    leeway: 1m
  - issuer: "https://opaque.example.com"
    audiences: [internal]
    mode: auto
    introspection:
      client_id: gateway
      client_secret: "${GATEWAY_SECRET}"
      cache_ttl: 5s
jwks: {min_ttl: 1m, max_ttl: 1h}
identity_headers:
  subject: X-User
  claims: {X-Auth-Email: email, X-Tenant: tenant}
rate_limits:
  backend: "redis://127.0.0.1:6379/0"
  default: {rate: 100/s, burst: 200, key: client_id}
workers: ${WORKERS:-1}
buffer_size: 128KiB
log_level: debug
trusted_proxies: [10.0.0.0/8, "::1"]
routes:
  - {name: health, path: /healthz, auth: none, rate_limit: false}
  - name: orders-read
    path: "/orders/**"
    methods: [GET, HEAD]
    scopes: {any: ["orders:read"]}
  - name: orders-write
    path: "/orders/{id}"
    methods: [PUT]
    issuers: ["https://auth.example.com"]
    scopes: {all: ["orders:write"]}
    max_body_size: 1KiB
    rate_limit: {rate: 3/10s, key: subject}
"""


def line_of(text: str, marker: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if marker in line)


def load(text: str, env: Mapping[str, str] | None = None) -> Settings:
    return sections.load_text(Settings, text, FILE, ENV if env is None else env)


def problems(text: str, env: Mapping[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(text, env)
    return [str(p) for p in caught.value.problems]


def config(routes: str = "  - {name: rest, path: /**}\n", extra: str = "") -> str:
    """A minimal valid file; `routes` are YAML list items, `extra` top-level keys."""
    return (
        'upstream: {url: "http://127.0.0.1:8081"}\n'
        'issuers:\n  - {issuer: "https://auth.example.com", audiences: [api]}\n'
        f"{extra}routes:\n{routes}"
    )


# ---------------------------------------------------------------------------- valid files


def test_a_full_file_loads_into_the_declared_dataclasses() -> None:
    got = load(VALID)
    assert got.file == FILE
    assert got.listen == Address("0.0.0.0", 8080)
    assert got.admin_listen == Address("127.0.0.1", 9901)
    assert got.upstream == Upstream(
        url="http://127.0.0.1:8081",
        connect_timeout=timedelta(milliseconds=250),
        max_connections=64,
        path_case="insensitive",
    )
    assert got.issuers == (
        Issuer(
            issuer="https://auth.example.com",
            audiences=("orders-api", "billing-api"),
            algorithms=("ES256", "EdDSA"),
            leeway=timedelta(minutes=1),
            line=line_of(VALID, "https://auth.example.com"),
        ),
        Issuer(
            issuer="https://opaque.example.com",
            audiences=("internal",),
            mode=Mode.AUTO,
            introspection=Introspection(
                client_id="gateway",
                client_secret="s3cret-from-env",
                cache_ttl=timedelta(seconds=5),
            ),
            line=line_of(VALID, "https://opaque.example.com"),
        ),
    )
    assert got.jwks == Jwks(min_ttl=timedelta(minutes=1), max_ttl=timedelta(hours=1))
    assert got.identity_headers == IdentityHeaders(
        subject="X-User", claims={"X-Auth-Email": "email", "X-Tenant": "tenant"}
    )
    assert got.rate_limits == RateLimits(
        backend="redis://127.0.0.1:6379/0",
        default=LimitRule(rate=Rate(100, timedelta(seconds=1)), burst=200, key="client_id"),
    )
    assert got.workers == 2  # ${WORKERS:-1}, an integer once expanded
    assert got.buffer_size == 128 * 1024
    assert got.log_level == "debug"
    assert got.trusted_proxies == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("::1"),
    )
    health, read, write = got.routes
    assert health == Route(
        name="health", path="/healthz", auth="none", rate_limit=False, line=line_of(VALID, "health")
    )
    assert read.methods == frozenset({"GET", "HEAD"})
    assert read.scopes == ScopeRule(any_of=("orders:read",))
    assert read.rate_limit is None
    assert write.scopes == ScopeRule(all_of=("orders:write",))
    assert write.issuers == ("https://auth.example.com",)
    assert write.max_body_size == 1024
    assert write.rate_limit == LimitRule(rate=Rate(3, timedelta(seconds=10)), key="subject")


def test_absent_keys_and_null_values_take_the_declared_defaults() -> None:
    got = load(config(extra="workers:\njwks: {min_ttl: ~}\nrate_limits:\n"))
    assert got.workers == 1
    assert got.jwks == Jwks()
    assert got.rate_limits == RateLimits()
    assert got.listen == Address("0.0.0.0", 8080)
    assert got.identity_headers == IdentityHeaders()
    assert got.trusted_proxies == ()
    assert got.upstream.connect_timeout == timedelta(seconds=2)
    assert got.issuers[0].algorithms == ("RS256", "ES256")
    assert got.routes[0].methods is None
    assert got.routes[0].scopes is None


def test_load_file_reads_the_file_and_names_it_in_the_settings(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(config(), encoding="utf-8")
    assert sections.load_file(Settings, str(path), {}).file == str(path)
    path.write_text(config(extra="workres: 2\n"), encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        sections.load_file(Settings, str(path), {})
    assert str(caught.value).startswith(f"{path}:4: config: unknown key 'workres'")


def test_secret_values_stay_out_of_repr() -> None:
    got = load(VALID)
    assert "s3cret-from-env" not in repr(got)
    assert "client_id='gateway'" in repr(got)


# ---------------------------------------------------------------------------- unknown keys


def test_unknown_keys_are_reported_at_every_level_with_the_key_meant() -> None:
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
        routes:
          - name: r
            path: /**
            scopes: {any: [a], none: [b]}
            method: [GET]
        """
    )
    found = problems(text)
    assert [(p.split(":")[1], p.split(": ", 1)[1].split(";")[0]) for p in found] == [
        ("1", "config: unknown key 'listn'"),
        ("4", "upstream: unknown key 'conect_timeout'"),
        ("8", "issuers[0]: unknown key 'audience'"),
        ("9", "jwks: unknown key 'min_tl'"),
        ("13", "route 'r'.scopes: unknown key 'none'"),
        ("14", "route 'r': unknown key 'method'"),
    ]
    meant = [re.search(r"did you mean '(\w+)'\?$", p) for p in found]
    assert [m.group(1) if m else None for m in meant] == [
        "listen",
        "connect_timeout",
        "audiences",
        "min_ttl",
        None,  # 'none' is not near 'any' or 'all'
        "methods",
    ]


def test_unknown_key_message_lists_the_known_keys_by_their_yaml_names() -> None:
    found = problems(config(routes="  - {name: r, path: /**, scope: {any: [a]}}\n"))
    assert found == [
        f"{FILE}:5: route 'r': unknown key 'scope'; known keys: auth, issuers, max_body_size, "
        "methods, name, path, rate_limit, scopes; did you mean 'scopes'?"
    ]
    found = problems(config(routes="  - {name: r, path: /**, scopes: {one: [a]}}\n"))
    assert found == [
        f"{FILE}:5: route 'r'.scopes: unknown key 'one'; known keys: all, any",
        f"{FILE}:5: route 'r'.scopes: give exactly one of any or all",
    ]


def test_a_guess_is_offered_only_for_a_near_miss() -> None:
    found = problems(config(extra="colour: red\nLog_Level: info\nwrkers: 2\n"))
    assert [p.partition("; did you mean ")[2] for p in found] == ["", "'log_level'?", "'workers'?"]


# ---------------------------------------------------------------------------- bad values


def test_values_of_the_wrong_type_are_reported_on_their_lines() -> None:
    text = config(
        extra=textwrap.dedent(
            """\
            workers: many
            buffer_size: lots
            jwks: {min_ttl: 10x}
            listen: 8080
            trusted_proxies: 10.0.0.0/8
            identity_headers: [X-User]
            rate_limits: {default: {rate: fast}}
            """
        )
    )
    assert problems(text) == [
        f"{FILE}:4: config.workers: expected an integer, got str 'many'",
        f"{FILE}:5: config.buffer_size: 'lots' is not a size "
        "(write it like 8KiB, 10MiB or 1048576)",
        f"{FILE}:6: jwks.min_ttl: '10x' is not a duration "
        "(write it like 30s, 5m, 250ms, 2h or 14d)",
        f"{FILE}:7: config.listen: expected a string, got int 8080",
        f"{FILE}:8: config.trusted_proxies must be a list, got str '10.0.0.0/8'",
        f"{FILE}:9: identity_headers must be a mapping, got a list",
        f"{FILE}:10: rate_limits.default.rate: 'fast' is not a rate "
        "(write it like 100/s, 10/m or 3/10s)",
    ]


def test_bad_list_items_are_reported_each_on_its_own_line() -> None:
    text = config(
        extra="trusted_proxies:\n  - 10.0.0.0/8\n  - not-a-network\n",
        routes="  - name: r\n    path: /**\n    methods:\n      - GET\n      - get\n",
    )
    assert problems(text) == [
        f"{FILE}:6: config.trusted_proxies[1]: 'not-a-network' is not an IP address or network "
        "(10.0.0.0/8)",
        f"{FILE}:12: route 'r'.methods[1]: 'get' is not an HTTP method in upper case",
    ]


def test_values_outside_their_bounds_are_refused() -> None:
    text = config(
        extra="workers: 0\n",
        routes="  - {name: r, path: /**, rate_limit: {rate: 1/s, burst: 0}}\n",
    ).replace('8081"}', '8081", connect_timeout: 0s, max_connections: 100001}')
    assert problems(text) == [
        f"{FILE}:1: upstream.connect_timeout: must be more than 0s",
        f"{FILE}:1: upstream.max_connections: must be at most 100000",
        f"{FILE}:4: config.workers: must be at least 1",
        f"{FILE}:6: route 'r'.rate_limit.burst: must be at least 1",
    ]


def test_a_value_outside_an_enumeration_names_the_values_allowed() -> None:
    text = config(
        extra="log_level: loud\n",
        routes="  - {name: r, path: /**, auth: maybe, rate_limit: true}\n",
    ).replace("audiences: [api]", "audiences: [api], mode: jws, algorithms: [ES256, HS256]")
    assert problems(text) == [
        f"{FILE}:3: issuers[0].algorithms[1]: 'HS256' is not one of RS256, ES256, EdDSA",
        f"{FILE}:3: issuers[0].mode: 'jws' is not one of jwt, introspection, auto",
        f"{FILE}:4: config.log_level: 'loud' is not one of debug, info, warning, error",
        f"{FILE}:6: route 'r'.auth: 'maybe' is not one of required, none",
        f"{FILE}:6: route 'r'.rate_limit must be a mapping, got bool True",
    ]


def test_a_shorter_list_than_declared_is_refused() -> None:
    text = config(routes="  - {name: r, path: /**, methods: []}\n").replace(
        "audiences: [api]", "audiences: []"
    )
    assert problems(text) == [
        f"{FILE}:3: issuers[0].audiences: list at least one",
        f"{FILE}:5: route 'r'.methods: list at least one",
    ]


def test_keys_of_a_mapping_are_checked_by_their_parser() -> None:
    text = config(extra='identity_headers:\n  claims:\n    "X User": email\n    X-Ok: ""\n')
    assert problems(text) == [
        f"{FILE}:6: identity_headers.claims: 'X User' is not a valid header name",
        f"{FILE}:7: identity_headers.claims.X-Ok: must not be empty",
    ]


def test_a_secret_is_never_shown_in_a_message() -> None:
    introspection = (
        "    mode: introspection\n    introspection: {client_id: gw, client_secret: 9876543}\n"
    )
    text = (
        'upstream: {url: "http://127.0.0.1:8081"}\n'
        "issuers:\n"
        '  - issuer: "https://auth.example.com"\n'
        "    audiences: [api]\n" + introspection + "routes:\n  - {name: r, path: /**}\n"
    )
    found = problems(text)
    assert found == [
        f"{FILE}:6: issuers[0].introspection.client_secret: must be a non-empty string "
        "(quote it; the value is not shown)"
    ]
    assert "9876543" not in found[0]


def test_a_secret_with_its_own_parser_is_hidden_even_if_the_parser_shows_values() -> None:
    @section
    class Vault:
        token: str = setting("A token.", parser=yamlconf.one_of("a", "b"), secret=True)

    with pytest.raises(ConfigError) as caught:
        sections.load_text(Vault, "token: hunter2\n", FILE, {})
    assert str(caught.value) == f"{FILE}:1: config.token: is not valid (the value is not shown)"


# ---------------------------------------------------------------------------- required keys


def test_missing_required_keys_are_reported_with_their_hints() -> None:
    assert problems("upstream: {connect_timeout: 1s}\n") == [
        f"{FILE}:1: upstream: url is required",
        f"{FILE}:1: config: issuers is required (a list of trusted token issuers)",
        f"{FILE}:1: config: routes is required (unmatched requests are denied)",
    ]
    assert problems("issuers: []\nroutes: []\n") == [
        f"{FILE}:1: config: upstream is required (the API requests go to)",
        f"{FILE}:1: issuers: list at least one",
    ]


def test_a_required_key_written_as_null_is_missing_on_its_own_line() -> None:
    text = config().replace('{url: "http://127.0.0.1:8081"}', "\n  url:\n")
    assert problems(text) == [f"{FILE}:2: upstream: url is required"]


def test_list_items_are_named_by_their_label_or_their_index() -> None:
    routes = "  - {path: /a}\n  - {name: b}\n  - {name: '', path: /c}\n  - just-a-string\n"
    assert problems(config(routes)) == [
        f"{FILE}:5: routes[0]: name is required",
        f"{FILE}:6: route 'b': path is required",
        f"{FILE}:7: routes[2].name: must not be empty",
        f"{FILE}:8: routes[3] must be a mapping, got str 'just-a-string'",
    ]


def test_an_item_that_cannot_be_built_is_left_out_and_the_others_still_checked() -> None:
    routes = (
        "  - {name: a, path: /a}\n"
        "  - {name: broken}\n"
        "  - {name: a, path: /b}\n"  # same name as the first: the top-level rule still runs
    )
    assert problems(config(routes)) == [
        f"{FILE}:6: route 'broken': path is required",
        f"{FILE}:7: route 'a': the name is already used on line 5",
    ]


def test_a_section_missing_a_required_value_leaves_its_parent_unbuilt() -> None:
    # Without an upstream URL the settings are not built, so their own rules (duplicate
    # route names here) are not run: only what could be checked is reported.
    routes = "  - {name: a, path: /a}\n  - {name: a, path: /b}\n"
    text = config(routes).replace('{url: "http://127.0.0.1:8081"}', "{connect_timeout: 1s}")
    assert problems(text) == [f"{FILE}:1: upstream: url is required"]


# ---------------------------------------------------------------------------- validate()


def test_a_rule_across_fields_is_reported_on_the_section_line() -> None:
    text = config(extra="jwks:\n  min_ttl: 2h\n  max_ttl: 1h\n")
    assert problems(text) == [f"{FILE}:5: jwks: min_ttl must not exceed max_ttl"]


def test_a_rule_can_name_the_key_it_is_about_by_its_field_or_its_renamed_key() -> None:
    routes = "  - {name: r, path: /**, auth: none, scopes: {any: [a]}}\n"
    assert problems(config(routes)) == [
        f"{FILE}:5: route 'r'.scopes: means nothing with auth: none",
    ]
    assert problems(config("  - {name: r, path: /**, scopes: {}}\n")) == [
        f"{FILE}:5: route 'r'.scopes: give exactly one of any or all",
    ]


def test_a_rule_of_the_top_level_reaches_into_the_sections_it_holds() -> None:
    routes = '  - name: r\n    path: /**\n    issuers: ["https://elsewhere.example.com"]\n'
    assert problems(config(routes, extra='listen: "127.0.0.1:9901"\n')) == [
        f"{FILE}:4: admin_listen must differ from listen",
        f"{FILE}:8: route 'r'.issuers: https://elsewhere.example.com is not in the issuers list",
    ]


def test_a_refused_value_takes_its_default_so_the_other_rules_still_run() -> None:
    routes = "  - {name: a, path: /a}\n  - {name: a, path: /b}\n"
    assert problems(config(routes, extra="workers: 0\n")) == [
        f"{FILE}:4: config.workers: must be at least 1",
        f"{FILE}:7: route 'a': the name is already used on line 6",
    ]


def test_a_refused_section_takes_its_default_and_its_parent_is_still_checked() -> None:
    routes = "  - {name: a, path: /a}\n  - {name: a, path: /b}\n"
    text = config(routes, extra="jwks: 5m\nrate_limits: {default: {burst: 2}, timeout: 0s}\n")
    assert problems(text) == [
        f"{FILE}:4: jwks must be a mapping, got str '5m'",
        f"{FILE}:5: rate_limits.default: rate is required",
        f"{FILE}:5: rate_limits.timeout: must be more than 0s",
        f"{FILE}:8: route 'a': the name is already used on line 7",
    ]


def test_a_rule_can_tell_a_refused_section_from_an_absent_one() -> None:
    issuers = '  - {issuer: "https://auth.example.com", audiences: [api], mode: auto%s}\n'
    absent = config().replace(
        '  - {issuer: "https://auth.example.com", audiences: [api]}\n', issuers % ""
    )
    assert problems(absent) == [
        f"{FILE}:3: issuers[0].mode: mode auto needs an introspection section"
    ]
    refused = absent.replace("mode: auto}", "mode: auto, introspection: {client_id: gw}}")
    # The section is refused (no secret) and None stands in for it: the rule asks
    # check.has() so that the mistake is not reported a second time.
    assert problems(refused) == [f"{FILE}:3: issuers[0].introspection: client_secret is required"]


def test_within_refuses_what_was_not_read_from_the_file() -> None:
    @section
    class Odd:
        name: str = setting("A name.", default="x")

        def validate(self, check: Check) -> None:
            check.within(Jwks())

    with pytest.raises(ValueError, match="is not a section read from this file"):
        sections.load_text(Odd, "name: y\n", FILE, {})


# ---------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class _Point:
    x: int
    y: int


def test_a_declaration_the_loader_cannot_read_is_refused_naming_the_field() -> None:
    @section
    class NoParser:
        ratio: float = setting("A ratio.", default=0.5)

    with pytest.raises(TypeError, match=r"NoParser\.ratio: give parser="):
        sections.json_schema(NoParser, title="x")

    @section
    class NoSchema:
        point: _Point = setting("A point.", parser=lambda v: _Point(0, 0))

    with pytest.raises(TypeError, match=r"NoSchema\.point: give schema="):
        sections.load_text(NoSchema, "point: 1\n", FILE, {})

    @section
    class BadLabel:
        name: str = setting("A name.", label=sections.named("x", "y"))

    with pytest.raises(TypeError, match="label= is for lists of sections"):
        sections.reference(BadLabel)

    @section
    class SameKey:
        a: int = setting("A.", default=1, key="b")
        b: int = setting("B.", default=2)

    with pytest.raises(TypeError, match="two fields read the same YAML key"):
        sections.load_text(SameKey, "b: 1\n", FILE, {})


@section
class _ListInner:
    values: list[str] = setting("Should be a tuple.", default_factory=list)


@section
class _ListOuter:
    inner: _ListInner = setting("Nested.", default_factory=_ListInner)


def test_a_mistake_in_a_nested_declaration_shows_when_the_top_is_first_used() -> None:
    with pytest.raises(TypeError, match=r"_ListInner\.values: give parser="):
        sections.load_text(_ListOuter, "{}\n", FILE, {})


def test_a_section_declared_where_its_annotations_cannot_be_resolved_is_refused() -> None:
    @section
    class Local:
        name: str = setting("A name.", default="x")

    @section
    class Holder:
        local: Local = setting("Declared in a function.", default_factory=Local)

    with pytest.raises(TypeError, match=r"Holder: .*declare sections at module level"):
        sections.load_text(Holder, "{}\n", FILE, {})


# ---------------------------------------------------------------------------- JSON Schema


SCHEMA = sections.json_schema(Settings, title="Gateway", schema_id="https://example.com/gw.json")


def prop(schema: dict[str, Any], *path: str) -> dict[str, Any]:
    """The schema of a key: through `items` of lists and the section of `anyOf` [section, null]."""
    for key in path:
        if "anyOf" in schema and "properties" not in schema:
            schema = next(m for m in schema["anyOf"] if "properties" in m or "items" in m)
        schema = (
            schema["items"]["properties"][key] if "items" in schema else schema["properties"][key]
        )
    return schema


def raw_yaml(text: str) -> Any:
    """The file as an editor sees it: before the environment is read."""
    return yaml.safe_load(text)


def test_the_schema_is_draft_07_in_the_subset_the_generator_promises() -> None:
    schema_subset.check_schema(SCHEMA)
    assert json.loads(json.dumps(SCHEMA)) == SCHEMA  # plain JSON, nothing Python-only
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert SCHEMA["$id"] == "https://example.com/gw.json"
    assert SCHEMA["title"] == "Gateway"
    assert SCHEMA["description"] == "Configuration of a token-checking gateway."


def test_every_section_refuses_unknown_keys_and_names_its_required_ones() -> None:
    assert SCHEMA["additionalProperties"] is False
    assert SCHEMA["required"] == ["upstream", "issuers", "routes"]
    issuer = prop(SCHEMA, "issuers")["items"]
    assert issuer["additionalProperties"] is False
    assert issuer["required"] == ["issuer", "audiences"]
    objects = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                objects.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(SCHEMA)
    assert len(objects) == 11  # every section class, wherever it is used
    assert all(o["additionalProperties"] is False for o in objects)


def test_fields_carry_their_doc_default_and_accepted_values() -> None:
    upstream = prop(SCHEMA, "upstream")["properties"]
    assert upstream["connect_timeout"]["description"] == "Time to open a connection."
    assert upstream["connect_timeout"]["default"] == "2s"
    assert upstream["max_connections"]["default"] == 256
    assert {"type": "integer", "minimum": 1, "maximum": 100000} in upstream["max_connections"][
        "anyOf"
    ]
    assert {"enum": ["sensitive", "insensitive"]} in upstream["path_case"]["anyOf"]
    top = SCHEMA["properties"]
    assert top["listen"]["default"] == "0.0.0.0:8080"
    assert top["buffer_size"]["default"] == "64KiB"
    assert top["log_level"]["default"] == "info"
    assert "default" not in top["upstream"]  # required
    secret = prop(SCHEMA, "issuers", "introspection", "client_secret")
    assert secret["description"] == "Its secret."
    assert "default" not in secret


def test_the_sample_files_are_valid_for_the_schema() -> None:
    assert schema_subset.errors(SCHEMA, raw_yaml(VALID)) == []
    assert schema_subset.errors(SCHEMA, raw_yaml(config())) == []
    demo_like = config(
        extra="workers: ${WORKERS}\njwks:\n  min_ttl: ${TTL:-5m}\nlisten: ${LISTEN}\n"
    )
    assert schema_subset.errors(SCHEMA, raw_yaml(demo_like)) == []


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ("workres: 2\n", "/workres: not allowed"),
        ("workers: 0\n", "/workers: matches none of anyOf"),
        ("log_level: loud\n", "/log_level: matches none of anyOf"),
        ("jwks: {min_ttl: 5 minutes}\n", "/jwks: matches none of anyOf"),
        ("rate_limits: {default: {burst: 2}}\n", "/rate_limits: matches none of anyOf"),
        ("trusted_proxies: 10.0.0.0/8\n", "/trusted_proxies: matches none of anyOf"),
    ],
)
def test_files_the_loader_refuses_are_refused_by_the_schema_too(change: str, where: str) -> None:
    with pytest.raises(ConfigError):
        load(config(extra=change))
    assert where in schema_subset.errors(SCHEMA, raw_yaml(config(extra=change)))


DURATION = prop(SCHEMA, "upstream", "connect_timeout")
RATE = prop(SCHEMA, "rate_limits", "default", "rate")
SIZE = prop(SCHEMA, "buffer_size")


@pytest.mark.parametrize(
    ("schema", "parse", "good", "bad"),
    [
        (
            DURATION,
            yamlconf.duration,
            ["30s", " 10 s ", "1.5h", "250ms", 0],
            ["30", "5S", 30, "-5s"],
        ),
        (RATE, yamlconf.rate, ["100/s", "3/10s", " 2 / 1.5m "], ["100", "10/x", 100, "/s"]),
        (SIZE, yamlconf.size, ["64KiB", "512", 1024, "1.5KiB"], ["-5KiB", "10 kib", -1, "ten"]),
    ],
)
def test_duration_rate_and_size_schemas_agree_with_their_parsers(
    schema: dict[str, Any], parse: Any, good: list[Any], bad: list[Any]
) -> None:
    for value in good:
        parse(value)
        assert schema_subset.errors(schema, value) == [], value
    for value in bad:
        with pytest.raises(ValueError):
            parse(value)
        assert schema_subset.errors(schema, value) != [], value


@settings(max_examples=examples(300), deadline=None)
@given(
    st.one_of(
        st.text(max_size=12),
        st.from_regex(r"\A ?[0-9]{1,4}(\.[0-9]{1,2})? ?(ms|s|m|h|d|S|w)? ?\Z"),
        st.from_regex(r"\A[0-9]{1,4} ?/ ?([0-9]{1,3})?(ms|s|m|h|d|x)\Z"),
        st.from_regex(r"\A[0-9]{1,5}(\.[0-9])? ?(B|KiB|MiB|GiB|KB|MB|GB|k|K|M|G|kb)?\Z"),
        st.integers(-5, 10**7),
    )
)
def test_what_a_value_parser_accepts_its_schema_accepts(value: Any) -> None:
    for schema, parse in (
        (DURATION, yamlconf.duration),
        (RATE, yamlconf.rate),
        (SIZE, yamlconf.size),
    ):
        try:
            parse(value)
        except ValueError:
            continue
        assert schema_subset.errors(schema, value) == [], (value, parse.__name__)


# Values a mutated file may take, valid somewhere or nowhere: every kind the sample declares.
SCALARS = st.sampled_from(
    [
        None,
        True,
        False,
        0,
        1,
        2,
        64,
        0.5,
        -1,
        100_001,
        "",
        " ",
        "x",
        "30s",
        "0s",
        "5 minutes",
        "100/s",
        "0/s",
        "64KiB",
        "lots",
        "jwt",
        "auto",
        "none",
        "required",
        "insensitive",
        "debug",
        "loud",
        "GET",
        "get",
        "X-User",
        "X User",
        "orders:read",
        "/a",
        "/**",
        "127.0.0.1:9901",
        "0.0.0.0:8080",
        ":80",
        "https://auth.example.com",
        "ftp://x",
        "https://elsewhere.example.com",
        "10.0.0.0/8",
        "${WORKERS}",
        "${UNSET:-30s}",
        "x${API_PORT}",
        "subject",
    ]
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["rate", "any", "all", "name", "path", "min_ttl", "bogus"]),
            inner,
            max_size=3,
        )
    ),
    max_leaves=6,
)


@st.composite
def mutated_files(draw: st.DrawFn) -> tuple[str, dict[str, str]]:
    """The valid sample with a few changes, and the environment it is read with.

    A change drops a key, writes null, moves a value into an environment variable, puts
    another value in its place or adds a key: most changed files are still valid, so the
    property below is tested on many files the loader accepts, not only on refused ones.
    """
    data = raw_yaml(VALID)
    env = dict(ENV)
    for _ in range(draw(st.integers(1, 3))):
        node = data
        while True:  # walk down to some mapping or list
            children = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
            deeper = [(k, v) for k, v in children if isinstance(v, dict | list) and v]
            if not deeper or draw(st.booleans()):
                break
            node = draw(st.sampled_from(deeper))[1]
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        action = draw(st.sampled_from(["drop", "null", "variable", "variable", "replace", "add"]))
        if action == "add" or not keys:
            if isinstance(node, dict):
                node[draw(st.sampled_from(["bogus", "rate", "any", "url", "mode"]))] = draw(VALUES)
            continue
        key = draw(st.sampled_from(keys))
        if action == "drop":
            del node[key]
        elif action == "null":
            node[key] = None
        elif action == "variable" and not isinstance(node[key], dict | list):
            name = f"V{len(env)}"
            env[name] = yaml.safe_dump(node[key]).removesuffix("\n...\n").strip()
            node[key] = f"${{{name}}}"
        else:
            node[key] = draw(VALUES)
    return yaml.safe_dump(data, sort_keys=False), env


@settings(max_examples=examples(400), deadline=None)
@given(mutated_files())
def test_any_file_the_loader_accepts_the_schema_accepts(file: tuple[str, dict[str, str]]) -> None:
    text, env = file
    try:
        load(text, env)
    except ConfigError:
        return
    assert schema_subset.errors(SCHEMA, raw_yaml(text)) == []


# ---------------------------------------------------------------------------- reference


REFERENCE = sections.reference(Settings)


def test_the_reference_has_a_table_per_section_in_the_order_they_appear() -> None:
    headings = [line for line in REFERENCE.splitlines() if line.startswith("### ")]
    assert headings == [
        "### Top level",
        "### `upstream`",
        "### `issuers[]`",
        "### `issuers[].introspection`",
        "### `routes[]`",
        "### `routes[].scopes`",
        "### `routes[].rate_limit`",
        "### `jwks`",
        "### `identity_headers`",
        "### `rate_limits`",
    ]


def test_each_key_has_a_row_with_type_default_and_description() -> None:
    rows = {line.split(" | ")[0]: line for line in REFERENCE.splitlines() if line.startswith("| `")}
    assert rows["| `connect_timeout`"] == (
        "| `connect_timeout` | duration, more than 0s | `2s` | Time to open a connection. |"
    )
    assert rows["| `workers`"] == (
        "| `workers` | integer, at least 1, at most 256 | `1` | Processes sharing the port. |"
    )
    assert rows["| `log_level`"] == (
        "| `log_level` | `debug` \\| `info` \\| `warning` \\| `error` | `info` "
        "| Least severity logged. |"
    )
    assert "| `url` | URL | required | Base URL of the API. |" in REFERENCE
    assert rows["| `client_secret`"] == "| `client_secret` | secret | required | Its secret. |"
    assert rows["| `any`"] == "| `any` | list of string |  | Any one of these. |"
    assert rows["| `default`"] == (
        "| `default` | section, as `routes[].rate_limit` |  "
        "| Applied to routes without their own. |"
    )
    assert rows["| `rate_limit`"].startswith(
        "| `rate_limit` | section \\| `false`, see `routes[].rate_limit` |"
    )
    assert "The API that requests go to." in REFERENCE


@section
class _DocInner:
    documented: int = setting("Yes.", default=1)
    bare: int = setting(default=2)


@section
class _DocOuter:
    inner: _DocInner = setting(default_factory=_DocInner)
    names: tuple[str, ...] = setting("Names.", default=())


def test_keys_without_a_doc_are_found() -> None:
    assert sections.missing_docs(Settings) == []
    assert sections.missing_docs(_DocOuter) == ["inner", "inner.bare"]


def test_a_plain_dataclass_with_plain_defaults_is_a_section_too() -> None:
    @dataclass(frozen=True)
    class Plain:
        name: str
        count: int = 3
        mode: Literal["a", "b"] = "a"

    got = sections.load_text(Plain, "name: n\nmode: b\n", FILE, {})
    assert got == Plain(name="n", count=3, mode="b")
    assert sections.missing_docs(Plain) == ["name", "count", "mode"]


# ---------------------------------------------------------------------------- other shapes


JwkSet = NewType("JwkSet", dict[str, Any])


def jwk_set(value: Any) -> JwkSet:
    if not isinstance(value, dict) or not isinstance(value.get("keys"), list):
        raise ValueError("must be a JWK Set: a mapping with a keys list")
    return JwkSet(dict(value))


@section
class Socket:
    """WebSocket settings."""

    heartbeat: timedelta | None = setting("Ping interval.", default=None, more_than=timedelta(0))


@section
class Client:
    """A client, with a whole-mapping value and a section that may be switched on or off."""

    client_id: str = setting("Its id.")
    jwks: JwkSet | None = setting(
        "Its public keys.", default=None, parser=jwk_set, schema={"type": "object"}
    )
    websocket: Socket | Literal[True, False] | None = setting(
        "true: the defaults; false: off; a mapping: these.", default=None
    )
    flags: Mapping[str, bool] = setting("Switches by name.", default_factory=dict)


@section
class Clients:
    clients: tuple[Client, ...] = setting(
        "Registered clients.", default=(), label=sections.named("client", "client_id")
    )


def test_a_parser_can_take_a_whole_mapping_and_a_section_can_be_switched() -> None:
    text = textwrap.dedent(
        """\
        clients:
          - client_id: a
            jwks: {keys: []}
            websocket: true
            flags: {beta: true}
          - client_id: b
            websocket: {heartbeat: 30s}
          - {client_id: c, websocket: false}
        """
    )
    a, b, c = sections.load_text(Clients, text, FILE, {}).clients
    assert a == Client(
        client_id="a", jwks=JwkSet({"keys": []}), websocket=True, flags={"beta": True}
    )
    assert b.websocket == Socket(heartbeat=timedelta(seconds=30))
    assert c.websocket is False
    schema = sections.json_schema(Clients, title="clients")
    schema_subset.check_schema(schema)
    assert schema_subset.errors(schema, raw_yaml(text)) == []


def test_problems_in_other_shapes_name_the_item_and_key() -> None:
    text = textwrap.dedent(
        """\
        clients:
          - client_id: a
            jwks: [1]
            websocket: {heartbeat: 0s}
            flags: {beta: maybe}
          - {client_id: b, websocket: 1}
        """
    )
    with pytest.raises(ConfigError) as caught:
        sections.load_text(Clients, text, FILE, {})
    assert [str(p) for p in caught.value.problems] == [
        f"{FILE}:3: client 'a'.jwks: must be a JWK Set: a mapping with a keys list",
        f"{FILE}:4: client 'a'.websocket.heartbeat: must be more than 0s",
        f"{FILE}:5: client 'a'.flags.beta: expected true or false, got str 'maybe'",
        f"{FILE}:6: client 'b'.websocket must be a mapping, got int 1",
    ]
    rows = [line for line in sections.reference(Clients).splitlines() if line.startswith("| `")]
    assert rows[3].startswith("| `websocket` | section \\| `true` \\| `false`, see ")
    assert rows[4] == "| `flags` | mapping to boolean |  | Switches by name. |"


# ---------------------------------------------------------------------------- secrets in files,
# derived defaults, unread secrets


@sections.accepts({"type": "string", "title": "colour", "pattern": "^#[0-9a-f]{6}$"})
def _colour(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if not re.fullmatch("#[0-9a-f]{6}", text):
        raise ValueError(f"{text!r} is not a colour like #00ff00")
    return text


@section
class Account:
    """A service account."""

    name: str = setting("Its name.")
    password: str = setting("Its password.", secret=True, from_file=True)
    token: str | None = setting("An optional token.", default=None, secret=True, from_file=True)
    label: str = setting("Shown; the name when absent.", default="", derive=lambda v: v["name"])
    colour: str = setting("A colour.", default="#000000", parser=_colour)
    nickname: str | None = setting("How it is called.", default=None)


@section
class Accounts:
    accounts: tuple[Account, ...] = setting("Accounts.", label=sections.named("account", "name"))

    def validate(self, check: Check) -> None:
        for account in self.accounts:
            within = check.within(account)
            if within.has("nickname") and not within.written("nickname"):
                within.problem("give a nickname or leave the key out", key="nickname")


def load_accounts(text: str, *, secrets: bool = True, env: Mapping[str, str] | None = None) -> Any:
    return sections.load_text(Accounts, text, FILE, env or {}, secrets=secrets).accounts


def account_problems(
    text: str, *, secrets: bool = True, env: Mapping[str, str] | None = None
) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_accounts(text, secrets=secrets, env=env)
    return [str(p) for p in caught.value.problems]


def test_a_secret_may_come_from_the_file_named_by_its_file_key(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("from-the-file\n")
    (account,) = load_accounts(f"accounts:\n  - {{name: a, password_file: {secret}}}\n")
    assert account.password == "from-the-file"  # without the line break editors add
    assert account.token is None


def test_a_secret_and_its_file_key_together_are_refused_on_the_file_keys_line(
    tmp_path: Path,
) -> None:
    text = f"accounts:\n  - name: a\n    password: x\n    password_file: {tmp_path}/p\n"
    assert account_problems(text) == [
        f"{FILE}:4: account 'a': give password or password_file, not both"
    ]


def test_an_unreadable_secret_file_is_reported_with_the_reason(tmp_path: Path) -> None:
    text = f"accounts:\n  - {{name: a, password_file: {tmp_path}/missing}}\n"
    found = account_problems(text)
    assert found == [
        f"{FILE}:2: account 'a'.password_file: cannot read {tmp_path}/missing: "
        "No such file or directory"
    ]


def test_a_required_secret_names_its_file_key_when_missing() -> None:
    assert account_problems("accounts:\n  - {name: a}\n") == [
        f"{FILE}:2: account 'a': password (or password_file) is required"
    ]


def test_without_secrets_secret_files_and_missing_variables_are_withheld(tmp_path: Path) -> None:
    text = (
        f"accounts:\n  - {{name: a, password_file: {tmp_path}/missing}}\n"
        "  - {name: b, password: '${NOT_SET}', token: '${NOT_SET_EITHER}'}\n"
    )
    a, b = load_accounts(text, secrets=False)
    assert a.password is yamlconf.WITHHELD
    assert (b.password, b.token) == (yamlconf.WITHHELD, yamlconf.WITHHELD)
    # A variable missing in a value that is not a secret is still a problem.
    found = account_problems("accounts:\n  - {name: '${NOT_SET}', password: x}\n", secrets=False)
    assert found == [
        f"{FILE}:2: environment variable NOT_SET is not set (use ${{NOT_SET:-default}})"
    ]


def test_a_secret_given_but_unread_is_reported_once_and_counts_as_given() -> None:
    found = account_problems("accounts:\n  - {name: a, password: '${NOT_SET}'}\n")
    assert found == [
        f"{FILE}:2: environment variable NOT_SET is not set (use ${{NOT_SET:-default}})"
    ]


def test_a_derived_default_follows_the_other_values_unless_written() -> None:
    derived, written = load_accounts(
        "accounts:\n  - {name: a, password: x}\n  - {name: b, password: x, label: Bee}\n"
    )
    assert (derived.label, written.label) == ("a", "Bee")
    assert (
        "default"
        not in sections.json_schema(Accounts, title="a")["properties"]["accounts"]["items"][
            "properties"
        ]["label"]
    )


def test_a_parser_may_carry_the_schema_of_what_it_accepts() -> None:
    schema = sections.json_schema(Accounts, title="accounts")
    schema_subset.check_schema(schema)
    item = schema["properties"]["accounts"]["items"]["properties"]
    assert {"type": "string", "pattern": "^#[0-9a-f]{6}$"} in item["colour"]["anyOf"]
    assert item["password_file"]["description"].startswith("A file holding password")
    assert "token_file" in item
    assert account_problems("accounts:\n  - {name: a, password: x, colour: red}\n") == [
        f"{FILE}:2: account 'a'.colour: 'red' is not a colour like #00ff00"
    ]
    rows = [line for line in sections.reference(Accounts).splitlines() if line.startswith("| `")]
    assert "| `colour` | colour | `#000000` | A colour. |" in rows
    assert "| `password_file` | file path |  | A file holding `password`. |" in rows


def test_a_rule_can_read_what_was_written_rather_than_what_was_read() -> None:
    assert account_problems("accounts:\n  - {name: a, password: x, nickname: }\n") == [
        f"{FILE}:2: account 'a'.nickname: give a nickname or leave the key out"
    ]


def test_a_mapping_read_from_the_file_cannot_change_and_its_section_stays_hashable() -> None:
    headers = load(VALID).identity_headers
    assert hash(headers) == hash(load(VALID).identity_headers)
    with pytest.raises(TypeError):
        headers.claims["X-Other"] = "other"  # type: ignore[index]
