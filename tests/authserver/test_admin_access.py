"""Who may call the admin API, over real HTTP on SQLite and PostgreSQL: tokens bound to a
DPoP key only with a proof of it for the very request (RFC 9449 §7), and a token only as
good as its client's registration now."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.authserver.admin_support import (
    Admin,
    admin_for,
    admin_server,
    admin_token,
    api,
    start_admin_server,
)
from tests.authserver.conftest import (
    REDIRECT,
    SECRET,
    RunningAuthServer,
    authorize_code,
    basic_auth,
    exchange_code,
)
from tests.authserver.dpop_support import DpopKey

__all__ = ["admin_server", "start_admin_server"]  # fixtures


async def bound_admin_token(
    http: aiohttp.ClientSession, server: RunningAuthServer, key: DpopKey
) -> str:
    """admin-cli's token for the admin API, bound to `key` by a proof at the token endpoint."""
    response = await http.post(
        server.endpoint("/token"),
        data={"grant_type": "client_credentials", "resource": api(server)},
        headers={
            "Authorization": basic_auth("admin-cli", SECRET),
            "DPoP": key.proof(server.endpoint("/token")),
        },
    )
    body = await response.json()
    assert response.status == 200, body
    assert body["token_type"] == "DPoP"
    return str(body["access_token"])


async def call(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    headers: dict[str, str],
    body: Any = None,
) -> tuple[int, Any, aiohttp.ClientResponse]:
    sent = dict(headers)
    data = None
    if body is not None:
        data = orjson.dumps(body)
        sent["Content-Type"] = "application/json"
    async with http.request(method, url, headers=sent, data=data) as response:
        raw = await response.read()
        return response.status, orjson.loads(raw) if raw else None, response


def dpop(token: str, key: DpopKey, method: str, url: str, **proof: Any) -> dict[str, str]:
    return {
        "Authorization": f"DPoP {token}",
        "DPoP": key.proof(url, method, access_token=token, **proof),
    }


def code(body: Any) -> str:
    return str(body["error"]["code"])


NEW_CLIENT = {"clientId": "stolen", "grantTypes": ["client_credentials"]}


# ---------------------------------------------------------------------------- DPoP


