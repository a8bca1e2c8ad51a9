"""Zero-downtime key rotation across both components: the authorization server rotates its
signing key on its own schedule while fresh tokens flow through the gateway, and not one
request is refused; a token signed by a key that has since been removed is refused.

The keys live in a directory (SQLite storage) or sealed in PostgreSQL, where the servers
read the ring again every `keys.reload_every` (1 s): the same guarantees hold for both.

The times are shortened for the test the way an operator would shorten them: the JWKS may
be cached 1 s (`keys.jwks_max_age`), a new key is published 1 s (`keys.publish_ahead`) plus
the servers' notice time before it signs, and the gateway refreshes its copy of the key set
every 500 ms. Its refetch for an unknown kid cannot save a request: it never runs within 1 s
of another fetch (and these come every 500 ms), and at most once an hour: every token must
be verifiable with keys the gateway already holds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from cryptography.hazmat.primitives import serialization

from authserver.stored_keys import KeyCipher
from tests.authserver.conftest import client_credentials, default_config
from tests.authserver.postgres_support import fresh_schema, postgres_url_or_skip
from tests.authserver.rotation_support import eventually, kid_of, published
from tests.support import (
    EchoUpstream,
    assert_invalid_token,
    call,
    gateway_yaml,
    issuer_entry,
    running_gateway,
    wait_for,
)

GATEWAY_JWKS = "{min_ttl: 100ms, max_ttl: 500ms, refetch_cooldown: 1h}"
WORKERS = 3


def rotating_config() -> dict[str, Any]:
    config = default_config()
    config["keys"] = {"jwks_max_age": "1s", "publish_ahead": "1s", "rotate_every": "4s"}
    config["lifetimes"] = {"access_token": "2s", "id_token": "2s"}
    return config


def forged(private_pem: bytes, kid: str, issuer: str) -> str:
    """A fresh, otherwise valid access token signed with a key the test read from the
    server's key directory."""
    key = serialization.load_pem_private_key(private_pem, None)
    now = int(time.time())
    claims = {
        "iss": issuer,
        "sub": "machine",
        "aud": "orders-api",
        "iat": now,
        "exp": now + 60,
        "jti": uuid.uuid4().hex,
        "client_id": "machine",
        "scope": "orders:read",
    }
    return jwt.encode(claims, key, algorithm="ES256", headers={"kid": kid, "typ": "at+jwt"})


@pytest.fixture(params=["directory", "postgresql"])
async def keys_kept(request: pytest.FixtureRequest) -> AsyncIterator[dict[str, Any]]:
    """Keys in a directory (SQLite storage), or sealed in PostgreSQL (a schema of its own)."""
    if request.param == "directory":
        yield {}
        return
    url = await postgres_url_or_skip()
    async with fresh_schema(url) as schema:
        yield {"storage": f"{url}?search_path={schema}"}


async def private_pem(server: Any, kid: str) -> bytes:
    """The private key `kid` as the server keeps it: a PEM file, or a sealed row."""
    if server.settings.keys.dir is not None:
        return (Path(server.settings.keys.dir) / f"{kid}.pem").read_bytes()
    ring = await server.services.store.signing_keys()
    (sealed,) = [key.sealed_private_key for key in ring.keys if key.kid == kid]
    key = KeyCipher.from_setting(server.settings.keys.encryption_key).open(kid, sealed)
    return bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


async def test_tokens_keep_passing_the_gateway_while_keys_rotate_and_a_removed_keys_do_not(
    start_authserver: Any, http: aiohttp.ClientSession, keys_kept: dict[str, Any]
) -> None:
    server = await start_authserver({**rotating_config(), **keys_kept}, fresh_keys=True)
    issuer = server.settings.issuer
    upstream = await EchoUpstream().start()
    config = gateway_yaml(
        issuer,
        upstream.url,
        issuers=[issuer_entry(issuer, algorithms=("ES256",))],
        jwks=GATEWAY_JWKS,
    )
    try:
        async with running_gateway(config) as gateway:
            url = gateway.url + "/orders/1"
            status, body = await client_credentials(http, server, scope="orders:read")
            assert status == 200, body
            first = kid_of(body["access_token"])
            first_pem = await private_pem(server, first)
            # A token made with the first key passes while the key is published, so what
            # refuses it at the end is the key's removal and nothing else.
            answer = await call(http, url, forged(first_pem, first, issuer))
            assert answer.status == 200, answer.body

            results: list[tuple[int, str]] = []
            stop = asyncio.Event()

            async def traffic() -> None:
                while not stop.is_set():
                    got, tokens = await client_credentials(http, server, scope="orders:read")
                    assert got == 200, tokens
                    answer = await call(http, url, tokens["access_token"])
                    results.append((answer.status, kid_of(tokens["access_token"])))

            workers = [asyncio.create_task(traffic()) for _ in range(WORKERS)]
            try:

                async def two_rotations_done() -> bool:
                    return len({kid for _, kid in results}) >= 3

                await eventually(two_rotations_done, 14, "two rotations under traffic", every=0.1)
            finally:
                stop.set()
                await asyncio.gather(*workers)

            refused = [(status, kid) for status, kid in results if status != 200]
            assert refused == [], f"{len(refused)} of {len(results)} requests refused"
            kids = list(dict.fromkeys(kid for _, kid in results))
            assert len(kids) == 3 and kids[0] == first
            assert len(results) >= 100
            forwarded = len(upstream.requests)
            assert forwarded >= len(results)

            async def first_key_removed() -> bool:
                return first not in await published(http, server)

            await eventually(first_key_removed, 6, "the first key's removal")
            # The gateway's next refresh of the key set (max_ttl: 500ms) drops it too.
            keys = gateway.gateway.keysets[issuer]
            await wait_for(lambda: not keys.knows(first), 5, "the gateway's refreshed key set")
            answer = await call(http, url, forged(first_pem, first, issuer))
            assert_invalid_token(answer, "the token is signed with an unknown key")
            assert len(upstream.requests) == forwarded
    finally:
        await upstream.stop()
