"""What an operator can read back of what the server did: the access log's line per request
and the audit events (sign-ins, consents, tokens issued and revoked, admin changes), from
`python -m authserver run` in its own process, and never a secret, a password or a token
among them."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import jwt
import pytest

from authserver.accesslog import LOGGER as ACCESS_LOGGER
from authserver.accesslog import logged_path
from tests.authserver.admin_support import Admin, api
from tests.authserver.conftest import (
    PASSWORD,
    SECRET,
    StartAuthServer,
    authorize_code,
    basic_auth,
    client_credentials,
    default_config,
    exchange_code,
    post_token,
)
from tests.authserver.test_login_throttle import attempt
from tests.authserver.test_operations import Server

AUDIT_LOGGER = "portcullis.authserver.audit"
WRONG_PASSWORD = "not-" + PASSWORD + "-at-all"


@pytest.fixture
def servers(tmp_path: Path, key_root: Path) -> Iterator[Callable[..., Server]]:
    """Factory of servers in their own processes (not started); killed at the end."""
    made: list[Server] = []

    def make(config: dict[str, Any]) -> Server:
        server = Server(tmp_path / f"server{len(made)}", key_root, config)
        made.append(server)
        return server

    yield make
    for server in made:
        server.kill()


def jti_of(token: str) -> str:
    return str(jwt.decode(token, options={"verify_signature": False})["jti"])


def with_admin_client(server: Server) -> None:
    """An admin API client for this server's own audience (the port is known only now)."""

    def change(config: dict[str, Any]) -> None:
        config["clients"].append(
            {
                "client_id": "admin-cli",
                "client_secret": SECRET,
                "grant_types": ["client_credentials"],
                "scope": "admin:read admin:write",
                "resources": [server.url + "/admin/v1"],
            }
        )

    server.rewrite(change)


def audit_events(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if line["logger"] == AUDIT_LOGGER]


def access_lines(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if line["logger"] == ACCESS_LOGGER]


