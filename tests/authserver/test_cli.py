"""`portcullis-authserver` as a user runs it: check, hash-password, run; and durability: a
refresh token issued before a restart, or before `kill -9`, still works afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest

from authserver import settings as authserver_settings
from authserver import users
from tests.authserver.conftest import (
    RunningAuthServer,
    authorize_code,
    default_config,
    exchange_code,
    fetch_jwks,
    introspect,
    load_settings,
    post_token,
    query_of,
    run_authserver,
    tokens_for,
    verify_jwt,
)
from tests.authserver.process_support import Process, write_config
from tests.support import reserve_port

ROOT = Path(__file__).resolve().parents[2]


def cli(
    *args: str, stdin: str | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "authserver", *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# ---------------------------------------------------------------------------- check


def test_check_accepts_a_valid_config(tmp_path):
    path = write_config(tmp_path, default_config())
    result = cli("check", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{path}: OK"


@pytest.mark.parametrize("policy", ["strict", "compat"])
def test_check_warns_while_client_assertions_may_name_the_token_endpoint(tmp_path, policy):
    config = default_config()
    config["client_assertion_audience"] = policy
    path = write_config(tmp_path, config)
    result = cli("check", "--config", str(path))
    assert result.returncode == 0, result.stderr  # a warning does not fail the check
    assert result.stdout.strip() == f"{path}: OK"
    warnings = result.stderr.splitlines()
    if policy == "strict":
        assert warnings == []
    else:
        (warning,) = warnings
        assert warning.startswith(f"{path}: warning: client_assertion_audience: compat ")
        assert "token endpoint URL" in warning


def test_check_prints_every_problem_as_file_line_message(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        'issuer: "http://auth.example.com"\n'
        'storage: "sqlite:///x.db"\n'
        "keys: {dir: keys}\n"
        "clients:\n"
        "  - client_id: app\n"
        "    token_endpoint_auth_method: none\n"
        '    redirect_uris: ["http://127.0.0.1/cb"]\n'
        "    require_pkce: false\n"
        "    colour: blue\n"
    )
    result = cli("check", "--config", str(path))
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 3, result.stderr
    assert lines[0].startswith(f"{path}:1: config.issuer: ")
    assert lines[1] == f"{path}:8: client 'app': public clients always use PKCE"
    assert lines[2].startswith(f"{path}:9: client 'app': unknown key 'colour'")


def test_check_refuses_password_sign_in_off_with_no_other_way_in(tmp_path):
    config = default_config()
    config["password_sign_in"] = False
    path = write_config(tmp_path, config)
    result = cli("check", "--config", str(path))
    assert result.returncode == 1 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{path}:")
    assert "config.password_sign_in: false leaves nobody a way to sign in" in line
    assert "identity_providers" in line and "passkeys" in line


def test_check_reports_a_missing_file(tmp_path):
    result = cli("check", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 1
    assert "nope.yaml:0: cannot read" in result.stderr


def test_run_refuses_an_invalid_config_with_its_problems(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("issuer: 1\n")
    result = cli("run", "--config", str(path))
    assert result.returncode == 1
    assert f"{path}:1: config.issuer: " in result.stderr
    assert f"{path}:1: config: storage is required" in result.stderr


def line_of(text: str, marker: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if marker in line)


def config_needing_what_is_missing(directory: Path) -> dict[str, Any]:
    """A config whose secrets, certificate files and database directory are all missing."""
    config = default_config()
    config["issuer"] = "https://127.0.0.1:{port}"
    clients = {c["client_id"]: c for c in config["clients"]}
    clients["machine"]["client_secret"] = "${PORTCULLIS_TEST_UNSET_SECRET}"
    del clients["web"]["client_secret"]
    clients["web"]["client_secret_file"] = str(directory / "secrets" / "web")
    config["tls"] = {
        "cert_file": str(directory / "tls" / "tls.crt"),
        "key_file": str(directory / "tls" / "tls.key"),
    }
    config["storage"] = f"sqlite://{directory / 'absent' / 'authserver.db'}"
    return config


def test_check_reports_missing_secrets_certificates_and_database_directory_on_their_lines(
    tmp_path,
):
    path = write_config(tmp_path, config_needing_what_is_missing(tmp_path))
    text = path.read_text()
    result = cli("check", "--config", str(path))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"{path}:{line_of(text, 'storage:')}: config.storage: the database's directory "
        f"{tmp_path / 'absent'} does not exist",
        f"{path}:{line_of(text, 'PORTCULLIS_TEST_UNSET_SECRET')}: environment variable "
        "PORTCULLIS_TEST_UNSET_SECRET is not set (use ${PORTCULLIS_TEST_UNSET_SECRET:-default})",
        f"{path}:{line_of(text, 'client_secret_file')}: client 'web'.client_secret_file: "
        f"cannot read {tmp_path / 'secrets' / 'web'}: No such file or directory",
        f"{path}:{line_of(text, 'cert_file')}: tls.cert_file: cannot read "
        f"{tmp_path / 'tls' / 'tls.crt'}: No such file or directory",
        f"{path}:{line_of(text, 'key_file')}: tls.key_file: cannot read "
        f"{tmp_path / 'tls' / 'tls.key'}: No such file or directory",
    ]
    run = cli("run", "--config", str(path))
    assert run.returncode == 1
    assert run.stderr.splitlines() == result.stderr.splitlines()


def test_key_commands_need_no_secret_certificate_or_database(tmp_path):
    path = write_config(tmp_path, config_needing_what_is_missing(tmp_path))
    rotated = cli("keys", "rotate", "--config", str(path), "--alg", "ES256")
    assert rotated.returncode == 0, rotated.stderr
    listed = cli("keys", "list", "--config", str(path), "--json")
    assert listed.returncode == 0, listed.stderr
    assert {key["alg"] for key in json.loads(listed.stdout)} >= {"ES256"}
    assert not (tmp_path / "absent").exists()


def test_check_reports_a_database_directory_that_is_not_writable(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root may write anywhere: no directory is unwritable to it")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    config = default_config()
    config["storage"] = f"sqlite://{locked / 'authserver.db'}"
    path = write_config(tmp_path, config)
    result = cli("check", "--config", str(path))
    assert result.returncode == 1
    assert result.stderr.strip().endswith(f"the database's directory {locked} is not writable")


def test_check_reports_a_database_path_under_a_regular_file(tmp_path):
    (tmp_path / "file").write_text("")
    config = default_config()
    config["storage"] = f"sqlite://{tmp_path / 'file' / 'authserver.db'}"
    path = write_config(tmp_path, config)
    result = cli("check", "--config", str(path))
    assert result.returncode == 1
    assert result.stderr == (
        f"{path}:{line_of(path.read_text(), 'storage:')}: config.storage: the database's "
        f"directory {tmp_path / 'file'} does not exist\n"
    )


# The CLI in a Python where `import asyncpg` fails, as where the postgres extra is not
# installed (a None in sys.modules stops the import).
WITHOUT_ASYNCPG = (
    "import sys; sys.modules['asyncpg'] = None; "
    "from authserver.__main__ import main; sys.exit(main(sys.argv[1:]))"
)


def test_check_reports_postgresql_storage_without_its_driver_as_run_would_meet_it(tmp_path):
    config = default_config()
    config["storage"] = f"postgresql://portcullis@127.0.0.1:{reserve_port()}/portcullis"
    path = write_config(tmp_path, config)
    line = line_of(path.read_text(), "storage:")
    expected = [
        f"{path}:{line}: config.storage: PostgreSQL storage needs asyncpg, which cannot be "
        "imported here (import of asyncpg halted; None in sys.modules): install "
        "portcullis[postgres]"
    ]
    for command in ("check", "run"):
        result = subprocess.run(
            [sys.executable, "-c", WITHOUT_ASYNCPG, command, "--config", str(path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert (result.returncode, result.stderr.splitlines()) == (1, expected), command
        assert "OK" not in result.stdout
    # With the driver there, the same file passes (check connects to no database).
    installed = cli("check", "--config", str(path))
    assert (installed.returncode, installed.stdout) == (0, f"{path}: OK\n"), installed.stderr


def test_the_config_file_may_be_named_by_the_environment(tmp_path):
    path = write_config(tmp_path, default_config())
    env = {**os.environ, "PORTCULLIS_AUTHSERVER_CONFIG": str(path)}
    result = subprocess.run(
        [sys.executable, "-m", "authserver", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (result.returncode, result.stdout.strip()) == (0, f"{path}: OK"), result.stderr
    env.pop("PORTCULLIS_AUTHSERVER_CONFIG")
    missing = subprocess.run(
        [sys.executable, "-m", "authserver", "keys", "list"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert missing.returncode == 2
    assert "--config FILE is required (or set PORTCULLIS_AUTHSERVER_CONFIG)" in missing.stderr


# ---------------------------------------------------------------------------- hash-password


def test_hash_password_from_stdin_prints_a_hash_that_verifies(tmp_path):
    result = cli("hash-password", "--stdin", stdin="correct horse battery staple \n")
    assert result.returncode == 0, result.stderr
    hashed = result.stdout.strip()
    assert result.stdout == hashed + "\n"
    assert users.is_hash(hashed)
    assert "correct horse" not in hashed
    assert users.verify_password("correct horse battery staple ", hashed)
    assert not users.verify_password("correct horse battery staple", hashed)
    assert not users.verify_password("Correct horse battery staple ", hashed)

    again = cli("hash-password", "--stdin", stdin="correct horse battery staple \n")
    assert again.stdout.strip() != hashed  # a new salt every time


def test_hash_password_refuses_an_empty_password():
    result = cli("hash-password", "--stdin", stdin="\n")
    assert result.returncode == 1
    assert result.stdout == ""
    assert "empty password" in result.stderr


async def test_a_password_hashed_by_the_cli_passes_check_and_signs_the_user_in(
    start_authserver, http, tmp_path
):
    hashed = cli("hash-password", "--stdin", stdin="open sesame\r\n").stdout.strip()
    config = default_config()
    config["users"] = [{"username": "dave", "password_hash": hashed}]
    checked = cli("check", "--config", str(write_config(tmp_path, config)))
    assert checked.returncode == 0, checked.stderr
    server = await start_authserver(config)
    result = await authorize_code(
        http, server, scope="openid", username="dave", password="open sesame"
    )
    status, body = await exchange_code(http, server, result)
    assert status == 200, body
    claims = await verify_jwt(http, server, body["id_token"], audience="spa")
    assert claims["sub"] == server.settings.subject_of(server.settings.user("dave"))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- durability


async def refresh(
    http: aiohttp.ClientSession, server: RunningAuthServer, token: str
) -> tuple[int, dict[str, Any]]:
    status, body, _ = await post_token(
        http, server, {"grant_type": "refresh_token", "refresh_token": token, "client_id": "spa"}
    )
    return status, body


async def test_refresh_token_issued_before_a_restart_works_after_it(start_authserver, http):
    config = default_config()
    config["refresh_grace"] = "0s"  # a second use right after the rotation is reuse
    server = await start_authserver(config)
    before = await tokens_for(http, server)
    kid = jwt.get_unverified_header(before["access_token"])["kid"]

    await server.restart()

    assert kid in {k["kid"] for k in (await fetch_jwks(http, server))["keys"]}
    assert (await introspect(http, server, before["access_token"]))["active"] is True
    status, after = await refresh(http, server, before["refresh_token"])
    assert status == 200, after
    assert after["refresh_token"] != before["refresh_token"]
    await verify_jwt(http, server, after["access_token"], audience="orders-api", typ="at+jwt")
    # The rotation happened before the restart's successor: reuse is still detected.
    status, reused = await refresh(http, server, before["refresh_token"])
    assert (status, reused["error"]) == (400, "invalid_grant")


@pytest.fixture
def process(tmp_path: Path) -> Iterator[Process]:
    port = reserve_port()
    path = write_config(tmp_path, default_config(), port)
    running = Process(path, f"http://127.0.0.1:{port}", tmp_path / "server.log")
    yield running
    running.kill()


@pytest.mark.slow
async def test_refresh_token_survives_kill_9_of_the_server_process(process, http):
    process.start()
    await process.wait_ready(http)
    settings = authserver_settings.load(str(process.config))
    server = RunningAuthServer(settings=settings, url=process.url, services=None)  # type: ignore[arg-type]
    before = await tokens_for(http, server)

    process.kill()
    assert process.proc is not None and process.proc.returncode == -signal.SIGKILL
    process.start()
    await process.wait_ready(http)

    status, after = await refresh(http, server, before["refresh_token"])
    assert status == 200, after
    await verify_jwt(http, server, after["access_token"], audience="orders-api", typ="at+jwt")
    await verify_jwt(http, server, before["id_token"], audience="spa")
    assert process.stop() == 0


# ---------------------------------------------------------------------------- a user removed


@pytest.fixture
async def bob_removed(
    start_authserver: Any, http: aiohttp.ClientSession
) -> AsyncIterator[tuple[RunningAuthServer, dict[str, Any]]]:
    """Bob signs in and gets tokens; the server restarts on the same port, database and keys
    with a configuration that no longer lists him."""
    first = await start_authserver()
    tokens = await tokens_for(http, first, username="bob")
    await first.stop()
    config = default_config()
    config["users"] = [u for u in config["users"] if u["username"] != "bob"]
    directory = Path(first.settings.keys.dir).parent
    second = await run_authserver(load_settings(config, directory, first.port))
    assert second.settings.issuer == first.settings.issuer
    try:
        yield second, tokens
    finally:
        await second.stop()


async def test_a_session_of_a_user_removed_from_the_config_signs_nobody_in(bob_removed, http):
    server, _ = bob_removed
    params = {
        "response_type": "code",
        "client_id": "spa",
        "redirect_uri": "http://127.0.0.1/cb",
        "scope": "openid",
        "state": "s",
        "code_challenge": "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM",
        "code_challenge_method": "S256",
        "prompt": "none",
    }
    async with http.get(server.endpoint("/authorize"), params=params, allow_redirects=False) as r:
        assert r.status == 302
        assert query_of(r.headers["Location"])["error"] == "login_required"


async def test_a_refresh_token_of_a_user_removed_from_the_config_is_refused(bob_removed, http):
    server, tokens = bob_removed
    status, body = await refresh(http, server, tokens["refresh_token"])
    assert (status, body.get("error")) == (400, "invalid_grant")
