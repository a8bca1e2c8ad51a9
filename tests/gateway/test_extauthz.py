"""The decision listener (ext_authz): each front proxy's convention read from its own headers
only, the proxy mode's decisions from the same rules, the allow answer with every identity
header present, callers outside trusted_callers refused, and the mode label and field."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from gateway import extauthz
from gateway import settings as gateway_settings
from portcullis.yamlconf import ConfigError
from tests.support import (
    GatewayProcess,
    IntrospectionServer,
    call,
    challenges_of,
    gateway_yaml,
    issuer_entry,
    raw_request,
    read_json_lines,
    refused_exchange,
    reserve_port,
    running_gateway,
    sample,
    scrape,
    wait_for,
)

IDENTITY = ("X-Auth-Subject", "X-Auth-Client-Id", "X-Auth-Scopes", "X-Auth-Issuer", "X-Auth-Email")
ROUTES = """
  - {name: admin, path: "/admin/**", scopes: {all: ["admin"]}}
  - {name: limited, path: "/limited/**", rate_limit: {rate: 1/m, burst: 2, key: subject}}
  - {name: legacy, path: "/legacy/**", mode: monitor, scopes: {all: ["admin"]}}
  - {name: browser, path: "/browser/**", methods: [GET, PUT],
     cors: {allow_origins: ["https://app.example.com"], allow_methods: [GET, PUT]}}
"""


def config(issuer: str, upstream: str, trusted: str = "127.0.0.1/32", extra: str = "") -> str:
    return gateway_yaml(
        issuer,
        upstream,
        extra_routes=ROUTES,
        extra=f"""
