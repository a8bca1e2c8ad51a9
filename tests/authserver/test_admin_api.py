"""The admin API over real HTTP, on SQLite and on PostgreSQL: who may call it, the
resources, the collection conventions, HTTP semantics, and that every change is in force at
once (tokens, sign-in, introspection)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import jwt
import pytest

from authserver import settings as authserver_settings
from authserver.app import AuthServer, build_app
from authserver.store.base import IdentityLink
from tests.authserver.admin_support import (
    Admin,
    StartAdminServer,
    admin_config,
    admin_for,
    admin_server,
    api,
    start_admin_server,
)
from tests.authserver.conftest import (
    PASSWORD,
    REDIRECT,
    SECRET,
    MovableClock,
    RunningAuthServer,
    _key_template,
    authorize_code,
    basic_auth,
    client_credentials,
    exchange_code,
    introspect,
    post_token,
    tokens_for,
)
from tests.authserver.process_support import write_config
from tests.support import bound_socket, start_site

__all__ = ["admin_server", "start_admin_server"]  # fixtures


def codes(body: Any) -> str:
    return str(body["error"]["code"])


def fields_of(body: Any) -> set[str]:
    return {d["field"] for d in body["error"]["details"]}


async def user_token(
    http: aiohttp.ClientSession, server: RunningAuthServer, username: str, password: str = PASSWORD
) -> dict[str, Any]:
    """A code flow through the console client, asking for the admin API's audience."""
    result = await authorize_code(
        http,
        server,
        client_id="console",
        scope="openid roles offline_access admin:read admin:write",
        username=username,
        password=password,
        extra={"resource": api(server)},
    )
    status, body = await exchange_code(http, server, result, client_id="console")
    assert status == 200, body
    return body


# ---------------------------------------------------------------------------- who may call


