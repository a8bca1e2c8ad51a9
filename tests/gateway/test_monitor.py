"""Monitor mode, globally or per route: every decision is made and counted as in enforce
mode, with `would_deny` and the reason, but the request is forwarded; identity headers are
still set only from a token that is valid for the route.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import (
    UNBOUND_ADMIN_LISTEN,
    UNBOUND_LISTEN,
    call,
    gateway_yaml,
    header_values,
    read_json_lines,
    running_gateway,
    sample,
    scrape,
    wait_for,
)

IDENTITY = ("X-Auth-Subject", "X-Auth-Client-Id", "X-Auth-Scopes", "X-Auth-Issuer")
LEGACY = """
  - name: legacy
    path: "/legacy/**"
    mode: monitor
    scopes: {all: ["admin"]}
    rate_limit: {rate: 1/m, burst: 1, key: route}
"""


def monitor_config(issuer: str, upstream: str, log: Path, extra: str = "") -> str:
    logging = f'access_log: {{output: "{log}", flush_interval: 10ms}}\n'
    return gateway_yaml(issuer, upstream, extra_routes=LEGACY, extra=logging + extra)


def identity(seen: dict) -> dict[str, list[str]]:
    return {name: header_values(seen, name) for name in IDENTITY if header_values(seen, name)}


async def test_a_monitored_route_forwards_what_an_enforced_route_refuses(
    issuer, upstream, client, tmp_path
):
    log = tmp_path / "access.log"
    async with running_gateway(monitor_config(issuer.url, upstream.url, log)) as gateway:
        enforced = await call(client, gateway.url + "/orders/1")
        monitored = await call(client, gateway.url + "/legacy/1")
        await wait_for(lambda: len(read_json_lines(log)) >= 2, what="the access log")
        samples = await scrape(gateway.admin_url)
    assert enforced.status == 401
    assert monitored.status == 200
    assert [r["raw_path"] for r in upstream.requests] == ["/legacy/1"]
    assert identity(upstream.requests[0]) == {}
    entries = {e["path"]: e for e in read_json_lines(log)}
    assert (entries["/orders/1"]["decision"], entries["/orders/1"]["reason"]) == (
        "deny",
        "no_token",
    )
    assert (entries["/legacy/1"]["decision"], entries["/legacy/1"]["reason"]) == (
        "would_deny",
        "no_token",
    )
    assert entries["/legacy/1"]["status"] == 200
    denial = "portcullis_gateway_denials_total"
    assert sample(samples, denial, route="orders-read", decision="deny", reason="no_token") == 1
    assert sample(samples, denial, route="legacy", decision="would_deny", reason="no_token") == 1
    requests = "portcullis_gateway_requests_total"
    assert (
        sample(samples, requests, route="legacy", method="GET", status="200", decision="would_deny")
        == 1
    )


@pytest.mark.parametrize(
    ("token_kind", "reason", "with_identity"),
    [
        ("tampered", "invalid_token", False),
        ("expired", "invalid_token", False),
        ("other_audience", "invalid_token", False),
        ("lacks_scope", "insufficient_scope", True),
        ("valid", None, True),
    ],
)
async def test_identity_headers_come_only_from_a_token_valid_for_the_route(
    issuer, upstream, client, tmp_path, token_kind, reason, with_identity
):
    valid = issuer.token("ES256", scope="admin")
    tokens = {
        "tampered": valid[:-4] + ("AAAA" if not valid.endswith("AAAA") else "BBBB"),
        "expired": issuer.token("ES256", scope="admin", lifetime=-120),
        "other_audience": issuer.token("ES256", scope="admin", aud="billing-api"),
        "lacks_scope": issuer.token("ES256", scope="orders:read"),
        "valid": valid,
    }
    log = tmp_path / "access.log"
    async with running_gateway(monitor_config(issuer.url, upstream.url, log)) as gateway:
        async with client.get(
            gateway.url + "/legacy/1",
            headers={
                "Authorization": f"Bearer {tokens[token_kind]}",
                "X-Auth-Subject": "spoofed",
            },
        ) as response:
            assert response.status == 200
        await wait_for(lambda: len(read_json_lines(log)) >= 1, what="the access log")
    seen = upstream.requests[-1]
    expected_scopes = "orders:read" if token_kind == "lacks_scope" else "admin"
    if with_identity:
        assert identity(seen) == {
            "X-Auth-Subject": ["user-123"],
            "X-Auth-Client-Id": ["webapp"],
            "X-Auth-Scopes": [expected_scopes],
            "X-Auth-Issuer": [issuer.url],
        }
    else:
        assert identity(seen) == {}  # the spoofed copy is gone too
    entry = read_json_lines(log)[-1]
    assert entry["reason"] == reason
    assert entry["decision"] == ("allow" if reason is None else "would_deny")


async def test_a_rate_limit_in_monitor_mode_is_counted_but_does_not_refuse(
    issuer, upstream, client, tmp_path
):
    token = issuer.token("ES256", scope="admin")
    async with running_gateway(
        monitor_config(issuer.url, upstream.url, tmp_path / "a.log")
    ) as gateway:
        answers = [await call(client, gateway.url + "/legacy/1", token) for _ in range(3)]
        samples = await scrape(gateway.admin_url)
    assert [a.status for a in answers] == [200, 200, 200]
    assert len(upstream.requests) == 3
    # The fields still tell the client where it stands.
    assert answers[2].headers["RateLimit"] == '"legacy";r=0;t=60'
    assert (
        sample(
            samples,
            "portcullis_gateway_rate_limit_rejections_total",
            route="legacy",
            policy="legacy",
        )
        == 2
    )
    assert (
        sample(
            samples,
            "portcullis_gateway_denials_total",
            route="legacy",
            decision="would_deny",
            reason="rate_limited",
        )
        == 2
    )


async def test_global_monitor_mode_forwards_even_requests_no_route_matches(
    issuer, upstream, client, tmp_path
):
    log = tmp_path / "access.log"
    config = f"""
