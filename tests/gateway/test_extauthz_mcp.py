"""An MCP server's call rules and the decision listener (ext_authz): a question without the
request's body (nginx, Traefik, Caddy; Envoy without `with_request_body`) about a POST to a
route with `mcp.calls` is refused there (403 mcp_calls_unjudged, whatever the token, in
monitor mode too) instead of being allowed on the route's scopes; Envoy's question with the
whole body has the call judged as the gateway's own listener judges it (and one with part
of it is refused); `check` warns of such routes and `explain --ext-authz` tells the
refusal."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from tests.gateway.test_cli import gateway_cli
from tests.gateway.test_mcp import PUBLIC, config, rpc, token
from tests.support import EchoUpstream, TestIssuer, running_gateway

MCP = PUBLIC + "/mcp"
EXT_AUTHZ = 'ext_authz: {listen: "127.0.0.1:3", trusted_callers: ["127.0.0.1/32"]}'


def ext_authz_config(issuer: TestIssuer, upstream: EchoUpstream, mode: str = "enforce") -> str:
    return config(issuer.url, upstream.url, extra=f"{EXT_AUTHZ}\nmode: {mode}")


async def ask(
    client: aiohttp.ClientSession, url: str, headers: dict[str, str], method: str = "GET"
) -> tuple[int, Any, Any]:
    async with client.request(method, url, headers=headers) as response:
        body = await response.read()
        return response.status, response.headers, json.loads(body) if body else None


def questions(decision_url: str, method: str, bearer: str | None) -> list[tuple[str, dict, str]]:
    """The same request (`method` /mcp) as each front proxy's convention asks about it."""
    auth = {} if bearer is None else {"Authorization": f"Bearer {bearer}"}
    return [
        (
            decision_url + "/forward-auth",
            {"X-Forwarded-Method": method, "X-Forwarded-Uri": "/mcp", **auth},
            "GET",
        ),
        (
            decision_url + "/auth-request",
            {"X-Original-Method": method, "X-Original-URI": "/mcp", **auth},
            "GET",
        ),
        (decision_url + "/ext-authz/mcp", auth, method),
    ]


async def test_a_post_to_a_route_with_call_rules_is_refused_by_the_decision_listener(
    issuer, upstream, client
):
    # With every scope the route and its call rules name: any call would be allowed in
    # proxy mode, yet none is judged here.
    everything = token(issuer, "mcp:tools mcp:admin mcp:read", MCP)
    tools_only = token(issuer, "mcp:tools", MCP)
    async with running_gateway(ext_authz_config(issuer, upstream)) as gw:
        refused = [
            await ask(client, url, headers, method)
            for bearer in (everything, tools_only)
            for url, headers, method in questions(gw.decision_url, "POST", bearer)
        ]
        # A stream (GET) and the end of a session (DELETE) carry no call: the route's scopes.
        streams = [
            await ask(client, url, headers, method)
            for verb in ("GET", "DELETE")
            for url, headers, method in questions(gw.decision_url, verb, tools_only)
        ]
        # Without a token, the route's challenge first, as in proxy mode.
        anonymous = [
            await ask(client, url, headers, method)
            for url, headers, method in questions(gw.decision_url, "POST", None)
        ]
        # The gateway's own listener, same configuration: each call judged.
        async with client.post(
            gw.url + "/mcp",
            data=rpc("tools/call", {"name": "list_orders"}),
            headers={"Authorization": f"Bearer {tools_only}", "Content-Type": "application/json"},
        ) as response:
            listed = response.status
        async with client.post(
            gw.url + "/mcp",
            data=rpc("tools/call", {"name": "delete_order"}),
            headers={"Authorization": f"Bearer {tools_only}", "Content-Type": "application/json"},
        ) as response:
            deleted = response.status, response.headers.get("WWW-Authenticate", "")
    assert len(refused) == 6
    for status, headers, body in refused:
        assert status == 403
        assert body["error"]["code"] == "mcp_calls_unjudged"
        assert "gateway's own listener" in body["error"]["message"]
        assert "WWW-Authenticate" not in headers  # no token would help
        assert "X-Auth-Subject" not in headers  # nothing a front proxy could pass on
    for status, headers, _ in streams:
        assert status == 200
        assert headers["X-Auth-Subject"] == "agent-user"
    for status, headers, _ in anonymous:
        assert status == 401
        assert 'scope="mcp:admin mcp:tools"' in headers["WWW-Authenticate"]
    assert listed == 200
    assert deleted[0] == 403 and 'error="insufficient_scope"' in deleted[1]
    # The upstream saw the proxied calls only, never a decision's.
    assert [r["method"] for r in upstream.requests] == ["POST"]