def the_one(events: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    found = [e for e in events if all(e.get(k) == v for k, v in fields.items())]
    assert len(found) == 1, (fields, [e["event"] for e in events])
    return found[0]


async def test_every_request_and_every_audit_event_is_logged_without_a_secret(
    servers: Callable[..., Server], http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["login_throttle"] = {"max_failures": 2, "max_failures_per_address": 100}
    server = servers(config)
    with_admin_client(server)
    server.start()
    await server.wait_ready(http)
    view = server.view()
    shown: list[str] = []  # every secret and token the test saw: none may be in the log

    # client_credentials, with the request id a front proxy gave it
    status, machine, response = await post_token(
        http,
        view,
        {"grant_type": "client_credentials", "scope": "orders:read"},
        auth=("machine", SECRET),
        headers={"X-Request-Id": "front-proxy-7"},
    )
    assert status == 200, machine
    assert response.headers["X-Request-Id"] == "front-proxy-7"
    shown += [machine["access_token"], basic_auth("machine", SECRET).split()[1]]

    # a code flow of a confidential client, then a refresh
    scope = "openid profile offline_access orders:read"
    code = await authorize_code(http, view, client_id="web", scope=scope)
    status, web = await exchange_code(http, view, code, auth=("web", SECRET))
    assert status == 200, web
    assert code.verifier is not None and code.nonce is not None
    shown += [code.code, code.verifier, code.state, code.nonce]
    shown += [web["access_token"], web["refresh_token"], web["id_token"]]
    status, refreshed, _ = await post_token(
        http,
        view,
        {"grant_type": "refresh_token", "refresh_token": web["refresh_token"]},
        auth=("web", SECRET),
    )
    assert status == 200, refreshed
    shown += [refreshed["access_token"], refreshed["refresh_token"]]

    # a wrong password twice, then the throttle
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        for _ in range(2):
            assert (await attempt(browser, view, "bob", WRONG_PASSWORD)).status == 400
        assert (await attempt(browser, view, "bob", WRONG_PASSWORD)).status == 429
        # an unknown username, typed as people do: their password
        assert (await attempt(browser, view, "hunter2-typed-as-a-name", "x")).status == 400
    shown += [WRONG_PASSWORD, "hunter2-typed-as-a-name"]

    # revocations (RFC 7009): the refreshed access token by jti, then the grant
    for token in (refreshed["access_token"], refreshed["refresh_token"]):
        async with http.post(
            view.endpoint("/revoke"),
            data={"token": token},
            headers={"Authorization": basic_auth("web", SECRET)},
        ) as revoked:
            assert revoked.status == 200

    # admin changes: a user (with a password) and a client (given a secret), then removed
    status, admin_token, _ = await post_token(
        http,
        view,
        {"grant_type": "client_credentials", "resource": api(view)},
        auth=("admin-cli", SECRET),
    )
    assert status == 200, admin_token
    admin = Admin(http, view, admin_token["access_token"])
    carol_password = "carol-" + secrets.token_urlsafe(12)
    status, carol, _ = await admin.post("/users", {"username": "carol", "password": carol_password})
    assert status == 201, carol
    status, reports, _ = await admin.post(
        "/clients", {"clientId": "reports", "grantTypes": ["client_credentials"]}
    )
    assert status == 201, reports
    status, _, _ = await admin.delete("/users/" + quote(carol["id"], safe=""))
    assert status == 204
    shown += [admin_token["access_token"], carol_password, reports["clientSecret"]]

    assert server.stop() == 0  # SIGTERM: the access log's last lines written out
    text = server.log.read_text()
    lines = server.log_lines()
    assert len(lines) == len(text.splitlines())  # every line is one JSON object

    for value in shown:
        assert value not in text, value
    assert SECRET not in text and PASSWORD not in text

    # The access log: one line per request, with the client once it is known.
    requests = access_lines(lines)
    assert {tuple(sorted(line)) for line in requests} == {
        tuple(
            sorted(
                (
                    "time",
                    "level",
                    "logger",
                    "message",
                    "request_id",
                    "client",
                    "method",
                    "path",
                    "route",
                    "status",
                    "client_id",
                    "total_ms",
                )
            )
        )
    }
    first_token = the_one(requests, request_id="front-proxy-7")
    assert first_token["method"] == "POST" and first_token["path"] == "/token"
    assert (first_token["route"], first_token["status"]) == ("token", 200)
    assert first_token["client_id"] == "machine" and first_token["client"] == "127.0.0.1"
    assert first_token["total_ms"] > 0
    authorize = next(line for line in requests if line["route"] == "authorize")
    # The query's names, never a value.
    assert authorize["path"].startswith("/authorize?")
    assert set(authorize["path"].partition("?")[2].split("&")) == {
        "response_type",
        "client_id",
        "redirect_uri",
        "scope",
        "state",
        "code_challenge",
        "code_challenge_method",
        "nonce",
    }
    assert authorize["client_id"] == "web"
    tokens = [line for line in requests if line["route"] == "token"]
    assert [line["client_id"] for line in tokens] == ["machine", "web", "web", "admin-cli"]
    logins = [line for line in requests if line["route"] == "login"]
    assert [line["status"] for line in logins] == [200, 400, 400, 429, 400]  # 200: consent
    assert {line["client_id"] for line in logins} == {"web", "spa"}
    assert len({line["request_id"] for line in requests}) == len(requests)

    # The audit events, in one format.
    events = audit_events(lines)
    for event in events:
        assert event["message"] == event["event"]
        assert event["actor"] in ("user", "client", "admin", "server")
        assert "request_id" in event
    alice = server.settings.user("alice")
    bob = server.settings.user("bob")
    assert alice is not None and bob is not None
    alice_sub, bob_sub = server.settings.subject_of(alice), server.settings.subject_of(bob)

    issued = [e for e in events if e["event"] == "token.issued"]
    assert [(e["grant_type"], e["client_id"]) for e in issued] == [
        ("client_credentials", "machine"),
        ("authorization_code", "web"),
        ("refresh_token", "web"),
        ("client_credentials", "admin-cli"),
    ]
    assert issued[0]["jti"] == jti_of(machine["access_token"])
    assert issued[0]["request_id"] == "front-proxy-7" and issued[0]["scope"] == "orders:read"
    assert issued[1]["jti"] == jti_of(web["access_token"])
    assert issued[1]["subject"] == alice_sub and issued[1]["scope"] == scope
    assert issued[2]["jti"] == jti_of(refreshed["access_token"])
    assert issued[2]["grant_id"] == issued[1]["grant_id"]  # one grant, rotated
    grant_id = issued[1]["grant_id"]

    signed_in = the_one(events, event="signin.succeeded")
    assert (signed_in["subject"], signed_in["client_id"]) == (alice_sub, "web")
    assert signed_in["address"] == "127.0.0.1" and signed_in["actor"] == "user"
    consent = the_one(events, event="consent.given")
    assert (consent["subject"], consent["client_id"], consent["scope"]) == (alice_sub, "web", scope)
    failed = [e for e in events if e["event"] == "signin.failed"]
    assert [(e.get("subject"), e["username_known"]) for e in failed] == [
        (bob_sub, True),
        (bob_sub, True),
        (None, False),
    ]
    throttled = the_one(events, event="signin.throttled")
    assert throttled["level"] == "warning" and throttled["reason"] == "user-at-ip"

    revoked = the_one(events, event="token.revoked")
    assert revoked["jti"] == jti_of(refreshed["access_token"]) and revoked["client_id"] == "web"
    grant = the_one(events, event="grant.revoked")
    assert (grant["grant_id"], grant["subject"], grant["actor"]) == (grant_id, alice_sub, "client")

    for name, fields in (
        ("user.created", {"subject": carol["id"]}),
        ("client.created", {"client_id": "reports"}),
        ("user.deleted", {"subject": carol["id"]}),
    ):
        change = the_one(events, event=name)
        assert change["actor"] == "admin" and change["actor_client_id"] == "admin-cli", change
        assert {k: change[k] for k in fields} == fields
    cut_off = the_one(events, event="user.cut_off")
    assert cut_off["subject"] == carol["id"] and cut_off["reason"] == "user_deleted"


async def test_a_reused_refresh_token_is_an_audit_warning_naming_its_grant(
    servers: Callable[..., Server], http: aiohttp.ClientSession
) -> None:
    config = default_config()
    config["refresh_grace"] = "0s"
    server = servers(config)
    server.start()
    await server.wait_ready(http)
    view = server.view()
    code = await authorize_code(http, view)
    status, tokens = await exchange_code(http, view, code)
    assert status == 200, tokens
    refresh = {"grant_type": "refresh_token", "client_id": "spa"}
    for expected in (200, 400):
        status, _, _ = await post_token(
            http, view, {**refresh, "refresh_token": tokens["refresh_token"]}
        )
        assert status == expected
    assert server.stop() == 0
    events = audit_events(server.log_lines())
    issued = the_one(events, event="token.issued", grant_type="authorization_code")
    reused = the_one(events, event="refresh.reused")
    assert reused["level"] == "warning" and reused["actor"] == "server"
    assert (reused["grant_id"], reused["client_id"]) == (issued["grant_id"], "spa")
    assert tokens["refresh_token"] not in server.log.read_text()


async def test_the_access_log_goes_to_the_file_it_names_or_nowhere(
    start_authserver: StartAuthServer,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "access.log"
    config = default_config()
    config["access_log"] = {"output": str(path), "flush_interval": "10ms"}
    server = await start_authserver(config)
    status, _ = await client_credentials(http, server)
    assert status == 200
    async with http.get(server.url + "/.well-known/openid-configuration?x=" + SECRET) as got:
        assert got.status == 200
    await server.stop()
    text = path.read_text()
    lines = [json.loads(line) for line in text.splitlines()]
    assert [(line["route"], line["status"]) for line in lines] == [
        ("token", 200),
        ("discovery", 200),
    ]
    assert lines[1]["path"] == "/.well-known/openid-configuration?*"
    assert SECRET not in text
    assert ACCESS_LOGGER not in capsys.readouterr().err  # the file only

    config["access_log"] = False
    quiet = await start_authserver(config)
    status, _ = await client_credentials(http, quiet)
    assert status == 200
    await quiet.stop()
    assert ACCESS_LOGGER not in capsys.readouterr().err
    assert len(path.read_text()) == len(text)

    config["access_log"] = True  # to stderr, as when absent
    loud = await start_authserver(config)
    status, _ = await client_credentials(http, loud)
    assert status == 200
    await loud.stop()
    written = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["route"] for line in written if line.get("logger") == ACCESS_LOGGER] == ["token"]


@pytest.mark.parametrize(
    ("raw", "logged"),
    [
        ("/token", "/token"),
        (
            "/authorize?client_id=web&state=abc&code_challenge=xyz",
            "/authorize?client_id&state&code_challenge",
        ),
        ("/device?user_code=WDJB-MJHT", "/device?user_code"),
        (
            "/logout?id_token_hint=eyJ.eyJ.sig&post_logout_redirect_uri=x",
            "/logout?id_token_hint&post_logout_redirect_uri",
        ),
        ("/token?client_secret=s3cr3t&code=abc&refresh_token=r", "/token?*&*&*"),
        ("/x?eyJhbGciOiJFUzI1NiJ9&&=", "/x?*&*"),
        (
            "/admin/v1/clients?limit=5&cursor=abc&sort=-createdAt",
            "/admin/v1/clients?limit&cursor&sort",
        ),
        ("/jwks?", "/jwks"),
        ("/" + "a" * 600, "/" + "a" * 511 + "…"),
    ],
)
def test_a_logged_path_keeps_only_the_names_of_known_query_parameters(
    raw: str, logged: str
) -> None:
    assert logged_path(raw) == logged
