"""refresh_token: rotation on every use, reuse detection revoking the whole family, the
optional grace window for retries, client binding, scope narrowing, idle and absolute
lifetimes, and the race of two concurrent uses."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import jwt
import pytest

from tests.authserver.admin_support import (
    Admin,
    StartAdminServer,
    admin_for,
    api,
    start_admin_server,
)
from tests.authserver.conftest import (
    REDIRECT,
    SECRET,
    MovableClock,
    RunningAuthServer,
    StartAuthServer,
    authorize_code,
    default_config,
    exchange_code,
    introspect,
    post_token,
    tokens_for,
    verify_jwt,
)

__all__ = ["start_admin_server"]  # fixtures

FULL_SCOPE = "openid profile email offline_access orders:read"


async def refresh(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    token: str,
    *,
    client_id: str = "spa",
    auth: tuple[str, str] | None = None,
    **extra: str,
) -> tuple[int, dict[str, Any]]:
    data = {"grant_type": "refresh_token", "refresh_token": token, **extra}
    if auth is None:
        data["client_id"] = client_id
    status, body, response = await post_token(http, server, data, auth=auth)
    assert response.headers["Cache-Control"] == "no-store"
    return status, body


def assert_invalid_grant(status: int, body: dict[str, Any]) -> None:
    assert (status, body.get("error")) == (400, "invalid_grant"), body
    assert "access_token" not in body


async def test_each_refresh_rotates_to_a_new_refresh_token_in_the_same_grant(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    first = await tokens_for(http, authserver)
    seen = {first["refresh_token"]}
    current = first
    for _ in range(3):
        status, current = await refresh(http, authserver, current["refresh_token"])
        assert status == 200, current
        assert current["refresh_token"] not in seen
        seen.add(current["refresh_token"])
        assert current["token_type"] == "Bearer"
        assert current["scope"] == FULL_SCOPE
    claims = await verify_jwt(http, authserver, current["access_token"], typ="at+jwt")
    original = await verify_jwt(http, authserver, first["access_token"], typ="at+jwt")
    assert claims["sub"] == original["sub"]
    assert claims["auth_time"] == original["auth_time"]
    assert claims["client_id"] == "spa"


async def test_refreshed_id_token_keeps_subject_audience_and_auth_time(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    first = await tokens_for(http, authserver)
    status, body = await refresh(http, authserver, first["refresh_token"])
    assert status == 200
    before = await verify_jwt(http, authserver, first["id_token"], audience="spa")
    after = await verify_jwt(http, authserver, body["id_token"], audience="spa")
    assert (after["iss"], after["sub"], after["aud"], after["auth_time"]) == (
        before["iss"],
        before["sub"],
        before["aud"],
        before["auth_time"],
    )
    assert "nonce" not in after


async def test_reusing_a_rotated_token_revokes_the_whole_family(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    first = await tokens_for(http, authserver)
    _, second = await refresh(http, authserver, first["refresh_token"])
    _, third = await refresh(http, authserver, second["refresh_token"])
    for body in (first, second, third):
        assert (await introspect(http, authserver, body["access_token"]))["active"] is True

    status, body = await refresh(http, authserver, first["refresh_token"])
    assert_invalid_grant(status, body)

    # The newest refresh token of the family is gone too, and every access token of it.
    status, body = await refresh(http, authserver, third["refresh_token"])
    assert_invalid_grant(status, body)
    for body in (first, second, third):
        assert await introspect(http, authserver, body["access_token"]) == {"active": False}
        assert await introspect(http, authserver, body["refresh_token"]) == {"active": False}


async def test_reuse_revokes_only_its_own_family(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    mine = await tokens_for(http, authserver)
    other = await tokens_for(http, authserver)
    await refresh(http, authserver, mine["refresh_token"])
    await refresh(http, authserver, mine["refresh_token"])  # reuse
    status, body = await refresh(http, authserver, other["refresh_token"])
    assert status == 200, body
    assert (await introspect(http, authserver, other["access_token"]))["active"] is True


async def test_concurrent_refreshes_with_one_token_give_exactly_one_success(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    authserver = await start_authserver(with_grace("0s"))
    first = await tokens_for(http, authserver)
    outcomes = await asyncio.gather(
        *(refresh(http, authserver, first["refresh_token"]) for _ in range(5))
    )
    successes = [body for status, body in outcomes if status == 200]
    failures = [body for status, body in outcomes if status != 200]
    assert len(successes) == 1
    assert len(failures) == 4
    assert all(body["error"] == "invalid_grant" for body in failures)


async def test_refresh_token_is_bound_to_its_client(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    web = await tokens_for(
        http,
        authserver,
        client_id="web",
        scope="openid offline_access orders:read",
        auth=("web", SECRET),
    )
    status, body = await refresh(http, authserver, web["refresh_token"], client_id="spa")
    assert_invalid_grant(status, body)
    # Its owner still can use it.
    status, body = await refresh(http, authserver, web["refresh_token"], auth=("web", SECRET))
    assert status == 200, body


async def test_refresh_may_narrow_the_scope_and_the_family_keeps_the_original(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    first = await tokens_for(http, authserver)
    status, narrowed = await refresh(http, authserver, first["refresh_token"], scope="orders:read")
    assert status == 200, narrowed
    assert narrowed["scope"] == "orders:read"
    assert "id_token" not in narrowed
    claims = await verify_jwt(http, authserver, narrowed["access_token"])
    assert claims["scope"] == "orders:read"
    status, later = await refresh(http, authserver, narrowed["refresh_token"])
    assert status == 200
    assert later["scope"] == FULL_SCOPE


@pytest.mark.parametrize("scope", ["openid orders:write", "orders:read admin"])
async def test_refresh_cannot_widen_the_scope_and_the_token_stays_usable(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, scope: str
) -> None:
    first = await tokens_for(http, authserver)
    status, body = await refresh(http, authserver, first["refresh_token"], scope=scope)
    assert (status, body["error"]) == (400, "invalid_scope")
    status, body = await refresh(http, authserver, first["refresh_token"])
    assert status == 200, body


@pytest.mark.parametrize("token", ["", "unknown-token", "a.b.c"])
async def test_unknown_or_missing_refresh_token_is_refused(
    authserver: RunningAuthServer, http: aiohttp.ClientSession, token: str
) -> None:
    status, body = await refresh(http, authserver, token)
    expected = "invalid_request" if token == "" else "invalid_grant"
    assert (status, body["error"]) == (400, expected)


async def test_an_access_token_is_not_a_refresh_token(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    first = await tokens_for(http, authserver)
    status, body = await refresh(http, authserver, first["access_token"])
    assert_invalid_grant(status, body)


# ---------------------------------------------------------------------------- grace window


def with_grace(grace: str) -> dict[str, Any]:
    config = default_config()
    config["refresh_grace"] = grace
    return config


async def test_retry_within_the_grace_window_repeats_the_same_response(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(with_grace("5s"))
    first = await tokens_for(http, server)
    status, once = await refresh(http, server, first["refresh_token"])
    assert status == 200
    status, again = await refresh(http, server, first["refresh_token"])
    assert status == 200
    assert again == once
    # The repeated successor is the live one: the family goes on.
    status, body = await refresh(http, server, again["refresh_token"])
    assert status == 200, body
    assert (await introspect(http, server, body["access_token"]))["active"] is True


async def test_reuse_after_the_grace_window_revokes_the_family(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    clock = MovableClock()
    server = await start_authserver(with_grace("200ms"), clock=clock)
    first = await tokens_for(http, server)
    status, second = await refresh(http, server, first["refresh_token"])
    assert status == 200
    clock.advance(0.3)
    status, body = await refresh(http, server, first["refresh_token"])
    assert_invalid_grant(status, body)
    status, body = await refresh(http, server, second["refresh_token"])
    assert_invalid_grant(status, body)
    assert await introspect(http, server, second["access_token"]) == {"active": False}


async def test_grace_retry_by_another_client_is_refused(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(with_grace("5s"))
    web = await tokens_for(
        http, server, client_id="web", scope="openid offline_access", auth=("web", SECRET)
    )
    status, _ = await refresh(http, server, web["refresh_token"], auth=("web", SECRET))
    assert status == 200
    status, body = await refresh(http, server, web["refresh_token"], client_id="spa")
    assert_invalid_grant(status, body)


async def test_concurrent_refreshes_within_grace_all_get_the_one_successor(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(with_grace("5s"))
    first = await tokens_for(http, server)
    outcomes = await asyncio.gather(
        *(refresh(http, server, first["refresh_token"]) for _ in range(3))
    )
    assert [status for status, _ in outcomes] == [200, 200, 200]
    assert len({body["refresh_token"] for _, body in outcomes}) == 1


# ---------------------------------------------------------------------------- lifetimes


async def test_refresh_token_unused_past_its_idle_lifetime_is_refused(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["lifetimes"] = {"refresh_token_idle": "300ms", "refresh_token_absolute": "1h"}
    clock = MovableClock()
    server = await start_authserver(config, clock=clock)
    first = await tokens_for(http, server)
    assert (await introspect(http, server, first["refresh_token"]))["active"] is True
    clock.advance(0.4)
    assert await introspect(http, server, first["refresh_token"]) == {"active": False}
    status, body = await refresh(http, server, first["refresh_token"])
    assert_invalid_grant(status, body)


async def test_idle_expiry_slides_with_each_use(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["lifetimes"] = {"refresh_token_idle": "400ms", "refresh_token_absolute": "1h"}
    clock = MovableClock()
    server = await start_authserver(config, clock=clock)
    current = await tokens_for(http, server)
    for _ in range(3):  # 750 ms in all, each use within the idle window of the previous
        clock.advance(0.25)
        status, current = await refresh(http, server, current["refresh_token"])
        assert status == 200, current


async def test_family_ends_at_its_absolute_lifetime_however_often_it_is_used(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["lifetimes"] = {"refresh_token_idle": "400ms", "refresh_token_absolute": "700ms"}
    clock = MovableClock()
    server = await start_authserver(config, clock=clock)
    current = await tokens_for(http, server)
    clock.advance(0.25)
    status, current = await refresh(http, server, current["refresh_token"])
    assert status == 200
    clock.advance(0.25)
    status, current = await refresh(http, server, current["refresh_token"])
    assert status == 200
    # Used 300 ms ago, within the idle window, but the family is 800 ms old.
    clock.advance(0.3)
    status, body = await refresh(http, server, current["refresh_token"])
    assert_invalid_grant(status, body)


async def test_refresh_response_for_plain_oauth_has_no_id_token(
    authserver: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    first = await tokens_for(http, authserver, scope="orders:read")
    status, body = await refresh(http, authserver, first["refresh_token"])
    assert status == 200
    assert set(body) == {"access_token", "token_type", "expires_in", "scope", "refresh_token"}
    assert jwt.get_unverified_header(body["access_token"])["typ"] == "at+jwt"


# ---------------------------------------------------------------------------- retries


async def test_by_default_a_retry_within_seconds_gets_the_same_response_and_then_not(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    # The response to a rotation can be lost after the rotation was committed (a dropped
    # connection, the server killed): the client's retry must not log the user out.
    clock = MovableClock()
    server = await start_authserver(clock=clock)
    first = await tokens_for(http, server)
    status, once = await refresh(http, server, first["refresh_token"])
    assert status == 200, once

    clock.advance(4.9)
    status, again = await refresh(http, server, first["refresh_token"])
    assert (status, again) == (200, once)

    clock.advance(0.1)  # 5 s after the rotation: the default grace is over
    status, body = await refresh(http, server, first["refresh_token"])
    assert_invalid_grant(status, body)
    assert await introspect(http, server, once["access_token"]) == {"active": False}
    status, body = await refresh(http, server, once["refresh_token"])
    assert_invalid_grant(status, body)


async def test_once_the_successor_was_used_the_old_token_is_reuse_even_within_grace(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(with_grace("10s"), clock=MovableClock())
    first = await tokens_for(http, server)
    _, second = await refresh(http, server, first["refresh_token"])
    status, third = await refresh(http, server, second["refresh_token"])
    assert status == 200, third

    # The client surely got `second`: it used it. `first` again is a replay.
    status, body = await refresh(http, server, first["refresh_token"])
    assert_invalid_grant(status, body)
    status, body = await refresh(http, server, third["refresh_token"])
    assert_invalid_grant(status, body)
    assert await introspect(http, server, third["access_token"]) == {"active": False}


async def test_with_refresh_grace_zero_any_second_use_is_reuse(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(with_grace("0s"), clock=MovableClock())
    first = await tokens_for(http, server)
    _, once = await refresh(http, server, first["refresh_token"])
    status, body = await refresh(http, server, first["refresh_token"])
    assert_invalid_grant(status, body)
    assert await introspect(http, server, once["access_token"]) == {"active": False}


# ---------------------------------------------------------------- the client's registration now
#
# Refresh issues at most what the family was granted and the client is still registered
# for (RFC 6749 §6): its clients are changed through the admin API, on SQLite and PostgreSQL.

SHOP_SCOPE = "openid offline_access orders:read orders:write"


async def shop_client(
    admin: Admin, scope: str = SHOP_SCOPE, resources: tuple[str, ...] = ("billing-api",)
) -> None:
    """`shop`, a public client made through the API (the file's are read-only there)."""
    status, body, _ = await admin.post(
        "/clients",
        {
            "clientId": "shop",
            "tokenEndpointAuthMethod": "none",
            "redirectUris": [REDIRECT],
            "grantTypes": ["authorization_code", "refresh_token"],
            "scope": scope,
            "resources": list(resources),
            "skipConsent": True,
        },
    )
    assert status == 201, body


async def shop_tokens(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    scope: str = SHOP_SCOPE,
    resource: str | None = None,
) -> dict[str, Any]:
    extra = {"resource": resource} if resource is not None else None
    result = await authorize_code(http, server, client_id="shop", scope=scope, extra=extra)
    status, body = await exchange_code(http, server, result, client_id="shop")
    assert status == 200, body
    return body


async def test_refresh_narrows_to_the_scopes_the_client_is_still_registered_for(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    server = await start_admin_server()
    admin = await admin_for(http, server)
    await shop_client(admin)
    first = await shop_tokens(http, server)
    assert first["scope"] == SHOP_SCOPE
    status, body, _ = await admin.patch(
        "/clients/shop", {"scope": "openid offline_access orders:read"}
    )
    assert status == 200, body

    status, second = await refresh(http, server, first["refresh_token"], client_id="shop")
    assert status == 200, second
    assert second["scope"] == "openid offline_access orders:read"
    claims = jwt.decode(second["access_token"], options={"verify_signature": False})
    assert claims["scope"] == "openid offline_access orders:read"
    # Asked for by name, the scope the client lost is refused, and the token stays usable.
    status, body = await refresh(
        http, server, second["refresh_token"], client_id="shop", scope="orders:write"
    )
    assert (status, body["error"]) == (400, "invalid_scope"), body
    # Given back to the client, it is not given back to the family: the grant was narrowed.
    assert (await admin.patch("/clients/shop", {"scope": SHOP_SCOPE}))[0] == 200
    status, third = await refresh(http, server, second["refresh_token"], client_id="shop")
    assert status == 200, third
    assert third["scope"] == "openid offline_access orders:read"


@pytest.mark.parametrize(
    ("granted", "left"),
    [
        ("orders:read orders:write", "openid offline_access"),  # none of the grant's
        ("openid offline_access orders:read", "openid orders:read"),  # offline_access lost
    ],
)
async def test_refresh_is_refused_when_the_client_lost_what_the_refresh_stands_on(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession, granted: str, left: str
) -> None:
    server = await start_admin_server()
    admin = await admin_for(http, server)
    await shop_client(admin)
    first = await shop_tokens(http, server, scope=granted)
    assert (await admin.patch("/clients/shop", {"scope": left}))[0] == 200
    status, body = await refresh(http, server, first["refresh_token"], client_id="shop")
    assert (status, body["error"]) == (400, "invalid_scope"), body
    assert "access_token" not in body


async def test_refresh_is_refused_for_a_resource_the_client_lost_or_the_grant_lacks(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    server = await start_admin_server()
    admin = await admin_for(http, server)
    await shop_client(admin, resources=("billing-api", "shipping-api"))
    first = await shop_tokens(http, server, resource="billing-api")
    # RFC 8707 §2.2: a refresh may name a resource of the grant, and no other.
    status, body = await refresh(
        http, server, first["refresh_token"], client_id="shop", resource="shipping-api"
    )
    assert (status, body["error"]) == (400, "invalid_target"), body
    status, second = await refresh(
        http, server, first["refresh_token"], client_id="shop", resource="billing-api"
    )
    assert status == 200, second
    claims = jwt.decode(second["access_token"], options={"verify_signature": False})
    assert claims["aud"] == "billing-api"

    assert (await admin.patch("/clients/shop", {"resources": ["shipping-api"]}))[0] == 200
    status, body = await refresh(http, server, second["refresh_token"], client_id="shop")
    assert (status, body["error"]) == (400, "invalid_target"), body
    assert "access_token" not in body


async def test_refresh_for_the_admin_api_follows_the_clients_registration(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    server = await start_admin_server()
    admin = await admin_for(http, server)
    scope = "openid offline_access admin:read admin:write"
    await shop_client(admin, scope=scope, resources=(api(server),))
    first = await shop_tokens(http, server, scope=scope, resource=api(server))
    assert (await admin.patch("/clients/shop", {"scope": "openid offline_access admin:read"}))[
        0
    ] == 200
    status, second = await refresh(http, server, first["refresh_token"], client_id="shop")
    assert status == 200, second
    assert second["scope"] == "openid offline_access admin:read"

    assert (await admin.patch("/clients/shop", {"resources": []}))[0] == 200
    status, body = await refresh(http, server, second["refresh_token"], client_id="shop")
    assert (status, body["error"]) == (400, "invalid_target"), body


async def test_a_retry_within_the_grace_does_not_repeat_what_the_client_lost_since(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    server = await start_admin_server(clock=MovableClock())
    admin = await admin_for(http, server)
    await shop_client(admin)
    first = await shop_tokens(http, server)
    status, lost = await refresh(http, server, first["refresh_token"], client_id="shop")
    assert status == 200 and lost["scope"] == SHOP_SCOPE, lost
    status, body, _ = await admin.patch(
        "/clients/shop", {"scope": "openid offline_access orders:read"}
    )
    assert status == 200, body
    status, body = await refresh(http, server, first["refresh_token"], client_id="shop")
    assert_invalid_grant(status, body)
