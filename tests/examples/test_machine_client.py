"""examples/machine_client.py against a real authorization server and a real gateway.

The script runs as a separate process (as the walkthrough runs it) or, where only its
behaviour matters, through its `run` coroutine in this event loop. What it prints is compared
with what the echo upstream behind the gateway received, and the token that reached the
upstream is verified against the authorization server's published keys.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
from pathlib import Path

import pytest

from examples import machine_client
from tests.authserver.conftest import SECRET, verify_jwt
from tests.examples.conftest import ODD_CLIENT_ID, ODD_SECRET, Stack
from tests.support import header_values

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "machine_client.py"


async def run_script(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The script as its own process; this loop keeps serving the servers meanwhile."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCRIPT),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    out, _ = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode is not None
    return process.returncode, out.decode()


async def run_in_loop(
    stack: Stack,
    *,
    issuer: str | None = None,
    client_id: str = "demo-machine",
    client_secret: str = SECRET,
    api: str | None = None,
    scope: str | None = None,
    paths: tuple[str, ...] = machine_client.DEFAULT_PATHS,
) -> tuple[int, str]:
    """`machine_client.run` in this loop, against the stack unless told otherwise."""
    out = io.StringIO()
    status = await machine_client.run(
        issuer=issuer or stack.auth.settings.issuer,
        client_id=client_id,
        client_secret=client_secret,
        api=api or stack.gateway.url,
        scope=scope,
        paths=paths,
        out=out,
    )
    return status, out.getvalue()


async def test_machine_client_calls_the_api_through_the_gateway_with_a_client_credentials_token(
    stack: Stack, http
):
    status, out = await run_script(
        "--issuer", stack.auth.settings.issuer,
        "--client-id", "demo-machine",
        "--client-secret", SECRET,
        "--api", stack.gateway.url,
    )  # fmt: skip
    assert status == 0, out
    assert (
        "access token for demo-machine: scope 'orders:read orders:write', expires in 300 s" in out
    )
    assert "GET /me -> 200" in out and "GET /orders?limit=5 -> 200" in out

    seen = stack.upstream.requests
    assert [r["raw_path"] for r in seen] == ["/me", "/orders?limit=5"]
    for request in seen:
        # The subject of a client_credentials token is the client itself.
        assert header_values(request, "X-Auth-Subject") == ["demo-machine"]
        assert header_values(request, "X-Auth-Client-Id") == ["demo-machine"]
        assert header_values(request, "X-Auth-Scopes") == ["orders:read orders:write"]
    (authorization,) = header_values(seen[0], "Authorization")
    scheme, token = authorization.split(" ", 1)
    assert scheme == "Bearer"
    claims = await verify_jwt(http, stack.auth, token, audience="orders-api", typ="at+jwt")
    assert (claims["sub"], claims["client_id"]) == ("demo-machine", "demo-machine")
    # Same token for both calls: one token request, not one per call.
    assert header_values(seen[1], "Authorization") == [authorization]
    # What it printed is what the upstream answered (the echo of the request).
    assert '"raw_path": "/orders?limit=5"' in out


async def test_machine_client_reads_its_secret_from_the_environment(stack: Stack):
    status, out = await run_script(
        "--issuer", stack.auth.settings.issuer,
        "--client-id", "demo-machine",
        "--api", stack.gateway.url,
        "--path", "/orders",
        env={"MACHINE_CLIENT_SECRET": SECRET},
    )  # fmt: skip
    assert status == 0, out
    assert "GET /orders -> 200" in out
    assert [r["raw_path"] for r in stack.upstream.requests] == ["/orders"]


async def test_machine_client_without_a_secret_stops_before_any_request(stack: Stack):
    status, out = await run_script(
        "--issuer", stack.auth.settings.issuer,
        "--client-id", "demo-machine",
        "--api", stack.gateway.url,
        env={"MACHINE_CLIENT_SECRET": ""},
    )  # fmt: skip
    assert status == 2  # argparse's usage error
    assert "give --client-secret or set MACHINE_CLIENT_SECRET" in out
    assert stack.upstream.requests == []


async def test_scope_option_asks_for_less_and_the_token_carries_only_that(stack: Stack):
    status, out = await run_in_loop(stack, scope="orders:read", paths=("/orders",))
    assert status == 0, out
    assert "scope 'orders:read'" in out
    (seen,) = stack.upstream.requests
    assert header_values(seen, "X-Auth-Scopes") == ["orders:read"]


async def test_a_wrong_secret_gets_no_token_and_nothing_reaches_the_api(stack: Stack):
    status, out = await run_in_loop(stack, client_secret="not-the-secret-" + "x" * 20)
    assert status == 2
    assert out.strip() == ("no access token: 401 invalid_client: client authentication failed")
    assert stack.upstream.requests == []


async def test_id_and_secret_with_reserved_characters_are_form_encoded_in_basic_auth(
    stack: Stack,
):
    # Sent raw, the ":" in the id would split it at the wrong place and "+" or "%" would
    # decode to something else: the server would refuse the client.
    status, out = await run_in_loop(
        stack, client_id=ODD_CLIENT_ID, client_secret=ODD_SECRET, paths=("/me",)
    )
    assert status == 0, out
    (seen,) = stack.upstream.requests
    assert header_values(seen, "X-Auth-Client-Id") == [ODD_CLIENT_ID]


async def test_a_call_the_gateway_refuses_makes_the_exit_status_1_and_shows_the_challenge(
    stack: Stack,
):
    status, out = await run_in_loop(stack, scope="orders:read", paths=("/orders", "/reports/daily"))
    assert status == 1
    assert "GET /orders -> 200" in out
    assert "GET /reports/daily -> 403" in out
    assert 'error=\\"insufficient_scope\\"' in out  # the challenge, as printed JSON
    assert '"code": "insufficient_scope"' in out
    assert [r["raw_path"] for r in stack.upstream.requests] == ["/orders"]


async def test_an_unreachable_issuer_gets_no_token(stack: Stack, refused_port: int):
    closed = f"http://127.0.0.1:{refused_port}"
    status, out = await run_in_loop(stack, issuer=closed)
    assert status == 2
    assert out.startswith(f"no access token: cannot reach {closed} (")
    assert stack.upstream.requests == []


async def test_a_discovery_document_naming_another_issuer_is_not_trusted(stack: Stack):
    # The server answers for its own issuer only; asked under another spelling of its
    # address, its document names a different issuer, and the client must stop there.
    other_spelling = stack.auth.settings.issuer.replace("127.0.0.1", "localhost")
    status, out = await run_in_loop(stack, issuer=other_spelling)
    assert status == 2
    assert (
        f"no access token: the discovery document names issuer '{stack.auth.settings.issuer}'"
        in out
    )
    assert stack.upstream.requests == []


@pytest.mark.parametrize("trailing", ["", "/"])
async def test_a_trailing_slash_on_the_urls_is_tolerated(stack: Stack, trailing: str):
    status, out = await run_in_loop(
        stack,
        issuer=stack.auth.settings.issuer + trailing,
        api=stack.gateway.url + trailing,
        paths=("/me",),
    )
    assert status == 0, out
    assert [r["raw_path"] for r in stack.upstream.requests] == ["/me"]
