"""The two deployables together: tokens from the authorization server pass the gateway, and
what must not pass does not. Both run on 127.0.0.1 over real HTTP; the gateway finds the
authorization server's keys through its discovery document, as it would any issuer's."""

from __future__ import annotations

from tests.authserver.conftest import (
    client_credentials,
    default_config,
    tokens_for,
)
from tests.support import (
    UNBOUND_ADMIN_LISTEN,
    UNBOUND_LISTEN,
    EchoUpstream,
    ManualClock,
    header_values,
    running_gateway,
)

ROUTES = """
  - {name: orders-read, path: "/orders/**", methods: [GET], scopes: {any: ["orders:read"]}}
  - {name: orders-write, path: "/orders/**", methods: [POST], scopes: {all: ["orders:write"]}}
"""


def gateway_config(issuer: str, upstream: str, leeway: str = "30s") -> str:
    return f"""
listen: "{UNBOUND_LISTEN}"
admin_listen: "{UNBOUND_ADMIN_LISTEN}"
upstream: {{url: "{upstream}"}}
issuers:
  - {{issuer: "{issuer}", audiences: [orders-api], algorithms: [ES256], leeway: {leeway}}}
routes:
{ROUTES}
"""


async def get(http, url: str, token: str):
    async with http.get(url, headers={"Authorization": f"Bearer {token}"}) as response:
        return response.status, response.headers, await response.read()


async def test_a_machine_token_from_the_authserver_passes_the_gateway(start_authserver, http):
    server = await start_authserver()
    upstream = await EchoUpstream().start()
    try:
        async with running_gateway(gateway_config(server.url, upstream.url)) as gateway:
            status, body = await client_credentials(http, server, scope="orders:read")
            assert status == 200
            code, _, _ = await get(http, gateway.url + "/orders", body["access_token"])
            assert code == 200
            seen = upstream.requests[-1]
            assert header_values(seen, "X-Auth-Subject") == ["machine"]
            assert header_values(seen, "X-Auth-Client-Id") == ["machine"]
            assert header_values(seen, "X-Auth-Scopes") == ["orders:read"]
            assert header_values(seen, "X-Auth-Issuer") == [server.settings.issuer]
            # The same token lacks orders:write: 403 with the scope named.
            async with http.post(
                gateway.url + "/orders", headers={"Authorization": f"Bearer {body['access_token']}"}
            ) as response:
                assert response.status == 403
                assert 'scope="orders:write"' in response.headers["WWW-Authenticate"]
    finally:
        await upstream.stop()


async def test_a_user_token_carries_the_users_opaque_subject_and_other_tokens_are_refused(
    start_authserver, http
):
    server = await start_authserver()
    upstream = await EchoUpstream().start()
    try:
        async with running_gateway(gateway_config(server.url, upstream.url)) as gateway:
            tokens = await tokens_for(http, server)
            code, _, _ = await get(http, gateway.url + "/orders/7", tokens["access_token"])
            assert code == 200
            subject = header_values(upstream.requests[-1], "X-Auth-Subject")
            assert subject == [server.subject("alice")]
            assert "@" not in subject[0]
            forwarded = len(upstream.requests)
            # SPEC: the resource server rejects refresh tokens and ID tokens.
            for other in (tokens["id_token"], tokens["refresh_token"]):
                code, headers, _ = await get(http, gateway.url + "/orders/7", other)
                assert code == 401
                assert 'error="invalid_token"' in headers["WWW-Authenticate"]
            assert len(upstream.requests) == forwarded
    finally:
        await upstream.stop()


async def test_a_token_for_another_audience_is_refused(start_authserver, http):
    server = await start_authserver()
    upstream = await EchoUpstream().start()
    try:
        async with running_gateway(gateway_config(server.url, upstream.url)) as gateway:
            status, body = await client_credentials(
                http, server, scope="orders:read", resource="billing-api"
            )
            assert status == 200, body
            code, headers, _ = await get(http, gateway.url + "/orders", body["access_token"])
            assert code == 401
            assert "audience" in headers["WWW-Authenticate"]
            assert upstream.requests == []
    finally:
        await upstream.stop()


async def test_an_expired_token_from_the_authserver_is_refused(start_authserver, http):
    config = default_config()
    config["lifetimes"] = {"access_token": "1s"}
    server = await start_authserver(config)
    upstream = await EchoUpstream().start()
    manual = ManualClock()  # the gateway's time; the token's lifetime passes when it moves
    try:
        async with running_gateway(
            gateway_config(server.url, upstream.url, leeway="0s"), clock=manual.clock
        ) as gateway:
            status, body = await client_credentials(http, server, scope="orders:read")
            assert status == 200
            manual.catch_up()  # leeway 0s: the token's iat must not be ahead of the gateway
            code, _, _ = await get(http, gateway.url + "/orders", body["access_token"])
            assert code == 200  # valid, and now in the gateway's verified-token cache
            manual.advance(2.1)
            code, headers, _ = await get(http, gateway.url + "/orders", body["access_token"])
            assert code == 401
            assert 'error_description="the token has expired"' in headers["WWW-Authenticate"]
            assert len(upstream.requests) == 1
    finally:
        await upstream.stop()