listen: "{UNBOUND_LISTEN}"
admin_listen: "{UNBOUND_ADMIN_LISTEN}"
upstream: {{url: "{upstream.url}"}}
issuers:
  - {{issuer: "{issuer.url}", audiences: [orders-api], algorithms: [ES256]}}
mode: monitor
access_log: {{output: "{log}", flush_interval: 10ms}}
routes:
  - {{name: orders, path: "/orders/**", scopes: {{any: ["orders:read"]}}}}
"""
    async with running_gateway(config) as gateway:
        unmatched = await call(client, gateway.url + "/nowhere")
        no_token = await call(client, gateway.url + "/orders/1")
        await wait_for(lambda: len(read_json_lines(log)) >= 2, what="the access log")
    assert (unmatched.status, no_token.status) == (200, 200)
    assert [r["raw_path"] for r in upstream.requests] == ["/nowhere", "/orders/1"]
    entries = read_json_lines(log)
    assert [(e["route"], e["decision"], e["reason"]) for e in entries] == [
        ("-", "would_deny", "no_route"),
        ("orders", "would_deny", "no_token"),
    ]


async def test_an_enforced_route_under_global_monitor_mode_still_refuses(
    issuer, upstream, client, tmp_path
):
    routes = '  - {name: strict, path: "/strict/**", mode: enforce}\n'
    config = gateway_yaml(issuer.url, upstream.url, extra_routes=routes, extra="mode: monitor")
    async with running_gateway(config) as gateway:
        strict = await call(client, gateway.url + "/strict/1")
        relaxed = await call(client, gateway.url + "/orders/1")
    assert (strict.status, relaxed.status) == (401, 200)
    assert [r["raw_path"] for r in upstream.requests] == ["/orders/1"]