async def test_a_dpop_bound_token_sent_as_bearer_is_refused_with_a_dpop_challenge(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    key = DpopKey()
    token = await bound_admin_token(http, admin_server, key)
    clients = api(admin_server, "/clients")
    proof = key.proof(clients, "POST", access_token=token)
    for method, headers in (
        ("GET", {"Authorization": f"Bearer {token}"}),
        ("POST", {"Authorization": f"Bearer {token}"}),
        # A proof beside it does not make a bearer token of it either (§7.1).
        ("POST", {"Authorization": f"Bearer {token}", "DPoP": proof}),
    ):
        status, body, response = await call(
            http, method, clients, headers, NEW_CLIENT if method == "POST" else None
        )
        assert (status, code(body)) == (401, "invalid_token"), body
        challenge = response.headers["WWW-Authenticate"]
        assert challenge.startswith("DPoP realm=") and 'error="invalid_token"' in challenge
        assert 'algs="' in challenge and "ES256" in challenge
    # Nothing was created with it.
    admin = await admin_for(http, admin_server)
    assert (await admin.get("/clients/stolen"))[0] == 404


async def test_a_dpop_bound_token_with_a_proof_of_its_key_reads_and_writes(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    key = DpopKey()
    token = await bound_admin_token(http, admin_server, key)
    clients = api(admin_server, "/clients")
    status, body, _ = await call(http, "GET", clients, dpop(token, key, "GET", clients))
    assert status == 200, body
    status, body, _ = await call(
        http, "POST", clients, dpop(token, key, "POST", clients), NEW_CLIENT
    )
    assert status == 201, body
    one = api(admin_server, "/clients/stolen")
    status, body, _ = await call(http, "GET", one, dpop(token, key, "GET", one))
    assert status == 200 and body["clientId"] == "stolen", body
    # A proof is good for one request only (§11.1).
    headers = dpop(token, key, "GET", one)
    assert (await call(http, "GET", one, headers))[0] == 200
    status, body, _ = await call(http, "GET", one, headers)
    assert (status, code(body)) == (401, "invalid_dpop_proof")
    # Counted under the API's name, never under a path holding an id.
    exposition = admin_server.services.token.dpop.metrics.exposition().decode()
    counted = {
        (s.labels["endpoint"], s.labels["result"]): s.value
        for family in text_string_to_metric_families(exposition)
        if family.name == "portcullis_authserver_dpop_proofs"
        for s in family.samples
    }
    assert counted == {("token", "accepted"): 1, ("admin", "accepted"): 4, ("admin", "replayed"): 1}


@pytest.mark.parametrize(
    "case", ["no-proof", "other-url", "other-method", "other-key", "no-ath", "wrong-ath"]
)
async def test_a_proof_that_does_not_fit_the_admin_request_is_refused(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession, case: str
) -> None:
    key = DpopKey()
    token = await bound_admin_token(http, admin_server, key)
    clients = api(admin_server, "/clients")
    proofs = {
        "no-proof": None,
        "other-url": key.proof(api(admin_server, "/users"), "POST", access_token=token),
        "other-method": key.proof(clients, "GET", access_token=token),
        "other-key": DpopKey().proof(clients, "POST", access_token=token),
        "no-ath": key.proof(clients, "POST"),
        "wrong-ath": key.proof(clients, "POST", access_token=token + "x"),
    }
    headers = {"Authorization": f"DPoP {token}"}
    if proofs[case] is not None:
        headers["DPoP"] = str(proofs[case])
    status, body, response = await call(http, "POST", clients, headers, NEW_CLIENT)
    assert (status, code(body)) == (401, "invalid_dpop_proof"), body
    challenge = response.headers["WWW-Authenticate"]
    assert challenge.startswith("DPoP realm=") and 'error="invalid_dpop_proof"' in challenge
    admin = await admin_for(http, admin_server)
    assert (await admin.get("/clients/stolen"))[0] == 404


async def test_an_unbound_token_is_refused_under_the_dpop_scheme_and_works_as_bearer(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    clients = api(admin_server, "/clients")
    key = DpopKey()
    status, body, _ = await call(http, "GET", clients, dpop(admin.token, key, "GET", clients))
    assert (status, code(body)) == (401, "invalid_token"), body
    status, body, _ = await admin.get("/clients")
    assert status == 200, body


async def test_without_a_token_the_admin_api_offers_both_schemes(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    async with http.get(api(admin_server, "/clients")) as response:
        assert response.status == 401
        challenges = response.headers.getall("WWW-Authenticate")
        body = await response.json()
    assert challenges[0].startswith("Bearer realm=")
    assert any(c.startswith("DPoP realm=") and "algs=" in c for c in challenges)
    assert code(body) == "unauthorized"


# ---------------------------------------------------------------------------- registration now


async def ops_client(
    admin: Admin, server: RunningAuthServer, scope: str = "admin:read admin:write"
) -> str:
    """`ops`, an admin client made through the API (the file's are read-only there); its
    secret."""
    status, body, _ = await admin.post(
        "/clients",
        {
            "clientId": "ops",
            "grantTypes": ["client_credentials"],
            "scope": scope,
            "resources": [api(server)],
        },
    )
    assert status == 201, body
    return str(body["clientSecret"])


async def test_a_token_of_a_client_that_lost_admin_write_only_reads(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    secret = await ops_client(admin, admin_server)
    ops = Admin(http, admin_server, await admin_token(http, admin_server, "ops", secret))
    assert (await ops.post("/clients", NEW_CLIENT))[0] == 201
    assert (await admin.patch("/clients/ops", {"scope": "admin:read"}))[0] == 200

    # The token still says admin:write; the registration no longer does (RFC 6749 §3.3).
    status, body, response = await ops.post("/clients", {**NEW_CLIENT, "clientId": "again"})
    assert (status, code(body)) == (403, "insufficient_scope"), body
    assert 'scope="admin:write"' in response.headers["WWW-Authenticate"]
    assert (await ops.get("/clients"))[0] == 200
    assert (await admin.patch("/clients/ops", {"scope": ""}))[0] == 200
    status, body, _ = await ops.get("/clients")
    assert (status, code(body)) == (403, "insufficient_scope"), body


async def test_a_token_of_a_client_no_longer_registered_for_the_admin_api_is_refused(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    secret = await ops_client(admin, admin_server)
    ops = Admin(http, admin_server, await admin_token(http, admin_server, "ops", secret))
    assert (await ops.get("/clients"))[0] == 200
    assert (await admin.patch("/clients/ops", {"resources": ["billing-api"]}))[0] == 200
    status, body, response = await ops.get("/clients")
    assert (status, code(body)) == (401, "invalid_token"), body
    assert 'error="invalid_token"' in response.headers["WWW-Authenticate"]
    assert (await admin.delete("/clients/ops"))[0] == 204
    assert (await ops.get("/clients"))[0] == 401


async def test_a_users_token_is_only_as_good_as_its_clients_registration_now(
    admin_server: RunningAuthServer, http: aiohttp.ClientSession
) -> None:
    admin = await admin_for(http, admin_server)
    status, body, _ = await admin.post(
        "/clients",
        {
            "clientId": "console-2",
            "tokenEndpointAuthMethod": "none",
            "redirectUris": [REDIRECT],
            "grantTypes": ["authorization_code"],
            "scope": "openid admin:read admin:write",
            "resources": [api(admin_server)],
            "skipConsent": True,
        },
    )
    assert status == 201, body
    result = await authorize_code(
        http,
        admin_server,
        client_id="console-2",
        scope="openid admin:read admin:write",
        extra={"resource": api(admin_server)},
    )
    status, tokens = await exchange_code(http, admin_server, result, client_id="console-2")
    assert status == 200, tokens
    alice = Admin(http, admin_server, tokens["access_token"])
    assert (await alice.get("/users"))[0] == 200
    assert (await admin.patch("/clients/console-2", {"scope": "openid"}))[0] == 200
    status, body, _ = await alice.get("/users")
    assert (status, code(body)) == (403, "insufficient_scope"), body
