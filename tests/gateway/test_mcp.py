"""MCP servers behind the gateway: protected resource metadata (RFC 9728), challenges that
name it, the resource's URI as an audience, no token passthrough, and scopes per JSON-RPC
call. A real gateway between a real client and an echoing upstream on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway import settings as gateway_settings
from portcullis.yamlconf import ConfigError
from tests.gateway.test_cli import gateway_cli
from tests.support import (
    UNBOUND_ADMIN_LISTEN,
    UNBOUND_LISTEN,
    EchoUpstream,
    RunningGateway,
    TestIssuer,
    header_values,
    issuer_entry,
    running_gateway,
)

PUBLIC = "https://mcp.example.com"
WELL_KNOWN = "/.well-known/oauth-protected-resource"


def config(issuer: str, upstream: str, extra_routes: str = "", extra: str = "") -> str:
    return f"""
listen: "{UNBOUND_LISTEN}"
admin_listen: "{UNBOUND_ADMIN_LISTEN}"
upstream: {{url: "{upstream}", connect_timeout: 1s, read_timeout: 2s}}
public_url: "{PUBLIC}"
issuers:
{issuer_entry(issuer)}
routes:
  - {{name: health, path: /healthz, auth: none}}
  - name: mcp
    path: /mcp
    scopes: {{any: ["mcp:tools", "mcp:admin"]}}
    mcp:
      max_message_size: 2KiB
      calls:
        - {{method: tools/call, name: "delete_*", scopes: {{all: ["mcp:admin"]}}}}
        - {{method: resources/read, scopes: {{all: ["mcp:read"]}}}}
  - {{name: orders-read, path: "/orders/**", methods: [GET], scopes: {{all: ["orders:read"]}}}}
  - {{name: orders-write, path: "/orders/{{id}}", methods: [PUT],
      scopes: {{all: ["orders:write", "offline_access"]}}}}
  - {{name: pay, path: "/pay/**", dpop: required, public_url: "https://pay.example.com"}}
{extra_routes}
resources:
  - {{path: /mcp, name: "Tools server", documentation: "https://docs.example.com/mcp"}}
{extra}
"""


@pytest.fixture
async def mcp_gateway(issuer: TestIssuer, upstream: EchoUpstream) -> AsyncIterator[RunningGateway]:
    async with running_gateway(config(issuer.url, upstream.url)) as gateway:
        yield gateway


def token(issuer: TestIssuer, scope: str, aud: str | list[str] = "orders-api") -> str:
    return issuer.token(sub="agent-user", client_id="agent", scope=scope, aud=aud)


def rpc(method: str, params: dict[str, Any] | None = None, ident: int | None = 1) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    if ident is not None:
        message["id"] = ident
    return json.dumps(message).encode()


async def post(client: Any, gateway: RunningGateway, body: bytes, **headers: str) -> Any:
    async with client.post(
        gateway.url + "/mcp",
        data=body,
        headers={"Content-Type": "application/json", **headers},
    ) as response:
        return response.status, response.headers, await response.read()


def params(challenge: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', challenge))


# ---------------------------------------------------------------------------- metadata


async def test_each_resource_has_its_metadata_at_its_path_suffixed_well_known_address(
    mcp_gateway, issuer, client
):
    async with client.get(mcp_gateway.url + WELL_KNOWN + "/mcp") as response:
        assert response.status == 200
        assert response.headers["Access-Control-Allow-Origin"] == "*"
        assert "max-age" in response.headers["Cache-Control"]
        document = await response.json()
    assert document == {
        "resource": PUBLIC + "/mcp",
        "authorization_servers": [issuer.url],
        "scopes_supported": ["mcp:admin", "mcp:read", "mcp:tools"],
        "bearer_methods_supported": ["header"],
        "dpop_signing_alg_values_supported": document["dpop_signing_alg_values_supported"],
        "resource_name": "Tools server",
        "resource_documentation": "https://docs.example.com/mcp",
    }
    async with client.get(mcp_gateway.url + WELL_KNOWN + "/orders") as response:
        orders = await response.json()
    # Both orders routes make one resource; offline_access is the issuer's, not the API's.
    assert orders["resource"] == PUBLIC + "/orders"
    assert orders["scopes_supported"] == ["orders:read", "orders:write"]
    assert "dpop_bound_access_tokens_required" not in orders
    async with client.get(mcp_gateway.url + WELL_KNOWN + "/pay") as response:
        pay = await response.json()
    assert pay["resource"] == "https://pay.example.com/pay"
    assert pay["dpop_bound_access_tokens_required"] is True


async def test_the_root_document_is_only_that_of_a_resource_at_the_root(issuer, upstream, client):
    async with running_gateway(config(issuer.url, upstream.url)) as gateway:
        response = await client.get(gateway.url + WELL_KNOWN)
        assert response.status == 404  # no resource at the root: never another's
    root = '  - {name: rest, path: "/**"}'
    async with running_gateway(config(issuer.url, upstream.url, root)) as gateway:
        response = await client.get(gateway.url + WELL_KNOWN)
        assert response.status == 200
        assert (await response.json())["resource"] == PUBLIC


async def test_metadata_is_answered_whatever_the_rules_and_revalidated_by_its_etag(
    mcp_gateway, upstream, client
):
    url = mcp_gateway.url + WELL_KNOWN + "/mcp"
    async with client.get(url) as response:
        etag = response.headers["ETag"]
        body = await response.read()
    async with client.get(url, headers={"If-None-Match": etag}) as response:
        assert response.status == 304
        assert await response.read() == b""
    async with client.head(url) as response:
        assert response.status == 200
    async with client.post(url, data=b"{}") as response:
        assert response.status == 405
        assert response.headers["Allow"] == "GET, HEAD"
    async with client.get(mcp_gateway.url + WELL_KNOWN + "/nothing") as response:
        assert response.status == 404
    assert upstream.requests == []  # none of these reached the upstream (no rule matches)
    assert json.loads(body)["resource"] == PUBLIC + "/mcp"


# ---------------------------------------------------------------------------- challenges


async def test_a_401_names_the_metadata_and_the_scopes_the_route_needs(mcp_gateway, client):
    async with client.post(mcp_gateway.url + "/mcp", data=rpc("tools/list")) as response:
        assert response.status == 401
        bearer, dpop = response.headers.getall("WWW-Authenticate")
    assert bearer.startswith("Bearer ") and dpop.startswith("DPoP ")
    for challenge in (bearer, dpop):
        assert params(challenge)["resource_metadata"] == PUBLIC + WELL_KNOWN + "/mcp"
        assert params(challenge)["scope"] == "mcp:admin mcp:tools"


async def test_a_403_for_a_tool_names_every_scope_that_tool_needs(mcp_gateway, issuer, client):
    worker = token(issuer, "mcp:tools")
    status, headers, _ = await post(
        client,
        mcp_gateway,
        rpc("tools/call", {"name": "delete_order", "arguments": {"id": 7}}),
        Authorization=f"Bearer {worker}",
    )
    assert status == 403
    challenge = params(headers.getall("WWW-Authenticate")[0])
    assert challenge["error"] == "insufficient_scope"
    # The call's scope and the route's the token meets: asking for these loses nothing.
    assert challenge["scope"] == "mcp:admin mcp:tools"
    assert challenge["resource_metadata"] == PUBLIC + WELL_KNOWN + "/mcp"


# ---------------------------------------------------------------------------- calls


async def test_tools_are_allowed_by_their_own_rules_and_the_rest_by_the_routes(
    mcp_gateway, issuer, upstream, client
):
    worker, admin = token(issuer, "mcp:tools"), token(issuer, "mcp:admin")
    cases = [
        (worker, rpc("tools/call", {"name": "list_orders"}), 200),
        (worker, rpc("tools/call", {"name": "delete_order"}), 403),
        (admin, rpc("tools/call", {"name": "delete_order"}), 200),
        (worker, rpc("resources/read", {"uri": "orders://7"}), 403),
        (worker, rpc("tools/list"), 200),
        (worker, rpc("notifications/initialized", ident=None), 200),
        (worker, b'{"jsonrpc": "2.0", "id": 3, "result": {}}', 200),
    ]
    for bearer, body, expected in cases:
        status, _, _ = await post(client, mcp_gateway, body, Authorization=f"Bearer {bearer}")
        assert status == expected, body
    allowed = [body for _, body, expected in cases if expected == 200]
    assert [r["body_sha256"] for r in upstream.requests] == [
        hashlib.sha256(body).hexdigest() for body in allowed
    ]


async def test_the_clients_credentials_never_reach_the_mcp_server(
    mcp_gateway, issuer, upstream, client
):
    worker = token(issuer, "mcp:tools")
    status, _, _ = await post(
        client, mcp_gateway, rpc("tools/list"), Authorization=f"Bearer {worker}", DPoP="x.y.z"
    )
    assert status == 200
    (seen,) = upstream.requests
    names = {name.lower() for name, _ in seen["headers"]}
    assert "authorization" not in names and "dpop" not in names
    assert header_values(seen, "X-Auth-Subject") == ["agent-user"]
    # Other routes keep forwarding the token as before.
    async with client.get(
        mcp_gateway.url + "/orders/1",
        headers={"Authorization": f"Bearer {token(issuer, 'orders:read')}"},
    ) as response:
        assert response.status == 200
    assert "authorization" in {name.lower() for name, _ in upstream.requests[-1]["headers"]}


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b"[" + rpc("tools/list") + b"]", {}, 400),  # a batch
        (b"not json", {}, 400),
        (b'{"method": "tools/list", "id": 1}', {}, 400),  # not JSON-RPC 2.0
        (rpc("tools/call", {"arguments": {}}), {}, 400),  # no name
        (rpc("tools/call", {"name": "list_orders"}), {"Mcp-Method": "tools/list"}, 400),
        (rpc("tools/call", {"name": "list_orders"}), {"Mcp-Name": "delete_order"}, 400),
        (
            rpc("tools/call", {"name": "list_orders"}),
            {"Mcp-Method": "tools/call", "Mcp-Name": "list_orders"},
            200,
        ),
        (rpc("tools/call", {"name": "x" * 3000}), {}, 413),  # over max_message_size
    ],
    ids=[
        "batch",
        "not-json",
        "not-jsonrpc",
        "no-name",
        "method-header-differs",
        "name-header-differs",
        "headers-agree",
        "too-large",
    ],
)
async def test_a_message_that_cannot_be_judged_is_refused_before_the_upstream_sees_it(
    mcp_gateway, issuer, upstream, client, body, headers, status
):
    worker = token(issuer, "mcp:tools")
    got, _, _ = await post(client, mcp_gateway, body, Authorization=f"Bearer {worker}", **headers)
    assert got == status
    assert len(upstream.requests) == (1 if status == 200 else 0)


async def test_a_chunked_message_is_read_within_the_limit_too(
    mcp_gateway, issuer, upstream, client
):
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", '
        yield b'"params": {"name": "delete_order"}}'

    async with client.post(
        mcp_gateway.url + "/mcp",
        data=chunks(),
        headers={"Authorization": f"Bearer {token(issuer, 'mcp:tools')}"},
    ) as response:
        assert response.status == 403
    assert upstream.requests == []


async def test_in_monitor_mode_a_call_over_its_scopes_is_recorded_and_forwarded(
    issuer, upstream, client
):
    text = config(issuer.url, upstream.url).replace(
        "  - name: mcp\n    path: /mcp\n", "  - name: mcp\n    path: /mcp\n    mode: monitor\n"
    )
    async with running_gateway(text) as gateway:
        status, _, _ = await post(
            client,
            gateway,
            rpc("tools/call", {"name": "delete_order"}),
            Authorization=f"Bearer {token(issuer, 'mcp:tools')}",
        )
        assert status == 200
        # A message that cannot be judged is refused in monitor mode too.
        status, _, _ = await post(
            client, gateway, b"[]", Authorization=f"Bearer {token(issuer, 'mcp:tools')}"
        )
        assert status == 400
    assert len(upstream.requests) == 1


# ---------------------------------------------------------------------------- audience


async def test_the_resources_uri_is_an_audience_its_tokens_may_name(mcp_gateway, issuer, client):
    for aud, expected in ((PUBLIC + "/mcp", 200), (PUBLIC + "/orders", 401), ("other", 401)):
        status, _, _ = await post(
            client,
            mcp_gateway,
            rpc("tools/list"),
            Authorization=f"Bearer {token(issuer, 'mcp:tools', aud)}",
        )
        assert status == expected, aud


# ---------------------------------------------------------------------------- check


@pytest.mark.parametrize(
    ("calls", "problem"),
    [
        ("[{method: tools/cal, scopes: {all: [a]}}]", "tools/cal is not an MCP method"),
        ("[{method: tools/list, name: x, scopes: {all: [a]}}]", "tools/list names nothing"),
        (
            "[{method: tools/call, scopes: {all: [a]}}, "
            '{method: tools/call, name: "delete_*", scopes: {all: [b]}}]',
            "is never reached",
        ),
        (
            '[{method: tools/call, name: "del*", scopes: {all: [a]}}, '
            '{method: tools/call, name: "delete_*", scopes: {all: [b]}}]',
            "is never reached",
        ),
    ],
    ids=["unknown-method", "name-on-unnamed-method", "shadowed-by-any", "shadowed-by-prefix"],
)
def test_check_refuses_call_rules_that_cannot_mean_what_they_say(calls, problem):
    text = config("https://auth.example.com", "http://127.0.0.1:9").replace(
        "      calls:\n"
        '        - {method: tools/call, name: "delete_*", scopes: {all: ["mcp:admin"]}}\n'
        '        - {method: resources/read, scopes: {all: ["mcp:read"]}}\n',
        f"      calls: {calls}\n",
    )
    with pytest.raises(ConfigError) as caught:
        gateway_settings.load_text(text, "gw.yaml")
    assert any(problem in str(p) for p in caught.value.problems), caught.value.problems


def test_check_refuses_a_resource_no_route_defines():
    text = config("https://auth.example.com", "http://127.0.0.1:9").replace(
        "path: /mcp, name:", "path: /mcpp, name:"
    )
    with pytest.raises(ConfigError) as caught:
        gateway_settings.load_text(text, "gw.yaml")
    assert any("no protected route belongs to /mcpp" in str(p) for p in caught.value.problems)


# ---------------------------------------------------------------------------- explain


async def test_explain_tells_what_a_tool_call_needs_and_decides_it_for_a_token(issuer, tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text(config(issuer.url, "http://127.0.0.1:9"))

    async def explain(*extra: str) -> tuple[int, str]:
        result = await gateway_cli("explain", "--config", str(path), "POST", "/mcp", *extra)
        return result.code, result.stdout

    code, out = await explain("--call", "tools/call:delete_order")
    assert code == 0
    assert "mcp: the client's Authorization and DPoP are not forwarded" in out
    assert "    tools/call delete_*: all of mcp:admin" in out
    assert "call tools/call delete_order: needs all of mcp:admin" in out
    code, out = await explain("--call", "tools/list")
    assert "call tools/list: no call rule matches; the route's scopes are enough" in out
    worker = token(issuer, "mcp:tools", PUBLIC + "/mcp")
    code, out = await explain("--call", "tools/call:delete_order", "--token", worker)
    assert code == 1
    assert "decision: 403 insufficient_scope — the call needs mcp:admin" in out
    code, out = await explain("--call", "tools/call:list_orders", "--token", worker)
    assert code == 0 and "decision: forward" in out
