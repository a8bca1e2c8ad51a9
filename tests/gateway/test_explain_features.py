"""`python -m gateway explain` for what applies beyond the route's needs: the mode, the rate
limit and its key, the pre-authentication limit, CORS for an origin, WebSockets, and tokens
checked by introspection. Run as a real process, as an operator would."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.test_cli import gateway_cli, line_of, write
from tests.support import IntrospectionServer, issuer_entry


def feature_config(issuer: str, issuers: str | None = None) -> str:
    trusted = issuers or f'  - {{issuer: "{issuer}", audiences: [orders-api], algorithms: [ES256]}}'
    return f"""\
upstream: {{url: "http://127.0.0.1:9"}}
issuers:
{trusted}
rate_limits:
  default: {{rate: 100/s, burst: 200, key: subject}}
  pre_auth: {{rate: 20/s, burst: 40}}
cors: {{allow_origins: ["https://app.example.com"], allow_methods: [GET, PUT]}}
routes:
  - name: chat
    path: "/chat/**"
    mode: monitor
    scopes: {{all: ["chat"]}}
    websocket: {{close_on_token_expiry: true}}
    rate_limit: {{rate: 10/m, burst: 5, key: "header:X-Api-Key"}}
    cors: false
  - {{name: orders, path: "/orders/**", scopes: {{any: ["orders:read"]}}}}
"""


async def test_explain_lists_the_mode_limits_cors_and_websocket_that_apply(
    tmp_path: Path, issuer
) -> None:
    text = feature_config(issuer.url)
    path = write(tmp_path, text)
    chat = await gateway_cli("explain", "--config", path, "GET", "/chat/1")
    orders = await gateway_cli(
        "explain", "--config", path, "GET", "/orders/1", "--origin", "https://app.example.com"
    )
    elsewhere = await gateway_cli(
        "explain", "--config", path, "GET", "/orders/1", "--origin", "https://evil.example"
    )
    assert (chat.code, chat.stderr) == (0, "")
    assert chat.stdout.splitlines() == [
        f"route: chat ({path}:{line_of(text, 'name: chat')})",
        "  path: /chat/**   methods: any",
        "  auth: required (Authorization: Bearer <token>)",
        f"  accepts tokens from {issuer.url} with aud in: orders-api",
        "  dpop: allowed (bearer tokens, or DPoP-bound tokens with a proof of their key)",
        "  scopes: all of chat",
        "  mode: monitor (refusals are logged as would_deny; the request is forwarded)",
        "  rate limit: 10/60s (burst 5) per header:x-api-key (route policy, 'chat')",
        "  pre-auth limit: 20/1s (burst 40) per client address "
        "(counted when a token must be verified)",
        "  cors: none (preflights are forwarded like any OPTIONS request)",
        "  websocket: proxied (closed when the token expires: yes)",
        "decision without a token: 401 (pass --token to check one)",
    ]
    assert orders.stdout.splitlines()[6:] == [
        "  mode: enforce",
        "  rate limit: 100/1s (burst 200) per subject (default policy, 'orders')",
        "  pre-auth limit: 20/1s (burst 40) per client address "
        "(counted when a token must be verified)",
        "  cors: origins https://app.example.com; methods GET, PUT; "
        "headers Authorization, Content-Type; credentials no; max-age 600s",
        "  origin https://app.example.com: allowed (Access-Control-Allow-Origin is sent)",
        "decision without a token: 401 (pass --token to check one)",
    ]
    assert elsewhere.stdout.splitlines()[10] == (
        "  origin https://evil.example: not allowed (no CORS headers; preflights get 403)"
    )


async def test_explain_in_monitor_mode_says_what_would_be_denied_and_that_it_is_forwarded(
    tmp_path: Path, issuer
) -> None:
    path = write(tmp_path, feature_config(issuer.url))
    token = issuer.token("ES256", scope="orders:read")
    result = await gateway_cli("explain", "--config", path, "GET", "/chat/1", "--token", token)
    assert (result.code, result.stderr) == (0, "")
    assert result.stdout.splitlines()[-1] == (
        "decision: would deny (403 insufficient_scope — the token needs all of: chat); "
        "monitor mode forwards the request"
    )


async def test_explain_checks_an_opaque_token_by_introspection_live(tmp_path: Path) -> None:
    server = await IntrospectionServer().start()
    server.active("opaque-1", sub="alice", client_id="mobile")
    try:
        entry = issuer_entry(
            server.url,
            algorithms=("ES256",),
            mode="introspection",
            introspection="{client_id: gateway, client_secret: gateway-secret}",
        )
        path = write(tmp_path, feature_config(server.url, issuers=entry))
        accepted = await gateway_cli(
            "explain", "--config", path, "GET", "/orders/1", "--token", "opaque-1"
        )
        refused = await gateway_cli(
            "explain", "--config", path, "GET", "/orders/1", "--token", "opaque-2"
        )
    finally:
        await server.stop()
    assert (accepted.code, accepted.stderr) == (0, "")
    assert accepted.stdout.splitlines()[4] == f"    {server.url}: every token by introspection"
    assert accepted.stdout.splitlines()[-3:] == [
        f"token: valid — iss {server.url}, sub alice, client mobile, aud orders-api",
        "  scopes: orders:read",
        "decision: forward, with the identity headers of this token",
    ]
    assert refused.code == 1
    assert refused.stdout.splitlines()[-2:] == [
        "token: refused — the token is not active",
        "decision: 401 invalid_token",
    ]
    assert [call["form"]["token"] for call in server.calls] == ["opaque-1", "opaque-2"]
