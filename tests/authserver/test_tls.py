"""The authorization server on TLS (its own certificate files, followed as they rotate), and
its secrets from files."""

from __future__ import annotations

import asyncio
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.authserver.conftest import (
    PASSWORD_HASH,
    SECRET,
    client_credentials,
    default_config,
    load_settings,
    render_config,
)
from tests.certificates import CertificateAuthority, client_context, legacy_client_context
from tests.support import UNBOUND_PORT, RawConnection, reserve_port

ROOT = Path(__file__).resolve().parents[2]


def tls_config(ca: CertificateAuthority, directory: Path) -> dict[str, Any]:
    cert_file, key_file = ca.server("auth-one").write(directory, "auth")
    config = default_config()
    config["issuer"] = "https://127.0.0.1:{port}"
    config["tls"] = {"cert_file": str(cert_file), "key_file": str(key_file)}
    return config


async def peer_name(url: str, context: ssl.SSLContext) -> str:
    connection = await RawConnection.open(url, context)
    try:
        subject = connection.writer.get_extra_info("peercert")["subject"]
        return str(dict(rdn[0] for rdn in subject)["commonName"])
    finally:
        connection.close()


async def test_the_server_speaks_tls_and_its_metadata_names_https_endpoints(
    start_authserver, tmp_path
):
    ca = CertificateAuthority()
    server = await start_authserver(tls_config(ca, tmp_path))
    assert server.url.startswith("https://127.0.0.1:")
    context = client_context(ca)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as http:
        async with http.get(server.url + "/.well-known/openid-configuration") as response:
            assert response.status == 200
            metadata = await response.json()
        status, body = await client_credentials(http, server)
    assert metadata["issuer"] == server.url
    assert metadata["token_endpoint"] == server.url + "/token"
    assert status == 200, body
    connection = await RawConnection.open(server.url, context)
    assert connection.writer.get_extra_info("ssl_object").version() == "TLSv1.3"
    connection.close()

    with pytest.raises((ssl.SSLError, ConnectionError)):
        await RawConnection.open(server.url, legacy_client_context(ca))


async def test_a_client_secret_from_a_file_authenticates_the_client(start_authserver, tmp_path):
    secret_file = tmp_path / "machine-secret"
    secret_file.write_text(SECRET + "\n")
    config = default_config()
    machine = next(c for c in config["clients"] if c["client_id"] == "machine")
    del machine["client_secret"]
    machine["client_secret_file"] = str(secret_file)
    server = await start_authserver(config)
    async with aiohttp.ClientSession() as http:
        status, body = await client_credentials(http, server)
        assert status == 200, body
        status, body = await client_credentials(http, server, secret=SECRET + "\n")
        assert (status, body["error"]) == (401, "invalid_client")


@pytest.mark.slow
async def test_run_serves_tls_and_follows_a_rotated_certificate(tmp_path):
    ca = CertificateAuthority()
    port = reserve_port()
    config = tmp_path / "authserver.yaml"
    config.write_text(render_config(tls_config(ca, tmp_path), tmp_path, port))
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "authserver", "run", "--config", str(config)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"https://127.0.0.1:{port}"
    context = client_context(ca)
    try:
        deadline = time.monotonic() + 20
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as http:
            while True:
                assert process.poll() is None, log.read_text()
                try:
                    async with http.get(url + "/healthz") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                assert time.monotonic() < deadline, log.read_text()
                await asyncio.sleep(0.05)
        assert await peer_name(url, context) == "auth-one"

        ca.server("auth-two").write(tmp_path, "auth")  # no signal: the files are watched
        names = [await peer_name(url, context)]
        while names[-1] != "auth-two" and len(names) < 100:
            await asyncio.sleep(0.1)
            names.append(await peer_name(url, context))
        assert names[-1] == "auth-two", log.read_text()
        assert "TLS certificate reloaded" in log.read_text()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_a_password_hash_may_come_from_a_file(tmp_path):
    hash_file = tmp_path / "alice.hash"
    hash_file.write_text(PASSWORD_HASH + "\n")
    config = default_config()
    alice = next(u for u in config["users"] if u["username"] == "alice")
    del alice["password_hash"]
    alice["password_hash_file"] = str(hash_file)
    settings = load_settings(config, tmp_path, UNBOUND_PORT)
    user = settings.user("alice")
    assert user is not None and user.password_hash == PASSWORD_HASH
