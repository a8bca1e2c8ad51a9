"""Secrets from files, as Docker and Kubernetes mount them: `client_secret_file` and
`${file:PATH}` give the gateway its introspection credentials without the file's line break."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway import settings as gateway_settings
from tests.support import (
    IntrospectionServer,
    call,
    gateway_yaml,
    issuer_entry,
    running_gateway,
)


@pytest.fixture
async def server() -> AsyncIterator[IntrospectionServer]:
    introspection = await IntrospectionServer().start()
    yield introspection
    await introspection.stop()


@pytest.mark.parametrize("form", ["client_secret_file", "${file:PATH}"])
async def test_introspection_credentials_come_from_a_secret_file(
    server, upstream, client, tmp_path: Path, form: str
):
    secret = tmp_path / "gateway-secret"
    secret.write_text(server.client_secret + "\n")  # as `echo` and `kubectl create` write it
    given = (
        f'client_secret_file: "{secret}"'
        if form == "client_secret_file"
        else f'client_secret: "${{file:{secret}}}"'
    )
    entry = issuer_entry(
        server.url, mode="introspection", introspection=f"{{client_id: gateway, {given}}}"
    )
    server.active("opaque-token")
    async with running_gateway(gateway_yaml(server.url, upstream.url, issuers=[entry])) as gw:
        answer = await call(client, gw.url + "/orders/1", "opaque-token")
    assert answer.status == 200, answer.body
    assert [c["credentials"] for c in server.calls] == [("gateway", server.client_secret)]


async def test_a_reload_takes_a_rotated_secret_file(server, upstream, client, tmp_path: Path):
    secret = tmp_path / "gateway-secret"
    secret.write_text("an-old-secret\n")
    entry = issuer_entry(
        server.url,
        mode="introspection",
        introspection=f'{{client_id: gateway, client_secret_file: "{secret}", cache_ttl: 0s}}',
    )
    server.active("opaque-token")
    config = gateway_yaml(server.url, upstream.url, issuers=[entry])
    async with running_gateway(config, config_file=tmp_path / "gateway.yaml") as gw:
        refused = await call(client, gw.url + "/orders/1", "opaque-token")
        assert refused.status == 503  # the issuer refuses the old credentials

        secret.write_text(server.client_secret + "\n")
        assert await gw.gateway.reload()  # what SIGHUP does
        answer = await call(client, gw.url + "/orders/1", "opaque-token")
    assert answer.status == 200, answer.body
    assert [c["credentials"][1] for c in server.calls] == ["an-old-secret", server.client_secret]


def test_the_access_log_hash_key_may_come_from_a_file(tmp_path: Path):
    key = tmp_path / "log-key"
    key.write_text("k3y-from-a-file\n")
    text = gateway_yaml(
        "https://auth.example.com",
        "http://127.0.0.1:9",
        extra=f'access_log: {{subject: hashed, subject_hash_key_file: "{key}"}}\n',
    )
    settings = gateway_settings.load_text(text, "gw.yaml", {})
    assert settings.access_log.subject_hash_key == "k3y-from-a-file"
