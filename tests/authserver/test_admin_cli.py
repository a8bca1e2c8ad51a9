"""`portcullis-authserver clients …` and `users …` against a running server, as a person
and as a script would run them: a process of its own, credentials from the environment."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.authserver.admin_support import StartAdminServer, start_admin_server
from tests.authserver.conftest import SECRET, RunningAuthServer, client_credentials
from tests.certificates import CertificateAuthority

__all__ = ["start_admin_server"]  # fixtures

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.parametrize("start_admin_server", ["sqlite"], indirect=True)


async def cli(
    server: RunningAuthServer,
    *args: str,
    stdin: str = "",
    secret: str = SECRET,
    env: dict[str, str] | None = None,
) -> tuple[int, str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PORTCULLIS_ISSUER": server.settings.issuer,
        "PORTCULLIS_ADMIN_CLIENT_ID": "admin-cli",
        "PORTCULLIS_ADMIN_CLIENT_SECRET": secret,
        **(env or {}),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "authserver",
        *args,
        env=env,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(stdin.encode()), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_clients_commands_add_list_show_rotate_and_delete(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    server = await start_admin_server()
    code, out, err = await cli(
        server,
        "clients",
        "add",
        "--id",
        "reports",
        "--name",
        "Reports",
        "--grant-type",
        "client_credentials",
        "--json",
    )
    assert code == 0, err
    created = json.loads(out)
    assert created["clientId"] == "reports" and "shown this once" not in err
    status, _ = await client_credentials(
        http, server, client_id="reports", secret=created["clientSecret"]
    )
    assert status == 200

    code, out, _ = await cli(server, "clients", "list")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == [
        "clientId",
        "clientName",
        "tokenEndpointAuthMethod",
        "grantTypes",
        "managedBy",
    ]
    assert any(row.split()[:2] == ["reports", "Reports"] for row in rows)
    code, out, _ = await cli(server, "clients", "list", "--json")
    assert "reports" in {c["clientId"] for c in json.loads(out)}

    code, out, err = await cli(server, "clients", "rotate-secret", "reports")
    assert code == 0 and "shown this once" in err
    secret = next(line.split()[1] for line in out.splitlines() if line.startswith("clientSecret"))
    assert secret != created["clientSecret"]
    code, out, _ = await cli(server, "clients", "show", "reports", "--json")
    assert "clientSecret" not in json.loads(out)

    code, out, _ = await cli(server, "clients", "delete", "reports")
    assert code == 0 and "deleted" in out
    code, _, err = await cli(server, "clients", "show", "reports")
    assert code == 1 and err.startswith("not_found")
    code, _, err = await cli(server, "clients", "delete", "web")
    assert code == 1 and err.startswith("managed_by_config")


async def test_users_commands_add_set_password_disable_and_delete(
    start_admin_server: StartAdminServer,
) -> None:
    server = await start_admin_server()
    code, out, err = await cli(
        server,
        "users",
        "add",
        "heidi",
        "--email",
        "heidi@example.com",
        "--role",
        "auditor",
        "--password-stdin",
        "--json",
        stdin="heidi-password\n",
    )
    assert code == 0, err
    user = json.loads(out)
    assert (user["username"], user["roles"]) == ("heidi", ["auditor"])
    code, _, err = await cli(
        server, "users", "set-password", "heidi", "--password-stdin", stdin="short\n"
    )
    assert code == 1 and "validation_error" in err and "password:" in err
    code, out, _ = await cli(
        server, "users", "set-password", "heidi", "--password-stdin", stdin="a-new-password\n"
    )
    assert code == 0
    code, out, _ = await cli(server, "users", "disable", "heidi", "--json")
    assert code == 0 and json.loads(out)["disabled"] is True
    code, out, _ = await cli(server, "users", "list")
    [row] = [line for line in out.splitlines() if " heidi " in line]
    assert "yes" in row.split()
    code, out, _ = await cli(server, "users", "delete", user["id"])
    assert code == 0
    code, out, _ = await cli(server, "users", "list", "--json")
    assert "heidi" not in {u["username"] for u in json.loads(out)}


async def test_wrong_credentials_are_reported_without_a_traceback(
    start_admin_server: StartAdminServer,
) -> None:
    server = await start_admin_server()
    code, out, err = await cli(server, "clients", "list", secret="wrong-" + SECRET)
    assert code == 1 and out == ""
    assert err.startswith("no admin token: invalid_client") and "Traceback" not in err


async def test_the_commands_trust_a_private_ca_when_told_to_and_say_how_when_not(
    start_admin_server: StartAdminServer, tmp_path: Path
) -> None:
    ca = CertificateAuthority()
    cert_file, key_file = ca.server("auth-admin").write(tmp_path, "auth")
    ca_file = ca.write(tmp_path)

    def on_tls(config: dict[str, Any]) -> None:
        config["issuer"] = "https://127.0.0.1:{port}"
        config["tls"] = {"cert_file": str(cert_file), "key_file": str(key_file)}
        for client in config["clients"]:
            resources = client.get("resources", [])
            client["resources"] = [r.replace("http://", "https://") for r in resources]

    server = await start_admin_server(on_tls)
    assert server.settings.issuer.startswith("https://127.0.0.1:")
    code, out, err = await cli(server, "clients", "list")
    assert code == 1
    assert "CERTIFICATE_VERIFY_FAILED" in err and "--ca-file" in err, err
    assert "Traceback" not in err
    code, out, err = await cli(server, "clients", "list", "--ca-file", str(ca_file))
    assert (code, err) == (0, ""), err
    assert "admin-cli" in out
    code, out, err = await cli(
        server, "clients", "list", env={"PORTCULLIS_ADMIN_CA_FILE": str(ca_file)}
    )
    assert (code, err) == (0, ""), err