identity_headers: {{claims: {{X-Auth-Email: email}}}}
ext_authz: {{listen: "127.0.0.1:3", trusted_callers: ["{trusted}"]}}
{extra}""",
    )


async def ask(
    client: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str] | list[tuple[str, str]],
    method: str = "GET",
) -> tuple[int, Any, bytes]:
    async with client.request(method, url, headers=headers) as resp:
        return resp.status, resp.headers, await resp.read()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def scrape_until(admin_url: str, name: str, total: float, timeout: float = 10.0) -> Any:
    """The metrics once the samples of `name` add up to `total` (every mode and label):
    a request is counted after its answer is written, so a scrape right after the answer
    may come first. After `timeout` the metrics as they are, for the test to judge."""
    deadline = time.monotonic() + timeout
    while True:
        samples = await scrape(admin_url)
        counted = sum(value for (sample_name, _), value in samples.items() if sample_name == name)
        if counted >= total or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------------- conventions


def forwarded(method: str, uri: str, **more: str) -> dict[str, str]:
    return {"X-Forwarded-Method": method, "X-Forwarded-Uri": uri, **more}


def original(method: str, uri: str, **more: str) -> dict[str, str]:
    return {"X-Original-Method": method, "X-Original-URI": uri, **more}


async def test_each_convention_describes_the_same_decision(issuer, upstream, client):
    token = issuer.token(scope="orders:read", email="a@example.com")
    async with running_gateway(config(issuer.url, upstream.url)) as gw:
        url = gw.decision_url
        answers = [
            await ask(client, url + "/forward-auth", forwarded("GET", "/orders/1") | bearer(token)),
            await ask(client, url + "/auth-request", original("GET", "/orders/1") | bearer(token)),
            await ask(
                client,
                url + "/auth-request",
                {
                    "X-Original-Method": "GET",
                    "X-Original-URL": "https://api.example.com/orders/1?x=1",
                }
                | bearer(token),
            ),
            await ask(client, url + "/ext-authz/orders/1?x=1", bearer(token)),
        ]
        refused = [
            await ask(client, url + "/forward-auth", forwarded("PUT", "/orders/1") | bearer(token)),
            await ask(client, url + "/auth-request", original("PUT", "/orders/1") | bearer(token)),
            await ask(client, url + "/ext-authz/orders/1", bearer(token), method="PUT"),
        ]
    for status, headers, body in answers:
        assert (status, body) == (200, b"")
        assert headers["X-Auth-Subject"] == "user-123"
        assert headers["X-Auth-Scopes"] == "orders:read"
        assert headers["X-Auth-Client-Id"] == "webapp"
        assert headers["X-Auth-Issuer"] == issuer.url
        assert headers["X-Auth-Email"] == "a@example.com"
    for status, headers, _ in refused:
        assert status == 403
        assert 'error="insufficient_scope"' in headers["WWW-Authenticate"]
    assert upstream.requests == []  # nothing is forwarded in this mode


async def test_every_identity_header_is_present_and_empty_without_a_value(issuer, upstream, client):
    token = issuer.token(drop=("client_id",), scope="orders:read")
    async with running_gateway(config(issuer.url, upstream.url)) as gw:
        url = gw.decision_url + "/forward-auth"
        with_token = await ask(client, url, forwarded("GET", "/orders/1") | bearer(token))
        public = await ask(client, url, forwarded("GET", "/public/x"))
    status, headers, _ = with_token
    assert status == 200
    assert headers["X-Auth-Subject"] == "user-123"
    assert (headers["X-Auth-Client-Id"], headers["X-Auth-Email"]) == ("", "")
    status, headers, _ = public
    assert status == 200
    assert {name: headers.getall(name) for name in IDENTITY} == {name: [""] for name in IDENTITY}


async def test_each_endpoint_reads_only_its_own_headers(issuer, upstream, client):
    token = issuer.token(scope="orders:read")
    async with running_gateway(config(issuer.url, upstream.url)) as gw:
        url = gw.decision_url
        # A client's copy of another convention's header is not read: here it is missing.
        crossed = [
            await ask(client, url + "/forward-auth", original("GET", "/public/x")),
            await ask(client, url + "/auth-request", forwarded("GET", "/public/x")),
        ]
        # And where both are present, the endpoint's own decides (the protected route).
        mixed = await ask(
            client,
            url + "/auth-request",
            original("GET", "/orders/1") | forwarded("GET", "/public/x"),
        )
        envoy = await ask(
            client, url + "/ext-authz/orders/1", forwarded("GET", "/public/x") | bearer("x")
        )
    assert [c[0] for c in crossed] == [400, 400]
    assert mixed[0] == 401
    assert envoy[0] == 401
    del token


@pytest.mark.parametrize(
    ("endpoint", "headers", "problem"),
    [
        ("/forward-auth", {"X-Forwarded-Uri": "/public/x"}, "X-Forwarded-Method is missing"),
        ("/forward-auth", {"X-Forwarded-Method": "GET"}, "X-Forwarded-Uri is missing"),
        ("/forward-auth", forwarded("get me", "/public/x"), "not an HTTP method"),
        ("/forward-auth", forwarded("GET", "public/x"), "not a path"),
        ("/forward-auth", forwarded("GET", "/public/x", **{"X-Forwarded-Proto": "gopher"}), "http"),
        ("/forward-auth", forwarded("GET", "/public/x", **{"X-Forwarded-Host": "a b"}), "host"),
        ("/auth-request", {"X-Original-URI": "/public/x"}, "X-Original-Method is missing"),
        ("/auth-request", {"X-Original-Method": "GET"}, "X-Original-URI or X-Original-URL"),
        (
            "/auth-request",
            {"X-Original-Method": "GET", "X-Original-URL": "/public/x"},
            "absolute",
        ),
        (
            "/auth-request",
            original("GET", "/public/x", **{"X-Original-URL": "http://h/orders/1"}),
            "different targets",
        ),
    ],
)
async def test_a_missing_or_malformed_description_is_refused(
    issuer, upstream, client, endpoint, headers, problem
):
    async with running_gateway(config(issuer.url, upstream.url)) as gw:
        status, _, body = await ask(client, gw.decision_url + endpoint, headers)
    assert status == 400
    assert problem in body.decode()


async def test_a_question_the_parser_refuses_is_answered_unquoted_in_http_1_1(
    issuer, upstream, caplog
):
    """As on the public listener: 414 for a request line over max_line_size, 431 for a
    header field over max_field_size (equal by default, still told apart), 400 for a
    broken field; the resource error body, never the refused bytes, in the answer or the
    log; the connection closed."""
    async with running_gateway(config(issuer.url, upstream.url)) as gw:
        for request, status, code in (
            (raw_request("GET", "/auth-request?" + "q" * 8192), 414, "uri_too_long"),
            (
                raw_request("GET", "/auth-request", [("X-Big", "v" * 9000)]),
                431,
                "header_fields_too_large",
            ),
            (
                b"GET /auth-request HTTP/1.1\r\nHost: a\r\n"
                b"Authorization: Bearer refused-token-value\x01\r\n\r\n",
                400,
                "bad_request",
            ),
        ):
            answer = await refused_exchange(gw.decision_url, request)
            assert (answer.version, answer.status) == ("HTTP/1.1", status)
            assert answer.json()["error"]["code"] == code
            assert b"qqqq" not in answer.body and b"vvvv" not in answer.body
    assert "refused-token-value" not in caplog.text and "vvvv" not in caplog.text
    assert not [r for r in caplog.records if r.name == "aiohttp.server"]


async def test_a_describing_header_given_twice_is_refused(issuer, upstream, client):
    async with running_gateway(config(issuer.url, upstream.url)) as gw:
        status, _, body = await ask(
            client,
            gw.decision_url + "/forward-auth",
            [
                ("X-Forwarded-Method", "GET"),
                ("X-Forwarded-Uri", "/public/x"),
                ("X-Forwarded-Uri", "/orders/1"),
            ],
        )
        same = await ask(
            client,
            gw.decision_url + "/auth-request",
            original("GET", "/public/x?a=1", **{"X-Original-URL": "https://h:8/public/x?a=1"}),
        )
        other = await ask(client, gw.decision_url + "/elsewhere", forwarded("GET", "/public/x"))
    assert status == 400 and b"more than once" in body
    assert same[0] == 200  # both naming the same target is fine
    assert other[0] == 404


# ---------------------------------------------------------------------------- same rules


@pytest.mark.parametrize(
    "target",
    [
        "/public/..%2fadmin/x",
        "/public/%2e%2e/admin/x",
        "/public/../admin/x",
        "/admin;x=1/x",
        "/public/x%2Fy",
        "/public/x#frag",
    ],
)
async def test_path_tricks_are_refused_as_the_proxy_refuses_them(issuer, upstream, client, target):
    async with running_gateway(config(issuer.url, upstream.url)) as gw:
        decided = await ask(client, gw.decision_url + "/forward-auth", forwarded("GET", target))
        proxied = None
        if "#" not in target:  # a client cannot send a fragment through the proxy
            async with client.get(URL(gw.url + target, encoded=True)) as resp:
                proxied = resp.status
    assert decided[0] != 200
    assert proxied in (None, decided[0])
    assert upstream.requests == []


async def test_a_rate_limit_is_counted_once_per_decision(issuer, upstream, client):
    token = issuer.token()
    async with running_gateway(config(issuer.url, upstream.url)) as gw:
        url = gw.decision_url + "/auth-request"
        statuses = []
        for _ in range(3):
            status, headers, _ = await ask(
                client, url, original("GET", "/limited/x") | bearer(token)
            )
            statuses.append(status)
        samples = await scrape(gw.admin_url)
    assert statuses == [200, 200, 429]
    assert int(headers["Retry-After"]) > 0
    assert (
        sample(
            samples,
            "portcullis_gateway_rate_limit_rejections_total",
            route="limited",
            policy="limited",
        )
        == 1
    )


async def test_monitor_mode_allows_without_identity(issuer, upstream, client):
    token = issuer.token(scope="orders:read")
    async with running_gateway(config(issuer.url, upstream.url)) as gw:
        status, headers, _ = await ask(
            client, gw.decision_url + "/ext-authz/legacy/1", bearer(token)
        )
        samples = await scrape_until(gw.admin_url, "portcullis_gateway_denials_total", 1)
    assert status == 200
    # As in proxy mode: the token is valid for the API, only its scope is missing.
    assert headers["X-Auth-Subject"] == "user-123"
    assert (
        sample(
            samples,
            "portcullis_gateway_denials_total",
            mode="ext_authz",
            route="legacy",
            decision="would_deny",
            reason="insufficient_scope",
        )
        == 1
    )


async def test_a_preflight_is_let_through_when_the_route_allows_it(issuer, upstream, client):
    async with running_gateway(config(issuer.url, upstream.url)) as gw:
        url = gw.decision_url + "/ext-authz/browser/1"
        preflight = {"Origin": "https://app.example.com", "Access-Control-Request-Method": "PUT"}
        allowed = await ask(client, url, preflight, method="OPTIONS")
        other = preflight | {"Origin": "https://evil.example"}
        refused = await ask(client, url, other, method="OPTIONS")
    assert allowed[0] == 200
    assert allowed[1]["X-Auth-Subject"] == ""
    assert refused[0] == 403


async def test_no_token_gets_the_challenge_and_the_error_body(issuer, upstream, client):
    async with running_gateway(config(issuer.url, upstream.url)) as gw:
        status, headers, body = await ask(
            client, gw.decision_url + "/forward-auth", forwarded("GET", "/orders/1")
        )
        unmatched_status = (await ask(client, gw.decision_url + "/ext-authz/nowhere/../..%2f", {}))[
            0
        ]
    assert status == 401
    assert challenges_of(headers)[0] == 'Bearer realm="portcullis"'
    assert b'"code":"unauthorized"' in body.replace(b" ", b"")
    assert unmatched_status == 400


# ---------------------------------------------------------------------------- trust, records


async def test_callers_outside_trusted_callers_are_refused_before_anything_is_read(
    issuer, upstream, client
):
    token = issuer.token(scope="orders:read")
    async with running_gateway(config(issuer.url, upstream.url, trusted="10.0.0.0/8")) as gw:
        status, headers, body = await ask(
            client, gw.decision_url + "/forward-auth", forwarded("GET", "/orders/1") | bearer(token)
        )
        samples = await scrape(gw.admin_url)
    assert status == 403
    assert "X-Auth-Subject" not in headers
    assert b"untrusted_caller" in body
    assert gw.gateway.token_cache.misses == 0  # the token was never looked at
    assert (
        sample(
            samples,
            "portcullis_gateway_denials_total",
            mode="ext_authz",
            route="-",
            decision="deny",
            reason="untrusted_caller",
        )
        == 1
    )


async def test_metrics_and_the_access_log_tell_the_modes_apart(
    issuer, upstream, client, tmp_path: Path
):
    log = tmp_path / "access.log"
    token = issuer.token(scope="orders:read")
    logging = f'access_log: {{output: "{log}", flush_interval: 10ms}}'
    async with running_gateway(config(issuer.url, upstream.url, extra=logging)) as gw:
        await ask(client, gw.decision_url + "/forward-auth", forwarded("GET", "/orders/1?q=1"))
        await call(client, gw.url + "/orders/1", token)
        samples = await scrape_until(gw.admin_url, "portcullis_gateway_requests_total", 2)
        await wait_for(lambda: len(read_json_lines(log)) >= 2, 10, "two access log lines")
    decided, proxied = read_json_lines(log)
    assert (decided["mode"], decided["method"], decided["path"]) == (
        "ext_authz",
        "GET",
        "/orders/1",
    )
    assert (decided["status"], decided["reason"]) == (401, "no_token")
    assert (proxied["mode"], proxied["status"]) == ("proxy", 200)
    labels = {"route": "orders-read", "method": "GET"}
    name = "portcullis_gateway_requests_total"
    assert sample(samples, name, mode="ext_authz", status="401", decision="deny", **labels) == 1
    assert sample(samples, name, mode="proxy", status="200", decision="allow", **labels) == 1


async def test_a_reload_changes_who_may_ask(issuer, upstream, client, tmp_path: Path):
    file = tmp_path / "gateway.yaml"
    async with running_gateway(
        config(issuer.url, upstream.url, trusted="10.0.0.0/8"), config_file=file
    ) as gw:
        url = gw.decision_url + "/forward-auth"
        before = await ask(client, url, forwarded("GET", "/public/x"))
        file.write_text(config(issuer.url, upstream.url))
        assert await gw.gateway.reload()
        after = await ask(client, url, forwarded("GET", "/public/x"))
    assert (before[0], after[0]) == (403, 200)


# ---------------------------------------------------------------------------- settings


def test_the_decision_listener_needs_its_own_address_and_callers(issuer_url="https://i.example"):
    text = gateway_yaml(issuer_url, "http://127.0.0.1:9").replace(
        'admin_listen: "127.0.0.1:2"',
        'admin_listen: "127.0.0.1:2"\next_authz: {listen: "127.0.0.1:2", trusted_callers: []}',
    )
    with pytest.raises(ConfigError) as caught:
        gateway_settings.load_text(text, "g.yaml")
    problems = "\n".join(str(p) for p in caught.value.problems)
    assert "ext_authz.listen: must differ from admin_listen" in problems
    assert "trusted_callers" in problems


def test_descriptions_are_read_as_written():
    from multidict import CIMultiDict, CIMultiDictProxy

    headers = CIMultiDictProxy(
        CIMultiDict({"X-Original-Method": "GET", "X-Original-URL": "https://h.example/a/..%2Fb?c"})
    )
    assert extauthz.auth_request(headers) == extauthz.Original(
        "GET", "/a/..%2Fb?c", "https", "h.example"
    )
    # Envoy's question is the original request itself, its body included when it passes one.
    assert extauthz.ext_authz("POST", "/ext-authz/x%2e%2e?y") == extauthz.Original(
        "POST", "/x%2e%2e?y", with_body=True
    )
    assert not extauthz.auth_request(headers).with_body


# ---------------------------------------------------------------------------- the process


async def test_run_serves_the_decision_listener_beside_the_public_one(
    issuer, upstream, client, tmp_path: Path
):
    port = reserve_port()
    text = gateway_yaml(
        issuer.url,
        upstream.url,
        extra=f'ext_authz: {{listen: "127.0.0.1:{port}", trusted_callers: ["127.0.0.1/32"]}}',
    )
    process = GatewayProcess(text, tmp_path)
    try:
        await process.wait_ready()
        token = issuer.token(scope="orders:read")
        decided = await ask(
            client,
            f"http://127.0.0.1:{port}/auth-request",
            original("GET", "/orders/1") | bearer(token),
        )
        proxied = await call(client, process.url + "/orders/1", token)
    finally:
        await process.stop()
    assert decided[0] == 200 and decided[1]["X-Auth-Subject"] == "user-123"
    assert "Server" not in decided[1]  # the gateway's own answer names no software
    assert proxied.status == 200


async def test_opaque_tokens_are_introspected_for_a_decision_as_for_the_proxy(upstream, client):
    server = await IntrospectionServer().start()
    try:
        server.active("opaque-1", sub="alice", scope="orders:read")
        section = '{client_id: gateway, client_secret: "gateway-secret"}'
        entry = issuer_entry(server.url, mode="introspection", introspection=section)
        text = gateway_yaml(
            server.url,
            upstream.url,
            issuers=[entry],
            extra='ext_authz: {listen: "127.0.0.1:3", trusted_callers: ["127.0.0.1/32"]}',
        )
        async with running_gateway(text) as gw:
            url = gw.decision_url + "/ext-authz/orders/1"
            active = await ask(client, url, bearer("opaque-1"))
            unknown = await ask(client, url, bearer("opaque-2"))
            again = await ask(client, url, bearer("opaque-1"))
    finally:
        await server.stop()
    assert (active[0], active[1]["X-Auth-Subject"]) == (200, "alice")
    assert unknown[0] == 401 and 'error="invalid_token"' in unknown[1]["WWW-Authenticate"]
    assert again[0] == 200
    asked = [call["form"]["token"] for call in server.calls]
    assert asked == ["opaque-1", "opaque-2"]  # the second decision came from the cache