async def envoy_asks(
    client: aiohttp.ClientSession,
    gw: Any,
    bearer: str,
    body: bytes,
    **headers: str,
) -> tuple[int, Any, Any]:
    """Envoy's question about a POST /mcp with `with_request_body`: the original method and
    path behind the prefix, the client's fields, and the body."""
    async with client.post(
        gw.decision_url + "/ext-authz/mcp",
        data=body,
        headers={
            "Authorization": f"Bearer {bearer}",
            "Content-Type": "application/json",
            **headers,
        },
    ) as response:
        answer = await response.read()
        return response.status, response.headers, json.loads(answer) if answer else None


async def test_envoy_passing_the_body_has_each_call_judged(issuer, upstream, client):
    tools_only = token(issuer, "mcp:tools", MCP)
    admin = token(issuer, "mcp:tools mcp:admin", MCP)
    delete = rpc("tools/call", {"name": "delete_order", "arguments": {"id": 7}})
    async with running_gateway(ext_authz_config(issuer, upstream)) as gw:
        listed = await envoy_asks(client, gw, tools_only, rpc("tools/call", {"name": "list"}))
        refused = await envoy_asks(client, gw, tools_only, delete)
        allowed = await envoy_asks(client, gw, admin, delete)
        # Cut by Envoy at max_request_bytes: the call is not told from part of it.
        partial = await envoy_asks(
            client, gw, admin, delete, **{"x-envoy-auth-partial-body": "true"}
        )
        # What the client's fields say must be what the body says, as on the own listener.
        disagreeing = await envoy_asks(
            client,
            gw,
            tools_only,
            rpc("tools/call", {"name": "list"}),
            **{"Mcp-Name": "delete_order"},
        )
        batch = await envoy_asks(client, gw, admin, b"[" + delete + b"]")
        too_large = await envoy_asks(client, gw, admin, b" " * 4096 + delete)
    assert listed[0] == 200 and listed[1]["X-Auth-Subject"] == "agent-user"
    status, headers, body = refused
    assert status == 403 and body["error"]["code"] == "insufficient_scope"
    challenge = headers["WWW-Authenticate"]
    assert 'error="insufficient_scope"' in challenge and 'scope="mcp:admin mcp:tools"' in challenge
    assert "X-Auth-Subject" not in headers
    assert allowed[0] == 200 and allowed[1]["X-Auth-Scopes"] == "mcp:admin mcp:tools"
    assert partial[0] == 403 and partial[2]["error"]["code"] == "mcp_calls_unjudged"
    assert disagreeing[0] == 400 and "Mcp-Name" in disagreeing[2]["error"]["message"]
    assert batch[0] == 400
    assert too_large[0] == 413  # beyond the route's max_message_size (2 KiB)
    assert upstream.requests == []  # decisions only: nothing went upstream


async def test_monitor_mode_lets_a_judged_call_through_but_not_an_unreadable_one(
    issuer, upstream, client
):
    tools_only = token(issuer, "mcp:tools", MCP)
    delete = rpc("tools/call", {"name": "delete_order"})
    async with running_gateway(ext_authz_config(issuer, upstream, "monitor")) as gw:
        judged = await envoy_asks(client, gw, tools_only, delete)
        unreadable = await envoy_asks(client, gw, tools_only, b"not json")
    assert judged[0] == 200
    assert unreadable[0] == 400


