"""What operators see: /metrics on the admin port (parsed with prometheus-client's own parser),
the JSON-lines access log, W3C traceparent towards the upstream, and no token or secret in
any log line.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re

from tests.support import (
    GatewayProcess,
    IntrospectionServer,
    call,
    gateway_yaml,
    header_values,
    issuer_entry,
    raw_exchange,
    raw_request,
    read_json_lines,
    running_gateway,
    sample,
    scrape,
    wait_for,
)

ACCESS_FIELDS = {
    "time",
    "request_id",
    "trace_id",
    "client",
    "mode",
    "method",
    "path",
    "route",
    "status",
    "decision",
    "reason",
    "subject",
    "client_id",
    "upstream_ms",
    "total_ms",
}
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


# ---------------------------------------------------------------------------- /metrics


async def test_metrics_count_requests_decisions_latencies_keys_and_rate_limits(
    issuer, upstream, client
):
    routes = '  - {name: tight, path: "/tight/**", rate_limit: {rate: 1/m, burst: 1, key: route}}\n'
    token = issuer.token("ES256")
    async with running_gateway(
        gateway_yaml(issuer.url, upstream.url, extra_routes=routes)
    ) as gateway:
        for _ in range(2):
            assert (await call(client, gateway.url + "/orders/1", token)).status == 200
        assert (await call(client, gateway.url + "/orders/1")).status == 401
        assert (await call(client, gateway.url + "/orders/1", "x.y.z")).status == 401
        assert (await call(client, gateway.url + "/tight/1", token)).status == 200
        assert (await call(client, gateway.url + "/tight/1", token)).status == 429
        samples = await scrape(gateway.admin_url)
    requests = "portcullis_gateway_requests_total"
    assert (
        sample(samples, requests, route="orders-read", method="GET", status="200", decision="allow")
        == 2
    )
    assert (
        sample(samples, requests, route="orders-read", method="GET", status="401", decision="deny")
        == 2
    )
    assert (
        sample(samples, requests, route="tight", method="GET", status="429", decision="deny") == 1
    )
    denials = "portcullis_gateway_denials_total"
    assert sample(samples, denials, route="orders-read", decision="deny", reason="no_token") == 1
    assert (
        sample(samples, denials, route="orders-read", decision="deny", reason="invalid_token") == 1
    )
    assert sample(samples, denials, route="tight", decision="deny", reason="rate_limited") == 1
    rejections = "portcullis_gateway_rate_limit_rejections_total"
    assert sample(samples, rejections, route="tight", policy="tight") == 1
    total = "portcullis_gateway_request_duration_seconds"
    assert sample(samples, total + "_count", route="orders-read") == 4
    assert sample(samples, total + "_bucket", route="orders-read", le="+Inf") == 4
    assert sample(samples, total + "_sum", route="orders-read") > 0
    upstream_time = "portcullis_gateway_upstream_duration_seconds"
    assert sample(samples, upstream_time + "_count", route="orders-read") == 2  # forwarded ones
    assert sample(samples, "portcullis_gateway_jwks_fetches_total", issuer=issuer.url) == 1
    assert sample(samples, "portcullis_gateway_jwks_fetch_failures_total", issuer=issuer.url) == 0
    assert sample(samples, "portcullis_gateway_token_cache_hits_total") >= 2
    assert sample(samples, "portcullis_gateway_token_cache_entries") == 1


async def test_metrics_count_introspection_outcomes_cache_hits_and_upstream_errors(
    client, refused_port
):
    server = await IntrospectionServer().start()
    server.active("good")
    section = "{client_id: gateway, client_secret: gateway-secret, inactive_cache_ttl: 10s}"
    entry = issuer_entry(server.url, mode="introspection", introspection=section)
    dead_upstream = f"http://127.0.0.1:{refused_port}"
    try:
        async with running_gateway(
            gateway_yaml(server.url, dead_upstream, issuers=[entry])
        ) as gateway:
            statuses = [
                (await call(client, gateway.url + "/orders/1", token)).status
                for token in ("good", "good", "unknown", "unknown")
            ]
            server.status = 500
            statuses.append((await call(client, gateway.url + "/orders/1", "other")).status)
            samples = await scrape(gateway.admin_url)
    finally:
        await server.stop()
    assert statuses == [502, 502, 401, 401, 503]  # the upstream is down; tokens checked first
    intro = "portcullis_gateway_introspection_requests_total"
    assert sample(samples, intro, issuer=server.url, outcome="active") == 1
    assert sample(samples, intro, issuer=server.url, outcome="inactive") == 1
    assert sample(samples, intro, issuer=server.url, outcome="error") == 1
    assert (
        sample(samples, "portcullis_gateway_introspection_cache_hits_total", issuer=server.url) == 2
    )
    errors = "portcullis_gateway_upstream_errors_total"
    assert sample(samples, errors, route="orders-read", kind="connect") == 2
    denials = "portcullis_gateway_denials_total"
    assert (
        sample(
            samples, denials, route="orders-read", decision="deny", reason="verifier_unavailable"
        )
        == 1
    )


async def test_a_method_a_client_made_up_is_counted_as_other(issuer, upstream, client):
    async with running_gateway(gateway_yaml(issuer.url, upstream.url)) as gateway:
        for method in ("PROPFIND", "MKCOL", "PURGE"):
            async with client.request(method, gateway.url + "/public/pot") as response:
                assert response.status == 200
                await response.read()
        samples = await scrape(gateway.admin_url)
    requests = "portcullis_gateway_requests_total"
    assert (
        sample(samples, requests, route="public", method="OTHER", status="200", decision="allow")
        == 3
    )
    assert not any("PROPFIND" in str(labels) for _, labels in samples)


async def test_refused_paths_and_other_early_refusals_are_counted_as_denials_with_a_reason(
    issuer, upstream
):
    probes = [
        (raw_request("GET", "/public/a/../../orders/1"), "path_traversal"),
        (raw_request("GET", "/public/%2e%2e/orders/1"), "path_traversal"),
        (raw_request("GET", "/public/..;/orders/1"), "path_traversal"),
        (raw_request("GET", "/public/a%2Fb"), "encoded_separator"),
        (raw_request("GET", "/public//orders"), "empty_segment"),
        (raw_request("GET", "/public/%00"), "control_character"),
        (raw_request("GET", "/public/%ff"), "bad_encoding"),
        (raw_request("GET", "/public/orders;x=1/1"), "path_parameters"),
        (raw_request("GET", "/public/x#/../orders/1"), "fragment"),
        (raw_request("POST", "/tiny/x", [("Content-Length", "5000")]), "body_too_large"),
        (b"GET /public/x HTTP/1.1\r\nHost: a\r\nX-Big: " + b"x" * 20_000 + b"\r\n\r\n", None),
    ]
    tiny = '  - {name: tiny, path: "/tiny/**", auth: none, max_body_size: 1KiB}\n'
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, tiny)) as gateway:
        statuses = [(await raw_exchange(gateway.url, probe)).status for probe, _ in probes]
        samples = await scrape(gateway.admin_url)
    assert statuses == [400] * (len(probes) - 2) + [413, 431]
    assert upstream.requests == []
    requests = "portcullis_gateway_requests_total"
    denials = "portcullis_gateway_denials_total"
    # None is counted as allowed: every refusal is a denial, with the reason it was refused.
    assert not [
        labels
        for (name, labels), _ in samples.items()
        if name == requests and ("decision", "allow") in labels
    ]
    assert sample(samples, requests, route="-", method="GET", status="400", decision="deny") == 9
    assert sample(samples, requests, route="-", method="OTHER", status="431", decision="deny") == 1
    assert (
        sample(samples, requests, route="tiny", method="POST", status="413", decision="deny") == 1
    )
    assert sample(samples, denials, route="-", decision="deny", reason="path_traversal") == 3
    for _, reason in probes[3:-2]:
        assert sample(samples, denials, route="-", decision="deny", reason=reason) == 1, reason
    assert sample(samples, denials, route="tiny", decision="deny", reason="body_too_large") == 1
    assert sample(samples, denials, route="-", decision="deny", reason="unparsable") == 1


# ---------------------------------------------------------------------------- access log


def log_config(issuer: str, upstream: str, path, **options: str) -> str:
    settings = {"output": f'"{path}"', "flush_interval": "10ms", **options}
    section = "{" + ", ".join(f"{k}: {v}" for k, v in settings.items()) + "}"
    return gateway_yaml(issuer, upstream, extra=f"access_log: {section}")


async def test_each_request_is_one_json_line_with_the_documented_fields(
    issuer, upstream, client, tmp_path
):
    log = tmp_path / "access.log"
    token = issuer.token("ES256", sub="alice", client_id="mobile")
    async with running_gateway(log_config(issuer.url, upstream.url, log)) as gateway:
        async with client.get(
            gateway.url + "/orders/7?access_token=leaked&page=2",
            headers={"Authorization": f"Bearer {token}"},
        ) as response:
            assert response.status == 200
            request_id = response.headers["X-Request-Id"]
        refused = await call(client, gateway.url + "/orders/7")
        await wait_for(lambda: len(read_json_lines(log)) >= 2, what="the access log")
    allowed, denied = read_json_lines(log)
    assert set(allowed) == ACCESS_FIELDS
    seen = upstream.requests[0]
    trace = TRACEPARENT.fullmatch(header_values(seen, "traceparent")[0])
    assert trace is not None
    assert allowed | {"time": "-", "upstream_ms": 0, "total_ms": 0} == {
        "time": "-",
        "request_id": request_id,
        "trace_id": trace.group(1),
        "client": "127.0.0.1",
        "mode": "proxy",
        "method": "GET",
        "path": "/orders/7",  # no query by default: it may carry anything
        "route": "orders-read",
        "status": 200,
        "decision": "allow",
        "reason": None,
        "subject": "alice",
        "client_id": "mobile",
        "upstream_ms": 0,
        "total_ms": 0,
    }
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", allowed["time"])
    assert 0 < allowed["upstream_ms"] <= allowed["total_ms"]
    assert (denied["status"], denied["decision"], denied["reason"]) == (401, "deny", "no_token")
    assert (denied["subject"], denied["client_id"], denied["upstream_ms"]) == (None, None, None)
    assert denied["request_id"] == refused.headers["X-Request-Id"]
    assert token not in log.read_text() and "leaked" not in log.read_text()


async def test_the_subject_can_be_logged_as_a_keyed_hash_or_left_out(
    issuer, upstream, client, tmp_path
):
    token = issuer.token("ES256", sub="alice")
    hashed_log, omitted_log = tmp_path / "hashed.log", tmp_path / "omitted.log"
    for path, options in (
        (hashed_log, {"subject": "hashed", "subject_hash_key": '"k3y"'}),
        (omitted_log, {"subject": "omitted"}),
    ):
        async with running_gateway(log_config(issuer.url, upstream.url, path, **options)) as gw:
            assert (await call(client, gw.url + "/orders/1", token)).status == 200
            await wait_for(lambda path=path: len(read_json_lines(path)) >= 1, what="the access log")
    expected = hmac.new(b"k3y", b"alice", hashlib.sha256).hexdigest()[:32]
    assert [e["subject"] for e in read_json_lines(hashed_log)] == [expected]
    assert [e["subject"] for e in read_json_lines(omitted_log)] == [None]
    assert "alice" not in hashed_log.read_text() + omitted_log.read_text()


async def test_the_query_is_logged_only_when_asked_for(issuer, upstream, client, tmp_path):
    log = tmp_path / "access.log"
    config = log_config(issuer.url, upstream.url, log, include_query="true")
    async with running_gateway(config) as gateway:
        await call(client, gateway.url + "/public/x?page=2")
        await wait_for(lambda: len(read_json_lines(log)) >= 1, what="the access log")
    assert [e["path"] for e in read_json_lines(log)] == ["/public/x?page=2"]


# ---------------------------------------------------------------------------- traceparent


async def test_a_valid_traceparent_is_continued_with_the_gateways_own_parent_id(
    issuer, upstream, client
):
    incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with (
        running_gateway(gateway_yaml(issuer.url, upstream.url)) as gateway,
        client.get(
            gateway.url + "/public/x",
            headers={"traceparent": incoming, "tracestate": "vendor=abc"},
        ) as response,
    ):
        assert response.status == 200
    seen = upstream.requests[0]
    sent = TRACEPARENT.fullmatch(header_values(seen, "traceparent")[0])
    assert sent is not None
    assert sent.group(1) == "4bf92f3577b34da6a3ce929d0e0e4736"  # the same trace
    assert sent.group(2) != "00f067aa0ba902b7"  # a hop of its own
    assert sent.group(3) == "01"
    assert header_values(seen, "tracestate") == ["vendor=abc"]


async def test_a_missing_or_invalid_traceparent_starts_a_new_trace(issuer, upstream, client):
    invalid = [
        None,
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero parent id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # forbidden version
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # 00 has no more
    ]
    async with running_gateway(gateway_yaml(issuer.url, upstream.url)) as gateway:
        for value in invalid:
            headers = {"tracestate": "vendor=abc"}
            if value is not None:
                headers["traceparent"] = value
            async with client.get(gateway.url + "/public/x", headers=headers) as response:
                assert response.status == 200
    trace_ids = set()
    for seen in upstream.requests:
        sent = TRACEPARENT.fullmatch(header_values(seen, "traceparent")[0])
        assert sent is not None
        assert sent.group(1) not in ("0" * 32, "4bf92f3577b34da6a3ce929d0e0e4736")
        assert sent.group(3) == "01"
        assert header_values(seen, "tracestate") == []  # it belonged to the dropped trace
        trace_ids.add(sent.group(1))
    assert len(trace_ids) == len(invalid)


async def test_a_future_version_traceparent_is_continued_as_version_00(issuer, upstream, client):
    incoming = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future"
    async with (
        running_gateway(gateway_yaml(issuer.url, upstream.url)) as gateway,
        client.get(gateway.url + "/public/x", headers={"traceparent": incoming}) as response,
    ):
        assert response.status == 200
    sent = TRACEPARENT.fullmatch(header_values(upstream.requests[0], "traceparent")[0])
    assert sent is not None and sent.group(1) == "4bf92f3577b34da6a3ce929d0e0e4736"


# ---------------------------------------------------------------------------- no secrets


async def test_no_token_or_secret_appears_in_any_log_line_of_a_running_process(
    issuer, upstream, tmp_path
):
    introspection = await IntrospectionServer(client_secret="s3cr3t-introspection").start()
    issuer.metadata_overrides["introspection_endpoint"] = introspection.endpoint
    introspection.active("opaque-active-token", iss=issuer.url)
    section = "{client_id: gateway, client_secret: s3cr3t-introspection}"
    entry = issuer_entry(issuer.url, mode="auto", introspection=section)
    config = gateway_yaml(
        issuer.url,
        upstream.url,
        issuers=[entry],
        extra="log_level: debug\naccess_log: {subject: hashed, subject_hash_key: hash-k3y}",
    )
    process = GatewayProcess(config, tmp_path)
    valid = issuer.token("ES256")
    tokens = {
        "valid": valid,
        "tampered": valid[:-6] + "AAAAAA",
        "expired": issuer.token("ES256", lifetime=-600),
        "opaque-active": "opaque-active-token",
        "opaque-inactive": "opaque-inactive-token",
        "opaque-failing": "opaque-failing-token",
    }
    try:
        await process.wait_ready()
        import aiohttp

        async with aiohttp.ClientSession() as session:

            async def send(token: str, path: str = "/orders/1", **headers: str) -> int:
                sent = {"Authorization": f"Bearer {token}", **headers}
                async with session.get(process.url + path, headers=sent) as response:
                    await response.read()
                    return response.status

            statuses = {
                name: await send(token)
                for name, token in tokens.items()
                if name != "opaque-failing"
            }
            introspection.status = 500
            statuses["opaque-failing"] = await send(tokens["opaque-failing"])
            statuses["query"] = await send(valid, "/orders/1?access_token=" + valid)
            async with session.get(
                process.url + "/orders/1", headers={"Authorization": "Basic Z2F0ZTpzM2NyM3Q="}
            ) as response:
                statuses["basic"] = response.status
    finally:
        await process.stop()
        await introspection.stop()
    assert statuses == {
        "valid": 200,
        "tampered": 401,
        "expired": 401,
        "opaque-active": 200,
        "opaque-inactive": 401,
        "opaque-failing": 503,
        "query": 200,
        "basic": 401,
    }
    lines = process.log().splitlines()
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert sum(1 for e in entries if "decision" in e) == len(statuses)
    text = process.log()
    for secret in [*tokens.values(), "s3cr3t-introspection", "Z2F0ZTpzM2NyM3Q=", "hash-k3y"]:
        assert secret not in text, secret
    # The signature part alone is not there either (a token cut in pieces is still a token).
    assert valid.rsplit(".", 1)[1] not in text
    assert "user-123" not in text  # subjects are hashed in this config