async def test_without_a_token_the_api_answers_401_with_a_bearer_challenge(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    async with http.get(api(admin_server, "/clients")) as response:
        assert response.status == 401
        assert response.headers["WWW-Authenticate"].startswith("Bearer ")
        body = await response.json()
    assert codes(body) == "unauthorized"
    assert set(body["error"]) == {"code", "message", "details"}


async def test_a_token_for_another_audience_is_refused_as_invalid(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    # admin-cli's token without resource= has the default audience, not the admin API.
    status, body = await client_credentials(http, admin_server, client_id="admin-cli")
    assert status == 200, body
    other = Admin(http, admin_server, body["access_token"])
    status, answer, response = await other.get("/clients")
    assert status == 401 and codes(answer) == "invalid_token"
    assert 'error="invalid_token"' in response.headers["WWW-Authenticate"]
    junk = Admin(http, admin_server, "not-a-token")
    assert (await junk.get("/clients"))[0] == 401


async def test_admin_read_reads_and_only_admin_write_changes(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    reader = await admin_for(http, admin_server, "admin-reader")
    assert (await reader.get("/clients"))[0] == 200
    status, body, response = await reader.post("/clients", {"grantTypes": ["client_credentials"]})
    assert status == 403 and codes(body) == "insufficient_scope"
    assert 'scope="admin:write"' in response.headers["WWW-Authenticate"]


async def test_admin_scopes_go_only_to_clients_registered_with_them(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    status, body = await client_credentials(
        http, admin_server, client_id="machine", scope="admin:write"
    )
    assert status == 400 and body["error"] == "invalid_scope"
    status, body = await client_credentials(
        http, admin_server, client_id="machine", resource=api(admin_server)
    )
    assert status == 400 and body["error"] == "invalid_target"


async def test_a_user_token_needs_the_admin_role(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    alice = await user_token(http, admin_server, "alice")
    status, body, _ = await Admin(http, admin_server, alice["access_token"]).get("/users")
    assert status == 200, body
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other:
        bob = await user_token(other, admin_server, "bob")
    status, body, _ = await Admin(http, admin_server, bob["access_token"]).get("/users")
    assert status == 403 and codes(body) == "forbidden"


async def test_a_revoked_token_is_refused(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    assert (await admin.get("/clients"))[0] == 200
    response = await http.post(
        admin_server.endpoint("/revoke"),
        data={"token": admin.token},
        headers={"Authorization": basic_auth("admin-cli", SECRET)},
    )
    assert response.status == 200
    status, body, _ = await admin.get("/clients")
    assert status == 401 and codes(body) == "invalid_token"


# ---------------------------------------------------------------------------- clients


async def test_a_created_client_gets_its_secret_once_and_a_token_at_once_on_every_replica(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    server = await start_admin_server()
    replica = await start_admin_server()  # another process on the same database
    admin = await admin_for(http, server)
    status, created, response = await admin.post(
        "/clients",
        {
            "clientId": "billing",
            "clientName": "Billing",
            "grantTypes": ["client_credentials"],
            "scope": "orders:read",
        },
    )
    assert status == 201, created
    assert response.headers["Location"] == api(server, "/clients/billing")
    assert (
        created["managedBy"] == "api"
        and created["tokenEndpointAuthMethod"] == "client_secret_basic"
    )
    secret = created["clientSecret"]
    response = await http.post(
        replica.url + "/token",
        data={"grant_type": "client_credentials"},
        headers={"Authorization": basic_auth("billing", secret)},
    )
    assert response.status == 200, await response.text()
    status, shown, _ = await admin.get("/clients/billing")
    assert status == 200 and "clientSecret" not in shown
    assert shown == {k: v for k, v in created.items() if k != "clientSecret"}
    # Rotated through one replica, the old secret is refused by the other at once.
    status, rotated, _ = await admin.post("/clients/billing/secret")
    assert status == 200
    for secret_now, expected in ((secret, 401), (rotated["clientSecret"], 200)):
        response = await http.post(
            replica.url + "/token",
            data={"grant_type": "client_credentials"},
            headers={"Authorization": basic_auth("billing", secret_now)},
        )
        assert response.status == expected, await response.text()


async def test_a_rotated_secret_is_refused_at_once_and_what_it_got_ends(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    # Access tokens carry their issue time in whole seconds, and a rotation cuts off its
    # own second: the server's clock is moved to the next ones.
    clock = MovableClock()
    server = await start_admin_server(clock=clock)
    admin = await admin_for(http, server)
    _, created, _ = await admin.post(
        "/clients", {"clientId": "app", "grantTypes": ["client_credentials"]}
    )
    old = created["clientSecret"]
    status, token = await client_credentials(http, server, client_id="app", secret=old)
    assert status == 200
    clock.advance(1)
    status, rotated, _ = await admin.post("/clients/app/secret")
    assert status == 200, rotated
    assert rotated["clientSecret"] != old
    status, body = await client_credentials(http, server, client_id="app", secret=old)
    assert status == 401 and body["error"] == "invalid_client"
    assert (await introspect(http, server, token["access_token"]))["active"] is False
    clock.advance(1)  # a token of the rotation's second is refused too
    status, fresh = await client_credentials(
        http, server, client_id="app", secret=rotated["clientSecret"]
    )
    assert status == 200
    assert (await introspect(http, server, fresh["access_token"]))["active"] is True


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("client_secret_basic", "none"),
        ("client_secret_basic", "client_secret_post"),
        ("none", "client_secret_basic"),
    ],
)
async def test_changing_the_authentication_method_ends_what_the_old_one_got(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession, before: str, after: str
) -> None:
    # A refresh token obtained with the secret must not go on working with the client_id
    # alone once the client is made public (RFC 9700 §4.14.2): any change of method cuts
    # the client off, as rotating its secret does.
    server = await start_admin_server()
    admin = await admin_for(http, server)
    status, created, _ = await admin.post(
        "/clients",
        {
            "clientId": "app",
            "tokenEndpointAuthMethod": before,
            "redirectUris": [REDIRECT],
            "grantTypes": ["authorization_code", "refresh_token"],
            "scope": "openid offline_access orders:read",
            "skipConsent": True,
        },
    )
    assert status == 201, created
    secret = created.get("clientSecret")
    scope = "openid offline_access orders:read"
    old_auth = ("app", secret) if secret else None
    tokens = await tokens_for(http, server, client_id="app", scope=scope, auth=old_auth)

    status, changed, _ = await admin.patch("/clients/app", {"tokenEndpointAuthMethod": after})
    assert status == 200 and changed["tokenEndpointAuthMethod"] == after, changed
    refresh = {"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]}
    if after == "none":
        status, body, _ = await post_token(http, server, {**refresh, "client_id": "app"})
    elif after == "client_secret_post":
        form = {**refresh, "client_id": "app", "client_secret": secret}
        status, body, _ = await post_token(http, server, form)
    else:
        auth = ("app", changed["clientSecret"])
        status, body, _ = await post_token(http, server, refresh, auth=auth)
    assert (status, body.get("error")) == (400, "invalid_grant"), body
    assert (await introspect(http, server, tokens["access_token"]))["active"] is False
    events = await server.services.store.revocation_events(0, time.time(), 100)
    assert [e.reason for e in events if e.key == "app"] == ["client_auth_method_changed"]


async def test_a_deleted_client_is_refused_and_its_tokens_are_inactive(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    clock = MovableClock()
    admin_server = await start_admin_server(clock=clock)
    admin = await admin_for(http, admin_server)
    _, created, _ = await admin.post(
        "/clients",
        {
            "clientId": "shop",
            "redirectUris": [REDIRECT],
            "grantTypes": ["authorization_code", "refresh_token", "client_credentials"],
            "scope": "openid offline_access orders:read",
            "skipConsent": True,
        },
    )
    secret = created["clientSecret"]
    _, machine = await client_credentials(http, admin_server, client_id="shop", secret=secret)
    user = await tokens_for(
        http,
        admin_server,
        client_id="shop",
        scope="openid offline_access orders:read",
        auth=("shop", secret),
    )
    status, _, _ = await admin.delete("/clients/shop")
    assert status == 204
    events = await admin_server.services.store.revocation_events(0, clock(), 100)
    assert [(e.key, e.reason) for e in events if e.key == "shop"] == [("shop", "client_deleted")]
    assert (await admin.get("/clients/shop"))[0] == 404
    for token in (machine["access_token"], user["access_token"]):
        assert (await introspect(http, admin_server, token))["active"] is False
    status, body, _ = await post_token(
        http,
        admin_server,
        {"grant_type": "refresh_token", "refresh_token": user["refresh_token"]},
        auth=("shop", secret),
    )
    assert status == 401 and body["error"] == "invalid_client"
    # Made again with the same id (a second later), the client does not bring the old
    # tokens back.
    clock.advance(1)
    await admin.post("/clients", {"clientId": "shop", "grantTypes": ["client_credentials"]})
    assert (await introspect(http, admin_server, machine["access_token"]))["active"] is False


async def test_clients_of_the_configuration_are_listed_but_read_only(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    status, web_client, _ = await admin.get("/clients/web")
    assert status == 200 and web_client["managedBy"] == "config"
    assert "clientSecret" not in web_client
    for status, body, _ in (
        await admin.patch("/clients/web", {"clientName": "Changed"}),
        await admin.delete("/clients/web"),
        await admin.post("/clients/web/secret"),
    ):
        assert status == 409 and codes(body) == "managed_by_config"


async def test_client_validation_uses_the_configuration_rules_with_json_paths(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    status, body, _ = await admin.post(
        "/clients",
        {
            "redirectUris": ["https://ok.example/cb", "http://evil.example/cb"],
            "grantTypes": ["authorization_code", "password"],
            "scope": "openid nonsense",
            "tokenEndpointAuthMethod": "none",
            "requirePkce": False,
            "colour": "blue",
        },
    )
    assert status == 422 and codes(body) == "validation_error"
    assert fields_of(body) == {"colour"}  # an unknown field first, alone
    status, body, _ = await admin.post(
        "/clients",
        {
            "redirectUris": ["https://ok.example/cb", "http://evil.example/cb"],
            "grantTypes": ["authorization_code", "password"],
            "tokenEndpointAuthMethod": "none",
            "requirePkce": False,
        },
    )
    assert status == 422
    found = fields_of(body)
    assert {"redirectUris[1]", "grantTypes[1]", "requirePkce"} <= found, body
    issues = " ".join(d["issue"] for d in body["error"]["details"])
    assert "loopback" in issues and "config" not in issues
    # The accepted values are named as they are sent, the device grant's URN whole.
    (grant,) = [d["issue"] for d in body["error"]["details"] if d["field"] == "grantTypes[1]"]
    assert "urn:ietf:params:oauth:grant-type:device_code" in grant, grant
    assert "deviceCode" not in grant and "clientCredentials" not in grant
    status, body, _ = await admin.post(
        "/clients", {"grantTypes": ["client_credentials"], "scope": "openid nonsense"}
    )
    assert status == 422 and fields_of(body) == {"scope"}
    status, body, _ = await admin.post("/clients", {"grantTypes": ["authorization_code"]})
    assert status == 422, body


async def test_a_duplicate_client_id_is_a_conflict(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    status, body, _ = await admin.post(
        "/clients", {"clientId": "web", "grantTypes": ["client_credentials"]}
    )
    assert status == 409 and codes(body) == "conflict"


async def test_etags_conditional_requests_merge_patch_and_put(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    _, _, response = await admin.post(
        "/clients",
        {
            "clientId": "tool",
            "clientName": "Tool",
            "grantTypes": ["client_credentials"],
            "resources": ["a", "b"],
        },
    )
    etag = response.headers["ETag"]
    status, _, response = await admin.get("/clients/tool", headers={"If-None-Match": etag})
    assert status == 304 and response.headers["ETag"] == etag
    status, patched, response = await admin.patch(
        "/clients/tool", {"clientName": "Tool 2", "resources": None}, headers={"If-Match": etag}
    )
    assert status == 200, patched
    assert (patched["clientName"], patched["resources"]) == ("Tool 2", [])
    assert response.headers["ETag"] != etag
    status, body, _ = await admin.patch(
        "/clients/tool", {"clientName": "Lost"}, headers={"If-Match": etag}
    )
    assert status == 412 and codes(body) == "precondition_failed"
    status, replaced, _ = await admin.put(
        "/clients/tool", {"grantTypes": ["client_credentials"], "scope": "orders:read"}
    )
    assert status == 200
    assert (replaced["clientName"], replaced["scope"]) == ("tool", "orders:read")
    status, body, _ = await admin.call("PATCH", "/clients/tool", {"clientName": "x"})  # plain JSON
    assert status == 415
    status, body, _ = await admin.patch("/clients/tool", {"clientId": "renamed"})
    assert status == 422 and fields_of(body) == {"clientId"}
    status, body, _ = await admin.patch("/clients/tool", {"clientSecret": "mine"})
    assert status == 422 and fields_of(body) == {"clientSecret"}


async def test_bad_json_wrong_accept_unknown_paths_and_methods(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    status, body, _ = await admin.call("POST", "/clients", data=b"{not json")
    assert status == 400 and codes(body) == "bad_request"
    status, body, _ = await admin.call("POST", "/clients", data=b"[1, 2]")
    assert status == 422
    status, body, _ = await admin.get("/clients", headers={"Accept": "text/html"})
    assert status == 406 and codes(body) == "not_acceptable"
    assert (await admin.get("/clients", headers={"Accept": "text/html, application/json;q=0.5"}))[
        0
    ] == 200
    status, body, _ = await admin.get("/widgets")
    assert status == 404 and codes(body) == "not_found"
    assert (await admin.get("/clients/nobody"))[0] == 404
    status, body, response = await admin.delete("/clients")
    assert status == 405 and "POST" in response.headers["Allow"]


# ---------------------------------------------------------------------------- collections


async def test_cursor_paging_is_stable_while_items_come_and_go(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    for name in ("c1", "c2", "c3", "c4", "c5", "c6"):
        await admin.post("/clients", {"clientId": name, "grantTypes": ["client_credentials"]})
    params = {"managedBy": "api", "limit": "2", "sort": "-clientId"}
    status, first, _ = await admin.get("/clients", params=params)
    assert status == 200, first
    assert [c["clientId"] for c in first["data"]] == ["c6", "c5"]
    assert first["pagination"]["hasMore"] is True
    # Meanwhile: one already seen is deleted, one is added before, one after.
    await admin.delete("/clients/c6")
    await admin.post("/clients", {"clientId": "c7", "grantTypes": ["client_credentials"]})
    await admin.post("/clients", {"clientId": "c0", "grantTypes": ["client_credentials"]})
    seen = [c["clientId"] for c in first["data"]]
    cursor = first["pagination"]["nextCursor"]
    while cursor:
        status, page, _ = await admin.get("/clients", params={**params, "cursor": cursor})
        assert status == 200, page
        seen += [c["clientId"] for c in page["data"]]
        cursor = page["pagination"]["nextCursor"]
        assert page["pagination"]["hasMore"] is (cursor is not None)
    assert seen == ["c6", "c5", "c4", "c3", "c2", "c1", "c0"]
    status, body, _ = await admin.get(
        "/clients", params={"cursor": first["pagination"]["nextCursor"]}
    )
    assert status == 422 and fields_of(body) == {"cursor"}  # made for another sort
    assert (await admin.get("/clients", params={"cursor": "garbage"}))[0] == 422


async def test_filters_or_search_fields_and_limits(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    params = [("clientId", "web"), ("clientId", "spa"), ("fields", "clientId,managedBy")]
    status, body, _ = await admin.get("/clients", params=params)
    assert status == 200
    assert body["data"] == [
        {"clientId": "spa", "managedBy": "config"},
        {"clientId": "web", "managedBy": "config"},
    ]
    status, body, _ = await admin.get("/clients", params={"q": "SINGLE page", "fields": "clientId"})
    assert body["data"] == [{"clientId": "spa"}]
    status, body, _ = await admin.get(
        "/clients",
        params={"grantTypes": "client_credentials", "tokenEndpointAuthMethod": "private_key_jwt"},
    )
    assert [c["clientId"] for c in body["data"]] == ["machine-jwt"]
    status, body, _ = await admin.get("/clients", params={"limit": "1000"})
    assert status == 200 and body["pagination"]["hasMore"] is False  # clamped to 200
    for bad in (
        {"limit": "0"},
        {"limit": "x"},
        {"sort": "secret"},
        {"fields": "nope"},
        {"colour": "red"},
    ):
        status, body, _ = await admin.get("/clients", params=bad)
        assert status == 422 and codes(body) == "validation_error", bad
        assert fields_of(body) == {next(iter(bad))}
    status, body, _ = await admin.get("/clients", params={"limit": "3"})
    assert len(body["data"]) == 3 and body["pagination"]["hasMore"] is True


# ---------------------------------------------------------------------------- users


async def test_a_user_created_through_the_api_signs_in_and_gets_roles(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    status, created, response = await admin.post(
        "/users",
        {
            "username": "carol",
            "password": "correct horse",
            "email": "carol@example.com",
            "roles": ["admin"],
            "givenName": "Carol",
        },
    )
    assert status == 201, created
    assert "password" not in created and "passwordHash" not in created
    assert response.headers["Location"] == api(
        admin_server, f"/users/{quote(created['id'], safe='')}"
    )
    assert (created["username"], created["givenName"], created["roles"]) == (
        "carol",
        "Carol",
        ["admin"],
    )
    tokens = await user_token(http, admin_server, "carol", "correct horse")
    id_claims = jwt.decode(tokens["id_token"], options={"verify_signature": False})
    access_claims = jwt.decode(tokens["access_token"], options={"verify_signature": False})
    assert id_claims["sub"] == created["id"]
    assert id_claims["roles"] == ["admin"] and access_claims["roles"] == ["admin"]
    metadata = await (
        await http.get(admin_server.endpoint("/.well-known/openid-configuration"))
    ).json()
    assert "roles" in metadata["scopes_supported"] and "roles" in metadata["claims_supported"]
    # The role opens the admin API to her own token.
    assert (await Admin(http, admin_server, tokens["access_token"]).get("/users"))[0] == 200


async def test_passwords_follow_their_rules_and_never_show(
    admin_server: RunningAuthServer,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    admin = await admin_for(http, admin_server)
    for password, issue in (
        ("short", "at least 8"),
        ("dianadiana", "username"),
        (12345678, "string"),
    ):
        status, body, _ = await admin.post(
            "/users", {"username": "dianadiana", "password": password}
        )
        assert status == 422 and fields_of(body) == {"password"}, body
        assert issue in body["error"]["details"][0]["issue"]
    status, body, _ = await admin.post("/users", {"username": "diana"})
    assert status == 422 and fields_of(body) == {"password"}
    caplog.set_level(logging.INFO)
    _, created, _ = await admin.post("/users", {"username": "diana", "password": "first-secret-1"})
    user = f"/users/{quote(created['id'], safe='')}"
    status, body, _ = await admin.post(user + "/password", {"password": "second-secret-2"})
    assert status == 204
    status, body, _ = await admin.post(user + "/password", {"password": "diana"})
    assert status == 422
    status, body, _ = await admin.post("/users", {"username": "diana", "password": "another-one-3"})
    assert status == 409
    await asyncio.sleep(0)  # the audit lines go out at the end of the loop's turn
    written = capsys.readouterr().err
    for logged in (caplog.text, written):
        assert "first-secret-1" not in logged and "second-secret-2" not in logged
    lines = [json.loads(line) for line in written.splitlines() if line.startswith("{")]
    audit = [
        line
        for line in lines
        if line["logger"] == "portcullis.authserver.audit" and line["event"].startswith("user.")
    ]
    assert [e["event"] for e in audit] == ["user.created", "user.password_set"]
    assert all(
        (e["actor"], e["actor_client_id"], e["subject"]) == ("admin", "admin-cli", created["id"])
        for e in audit
    )
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other:
        await user_token(other, admin_server, "diana", "second-secret-2")


async def test_disabling_a_user_ends_sessions_grants_and_sign_in(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    _, created, _ = await admin.post("/users", {"username": "erin", "password": "erin-password"})
    path = f"/users/{quote(created['id'], safe='')}"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        result = await authorize_code(
            browser, admin_server, username="erin", password="erin-password"
        )
        status, tokens = await exchange_code(browser, admin_server, result)
        assert status == 200, tokens
        status, grants, _ = await admin.get("/grants", params={"subject": created["id"]})
        assert status == 200 and [g["clientId"] for g in grants["data"]] == ["spa"]
        status, disabled, _ = await admin.patch(path, {"disabled": True})
        assert status == 200 and disabled["disabled"] is True
        # Resource servers are told: the cut-off is a revocation event.
        events = await admin_server.services.store.revocation_events(0, time.time(), 100)
        assert [(e.kind.value, e.key, e.reason) for e in events if e.key == created["id"]] == [
            ("subject", created["id"], "user_disabled")
        ]
        assert (await introspect(http, admin_server, tokens["access_token"]))["active"] is False
        status, body, _ = await post_token(
            http,
            admin_server,
            {
                "grant_type": "refresh_token",
                "refresh_token": tokens["refresh_token"],
                "client_id": "spa",
            },
        )
        assert status == 400 and body["error"] == "invalid_grant"
        # The session is gone: the next authorization asks to sign in, and signing in fails.
        with pytest.raises(AssertionError):
            await authorize_code(browser, admin_server, username="erin", password="erin-password")
    status, grants, _ = await admin.get("/grants", params={"subject": created["id"]})
    assert grants["data"][0]["revokedAt"] is not None
    assert (await admin.delete(path))[0] == 204
    assert (await admin.get(path))[0] == 404


async def test_users_of_the_configuration_are_read_only_and_usernames_unique(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    status, listed, _ = await admin.get("/users", params={"username": "alice"})
    [alice] = listed["data"]
    assert (alice["managedBy"], alice["roles"], alice["email"]) == (
        "config",
        ["admin", "auditor"],
        "alice@example.com",
    )
    path = f"/users/{quote(alice['id'], safe='')}"
    status, body, _ = await admin.patch(path, {"disabled": True})
    assert status == 409 and codes(body) == "managed_by_config"
    status, body, _ = await admin.post("/users", {"username": "alice", "password": "whatever-1"})
    assert status == 409
    status, body, _ = await admin.post(
        "/users",
        {
            "username": "",
            "password": "whatever-1",
            "roles": [""],
            "emailVerified": "yes",
            "disabled": "no",
        },
    )
    assert status == 422 and {"username", "roles[0]", "emailVerified", "disabled"} <= fields_of(
        body
    ), body


async def test_a_users_identities_at_upstream_providers_are_listed_read_only(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    status, listed, _ = await admin.get("/users", params={"username": "alice"})
    [alice] = listed["data"]
    path = f"/users/{quote(alice['id'], safe='')}/identities"
    status, body, _ = await admin.get(path)
    assert status == 200 and body == {
        "data": [],
        "pagination": {"nextCursor": None, "hasMore": False},
    }
    store = admin_server.services.store
    await store.link_identity(
        IdentityLink("https://b.example", "emp-2", alice["id"], 1_700_000_000.0), None
    )
    await store.link_identity(
        IdentityLink("https://a.example", "emp-1", alice["id"], 1_700_000_100.0), None
    )
    status, body, _ = await admin.get(path)
    assert status == 200
    assert [(i["issuer"], i["subject"], i["linkedAt"]) for i in body["data"]] == [
        ("https://a.example", "emp-1", "2023-11-14T22:15:00.000Z"),
        ("https://b.example", "emp-2", "2023-11-14T22:13:20.000Z"),
    ]
    assert all(set(i) == {"id", "issuer", "subject", "linkedAt"} for i in body["data"])
    status, body, _ = await admin.get(
        path, params={"issuer": "https://b.example", "fields": "subject"}
    )
    assert status == 200 and body["data"] == [{"subject": "emp-2"}]
    # Read-only; an unknown user is a 404; a filter it does not have is a 422.
    status, body, _ = await admin.post(path, {"issuer": "https://c.example", "subject": "x"})
    assert status == 405
    status, body, _ = await admin.get("/users/nobody/identities")
    assert status == 404 and codes(body) == "not_found"
    status, body, _ = await admin.get(path, params={"email": "x"})
    assert status == 422


# ---------------------------------------------------------------------------- grants and keys


async def test_a_grant_is_listed_and_deleting_it_revokes_its_refresh_family(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, admin_server)
    admin = await admin_for(http, admin_server)
    status, listed, _ = await admin.get("/grants", params={"clientId": "spa"})
    [grant] = listed["data"]
    assert grant["scopes"] == ["openid", "profile", "email", "offline_access", "orders:read"]
    assert grant["revokedAt"] is None and grant["refreshFamily"] == grant["id"]
    status, shown, _ = await admin.get(f"/grants/{grant['id']}")
    assert status == 200 and shown == grant
    assert (await admin.delete(f"/grants/{grant['id']}"))[0] == 204
    status, body, _ = await post_token(
        http,
        admin_server,
        {
            "grant_type": "refresh_token",
            "refresh_token": tokens["refresh_token"],
            "client_id": "spa",
        },
    )
    assert status == 400 and body["error"] == "invalid_grant"
    assert (await introspect(http, admin_server, tokens["access_token"]))["active"] is False
    assert (await admin.get("/grants/unknown"))[0] == 404


async def test_keys_show_public_facts_and_post_publishes_one_successor(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    status, keys, _ = await admin.get("/keys")
    assert status == 200
    assert {k["alg"] for k in keys["data"]} == {"ES256", "RS256"}
    assert all(
        set(k) == {"kid", "alg", "state", "createdAt", "activateAt", "retiredAt", "removeAfter"}
        for k in keys["data"]
    )
    status, created, response = await admin.post("/keys", {"alg": "ES256"})
    assert status == 201 and created["state"] == "next"
    assert response.headers["Location"].endswith("/keys/" + created["kid"])
    status, body, _ = await admin.post("/keys", {"alg": "ES256"})
    assert status == 409
    status, body, _ = await admin.post("/keys", {"alg": "HS256"})
    assert status == 422 and fields_of(body) == {"alg"}
    jwks = await (await http.get(admin_server.endpoint("/jwks"))).json()
    assert created["kid"] in {k["kid"] for k in jwks["keys"]}


async def test_the_openapi_document_describes_every_path(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    async with http.get(api(admin_server, "/openapi.json")) as response:
        assert response.status == 200
        document = await response.json()
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) == {
        "/clients",
        "/clients/{id}",
        "/clients/{id}/secret",
        "/users",
        "/users/{id}",
        "/users/{id}/password",
        "/users/{id}/second-factor",
        "/users/{id}/identities",
        "/users/{id}/passkeys",
        "/users/{id}/passkeys/{passkeyId}",
        "/grants",
        "/grants/{id}",
        "/keys",
        "/keys/{id}",
    }
    assert {"Client", "ClientInput", "User", "UserInput", "Error"} <= set(
        document["components"]["schemas"]
    )


# ---------------------------------------------------------------------------- seeds


async def test_the_configuration_seeds_the_store_at_start_and_on_reload(
    tmp_path: Path, key_root: Path, http: aiohttp.ClientSession
) -> None:
    sock = bound_socket()
    port = sock.getsockname()[1]
    config = admin_config(port)
    config["clients"].append(
        {"client_id": "temp", "client_secret": SECRET, "grant_types": ["client_credentials"]}
    )
    shutil.copytree(_key_template(key_root), tmp_path / "keys")
    path = write_config(tmp_path, config, port)
    settings = authserver_settings.load(str(path))
    process = AuthServer(settings)
    runner, _ = await start_site(build_app(settings, process), sock=sock)
    try:
        server = RunningAuthServer(settings, f"http://127.0.0.1:{port}", process.live.current())
        admin = await admin_for(http, server)
        status, temp, _ = await admin.get("/clients/temp")
        assert status == 200 and temp["managedBy"] == "config"
        _, token = await client_credentials(http, server, client_id="temp")

        config["clients"] = [c for c in config["clients"] if c["client_id"] != "temp"]
        [web_client] = [c for c in config["clients"] if c["client_id"] == "web"]
        web_client["client_name"] = "Web App, renamed"
        write_config(tmp_path, config, port)
        assert await process.reload()

        assert (await admin.get("/clients/temp"))[0] == 404
        assert (await introspect(http, server, token["access_token"]))["active"] is False
        status, renamed, _ = await admin.get("/clients/web")
        assert renamed["clientName"] == "Web App, renamed"
        assert renamed["createdAt"] <= renamed["updatedAt"]
    finally:
        await runner.cleanup()