async def test_monitor_mode_refuses_it_too(issuer, upstream, client):
    """Monitor mode forwards what it would deny; a call it cannot judge at all is refused,
    as a message it cannot read is in proxy mode."""
    async with running_gateway(ext_authz_config(issuer, upstream, "monitor")) as gw:
        answers = [
            await ask(client, url, headers, method)
            for url, headers, method in questions(
                gw.decision_url, "POST", token(issuer, "mcp:tools", MCP)
            )
        ]
    assert [status for status, _, _ in answers] == [403, 403, 403]
    assert {body["error"]["code"] for _, _, body in answers} == {"mcp_calls_unjudged"}


async def test_a_route_without_call_rules_is_decided_on_its_scopes(issuer, upstream, client):
    """Nothing in such a route depends on the body's call: allowed on the route's scopes."""
    routes = config(issuer.url, upstream.url).replace(
        """    mcp:
      max_message_size: 2KiB
      calls:
        - {method: tools/call, name: "delete_*", scopes: {all: ["mcp:admin"]}}
        - {method: resources/read, scopes: {all: ["mcp:read"]}}
""",
        "    mcp: {}\n",
    )
    assert "calls" not in routes
    async with running_gateway(routes + EXT_AUTHZ + "\n") as gw:
        answers = [
            await ask(client, url, headers, method)
            for url, headers, method in questions(
                gw.decision_url, "POST", token(issuer, "mcp:tools", MCP)
            )
        ]
    assert [status for status, _, _ in answers] == [200, 200, 200]


async def test_check_warns_of_call_rules_the_decision_listener_cannot_apply(issuer, tmp_path):
    with_listener = tmp_path / "ext-authz.yaml"
    with_listener.write_text(config(issuer.url, "http://127.0.0.1:9", extra=EXT_AUTHZ))
    without = tmp_path / "proxy.yaml"
    without.write_text(config(issuer.url, "http://127.0.0.1:9"))
    warned = await gateway_cli("check", "--config", str(with_listener))
    quiet = await gateway_cli("check", "--config", str(without))
    assert warned.code == 0, warned.stderr  # valid: the route is right for the own listener
    (line,) = [w for w in warned.stderr.splitlines() if "mcp_calls_unjudged" in w]
    line_of_route = next(
        n for n, text in enumerate(with_listener.read_text().splitlines(), 1) if "name: mcp" in text
    )
    assert line.startswith(f"{with_listener}:{line_of_route}: warning: route mcp has mcp.calls")
    assert "the decision listener never sees a request's body" in line
    assert quiet.code == 0 and "mcp_calls_unjudged" not in quiet.stderr


async def test_explain_tells_the_decision_listeners_refusal(issuer, tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text(config(issuer.url, "http://127.0.0.1:9", extra=EXT_AUTHZ))
    worker = token(issuer, "mcp:tools", MCP)

    async def explain(method: str, *extra: str) -> tuple[int, str]:
        result = await gateway_cli(
            "explain", "--config", str(path), method, "/mcp", "--token", worker, *extra
        )
        return result.code, result.stdout

    code, out = await explain("POST", "--ext-authz", "--call", "tools/call:list_orders")
    assert code == 1
    assert "decision: forward, with the identity headers of this token" in out  # proxy mode
    assert "answer: 403 mcp_calls_unjudged, whatever the call" in out
    code, out = await explain("POST", "--ext-authz", "--call", "tools/call:delete_order")
    assert code == 1
    assert "decision: 403 insufficient_scope — the call needs mcp:admin" in out
    assert "answer: 403 mcp_calls_unjudged, whatever the call" in out
    assert "as in proxy mode" not in out
    code, out = await explain("GET", "--ext-authz")
    assert code == 0 and "answer: 200" in out and "mcp_calls_unjudged" not in out
    code, out = await explain("POST", "--call", "tools/call:list_orders")
    assert code == 0 and "mcp_calls_unjudged" not in out
