"""DPoP end to end: a client holding a key gets a token bound to it from the authorization
server and calls the API through the gateway; the same token without the key gets nowhere.

Twice: with the test's own proofs, and with oauth4webapi, an independent OAuth library for
JavaScript runtimes, driven through tests/e2e/dpop_client/client.mjs on Node.js (installed
with `npm ci` from the committed lock file into tests/e2e/dpop_client/node_modules). Without
node and npm those tests skip, saying so; under CI=true they fail instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from jwt.algorithms import ECAlgorithm

from tests.authserver.conftest import (
    CLIENT_KEY,
    CLIENT_KID,
    SECRET,
    RunningAuthServer,
    authorize_code,
    basic_auth,
    default_config,
)
from tests.authserver.dpop_support import DpopKey
from tests.support import (
    UNBOUND_ADMIN_LISTEN,
    UNBOUND_LISTEN,
    EchoUpstream,
    header_values,
    running_gateway,
    service_missing,
)

CLIENT_DIR = Path(__file__).resolve().parent / "dpop_client"
NONCE_KEY = "n0nce-key-n0nce-key-n0nce-key-n0nce-key"


def gateway_config(
    server: RunningAuthServer, upstream: str, *, mode: str = "jwt", nonce: bool = False
) -> str:
    introspection = (
        f', introspection: {{client_id: resource-server, client_secret: "{SECRET}"}}'
        if mode == "introspection"
        else ""
    )
    return f"""
listen: "{UNBOUND_LISTEN}"
admin_listen: "{UNBOUND_ADMIN_LISTEN}"
upstream: {{url: "{upstream}"}}
issuers:
  - {{issuer: "{server.url}", audiences: [orders-api], algorithms: [ES256],
     mode: {mode}{introspection}}}
dpop: {{nonce: {"true" if nonce else "false"}}}
routes:
  - {{name: orders, path: "/orders/**", methods: [GET], scopes: {{any: ["orders:read"]}}}}
  - {{name: payments, path: "/payments/**", methods: [GET], dpop: required}}
"""


async def bound_machine_token(
    http: aiohttp.ClientSession, server: RunningAuthServer, key: DpopKey
) -> str:
    async with http.post(
        server.endpoint("/token"),
        data={"grant_type": "client_credentials", "scope": "orders:read"},
        headers={
            "Authorization": basic_auth("machine", SECRET),
            "DPoP": key.proof(server.endpoint("/token")),
        },
    ) as response:
        body = await response.json()
    assert response.status == 200, body
    assert body["token_type"] == "DPoP"
    return str(body["access_token"])


async def call(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> tuple[int, str]:
    async with http.get(url, headers=headers) as response:
        return response.status, ", ".join(response.headers.getall("WWW-Authenticate", []))


@pytest.mark.parametrize("mode", ["jwt", "introspection"])
async def test_a_bound_token_reaches_the_api_with_its_proof_and_a_stolen_one_does_not(
    start_authserver: Any, http: aiohttp.ClientSession, mode: str
) -> None:
    server = await start_authserver()
    upstream = await EchoUpstream().start()
    try:
        async with running_gateway(gateway_config(server, upstream.url, mode=mode)) as gateway:
            key = DpopKey()
            token = await bound_machine_token(http, server, key)
            url = gateway.url + "/orders/7"
            proof = key.proof(url, "GET", access_token=token)

            status, _ = await call(http, url, {"Authorization": f"DPoP {token}", "DPoP": proof})
            assert status == 200
            assert header_values(upstream.requests[-1], "X-Auth-Subject") == ["machine"]
            seen = len(upstream.requests)

            thief = DpopKey()
            stolen = {
                "as-bearer": {"Authorization": f"Bearer {token}"},
                "no-proof": {"Authorization": f"DPoP {token}"},
                "replayed-proof": {"Authorization": f"DPoP {token}", "DPoP": proof},
                "thiefs-own-key": {
                    "Authorization": f"DPoP {token}",
                    "DPoP": thief.proof(url, "GET", access_token=token),
                },
            }
            for case, headers in stolen.items():
                status, challenge = await call(http, url, headers)
                assert status == 401, case
                assert "DPoP" in challenge, case
            assert len(upstream.requests) == seen  # none of them reached the API
    finally:
        await upstream.stop()


async def test_a_route_requiring_dpop_refuses_a_bearer_token_from_the_authserver(
    start_authserver: Any, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver()
    upstream = await EchoUpstream().start()
    try:
        async with running_gateway(gateway_config(server, upstream.url)) as gateway:
            async with http.post(
                server.endpoint("/token"),
                data={"grant_type": "client_credentials"},
                headers={"Authorization": basic_auth("machine", SECRET)},
            ) as response:
                bearer = (await response.json())["access_token"]
            status, _ = await call(
                http, gateway.url + "/payments/1", {"Authorization": f"Bearer {bearer}"}
            )
            assert status == 401
            key = DpopKey()
            token = await bound_machine_token(http, server, key)
            url = gateway.url + "/payments/1"
            headers = {
                "Authorization": f"DPoP {token}",
                "DPoP": key.proof(url, "GET", access_token=token),
            }
            status, _ = await call(http, url, headers)
            assert status == 200
    finally:
        await upstream.stop()


# ---------------------------------------------------------------------------- oauth4webapi


@pytest.fixture(scope="session")
def node_client() -> Path:
    """The oauth4webapi client script, its package installed with `npm ci` when missing."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        service_missing("node and npm are needed for the oauth4webapi client (Node.js 20 or later)")
    installed = CLIENT_DIR / "node_modules" / "oauth4webapi" / "package.json"
    lock = json.loads((CLIENT_DIR / "package-lock.json").read_text())
    wanted = lock["packages"]["node_modules/oauth4webapi"]["version"]
    if not installed.exists() or json.loads(installed.read_text())["version"] != wanted:
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=CLIENT_DIR,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            service_missing(
                f"npm ci of the oauth4webapi client failed: {done.stderr.strip()[-500:]}"
            )
    return CLIENT_DIR / "client.mjs"


async def run_client(script: Path, **request: Any) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        "node",
        str(script),
        json.dumps(request),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NODE_NO_WARNINGS": "1"},
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert out, f"the client printed nothing; stderr: {err.decode()[-2000:]}"
    answer: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return answer


def private_jwk(key: DpopKey) -> dict[str, Any]:
    jwk: dict[str, Any] = ECAlgorithm.to_jwk(key.private, as_dict=True)
    return jwk


@pytest.mark.parametrize("nonces", [False, True], ids=["without-nonces", "with-nonces"])
async def test_oauth4webapi_gets_a_bound_token_and_calls_the_api_through_the_gateway(
    start_authserver: Any, http: aiohttp.ClientSession, node_client: Path, nonces: bool
) -> None:
    config = default_config()
    if nonces:  # both ask for nonces: the library answers each challenge once
        config["dpop"] = {"nonce": True, "nonce_key": NONCE_KEY}
    server = await start_authserver(config)
    upstream = await EchoUpstream().start()
    gateway_text = gateway_config(server, upstream.url, nonce=nonces)
    try:
        async with running_gateway(gateway_text) as gateway:
            key = DpopKey()
            answer = await run_client(
                node_client,
                issuer=server.settings.issuer,
                client_id="machine",
                client_secret=SECRET,
                key=private_jwk(key),
                mode="client_credentials",
                resource=gateway.url + "/orders/7",
            )
            assert "error" not in answer, answer
            assert answer["jkt"] == key.jkt  # the library's thumbprint is ours
            assert answer["token_type"].lower() == "dpop"
            claims = jwt.decode(answer["access_token"], options={"verify_signature": False})
            assert claims["cnf"] == {"jkt": key.jkt}
            assert answer["resource"]["status"] == 200, answer
            # With nonces, each server challenged once: the token endpoint, then the gateway.
            assert answer["nonce_retries"] == (["token", "resource"] if nonces else [])
            assert header_values(upstream.requests[-1], "X-Auth-Subject") == ["machine"]

            # The token without the key: refused by the gateway.
            status, _ = await call(
                http,
                gateway.url + "/orders/7",
                {"Authorization": f"Bearer {answer['access_token']}"},
            )
            assert status == 401
    finally:
        await upstream.stop()


async def test_oauth4webapi_authenticates_with_private_key_jwt_as_it_comes(
    start_authserver: Any, node_client: Path
) -> None:
    # Its assertion names the issuer alone as `aud`: what client_assertion_audience: strict,
    # the default, takes (draft-ietf-oauth-rfc7523bis).
    server = await start_authserver()
    key = DpopKey()
    client_key = {**ECAlgorithm.to_jwk(CLIENT_KEY, as_dict=True), "kid": CLIENT_KID}
    answer = await run_client(
        node_client,
        issuer=server.settings.issuer,
        client_id="machine-jwt",
        client_key=client_key,
        key=private_jwk(key),
        mode="client_credentials",
    )
    assert "error" not in answer, answer
    claims = jwt.decode(answer["access_token"], options={"verify_signature": False})
    assert (claims["client_id"], claims["cnf"]) == ("machine-jwt", {"jkt": key.jkt})


async def test_oauth4webapi_redeems_a_code_bound_with_dpop_jkt_and_reads_userinfo_with_nonces(
    start_authserver: Any, http: aiohttp.ClientSession, node_client: Path
) -> None:
    config = default_config()
    config["dpop"] = {"nonce": True, "nonce_key": NONCE_KEY}
    server = await start_authserver(config)
    key = DpopKey()
    scope = "openid profile offline_access orders:read"
    result = await authorize_code(http, server, scope=scope, extra={"dpop_jkt": key.jkt})
    answer = await run_client(
        node_client,
        issuer=server.settings.issuer,
        client_id="spa",
        key=private_jwk(key),
        mode="code",
        code={
            "callback": result.location,
            "state": result.state,
            "verifier": result.verifier,
            "redirect_uri": result.redirect_uri,
            "nonce": result.nonce,
        },
        refresh=True,
    )
    assert "error" not in answer, answer
    assert answer["token_type"].lower() == "dpop"
    assert answer["userinfo"]["sub"] == server.subject("alice")
    assert answer["userinfo"]["name"] == "Alice Liddell"
    # The token endpoint challenged for a nonce; userinfo and the refresh, on the same
    # origin, reused it.
    assert answer["nonce_retries"] == ["token"]
    assert answer["refreshed"]["token_type"].lower() == "dpop"
    refreshed = jwt.decode(answer["refreshed"]["access_token"], options={"verify_signature": False})
    assert refreshed["cnf"] == {"jkt": key.jkt}
    # The refresh token is bound to the key: without a proof of it, refused.
    async with http.post(
        server.endpoint("/token"),
        data={
            "grant_type": "refresh_token",
            "refresh_token": answer["refresh_token"],
            "client_id": "spa",
        },
    ) as response:
        assert response.status == 400
        assert (await response.json())["error"] == "invalid_dpop_proof"
