"""TLS on the gateway's public listener, to the upstream, and to issuers with a private CA.

Certificates are made in the test (`tests.certificates`); every connection is a real TLS
connection on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway import settings as gateway_settings
from portcullis.yamlconf import ConfigError
from tests.certificates import (
    CertificateAuthority,
    client_context,
    legacy_client_context,
    replace_file,
    server_context,
)
from tests.support import (
    EchoUpstream,
    GatewayProcess,
    IntrospectionServer,
    RawConnection,
    RunningGateway,
    TestIssuer,
    assert_unavailable,
    call,
    gateway_yaml,
    header_values,
    issuer_entry,
    raw_request,
    running_gateway,
    wait_for,
)


@dataclass
class Pki:
    """A private CA, its certificate file, and the gateway's certificate and key files."""

    ca: CertificateAuthority
    directory: Path
    ca_file: Path
    cert_file: Path
    key_file: Path

    def tls(self, **options: str) -> str:
        """The gateway's `tls:` section as YAML text."""
        keys = {"cert_file": f'"{self.cert_file}"', "key_file": f'"{self.key_file}"', **options}
        return "tls: {" + ", ".join(f"{k}: {v}" for k, v in keys.items()) + "}\n"

    def rotate(self, common_name: str) -> None:
        self.ca.server(common_name).write(self.directory, "gateway")


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = CertificateAuthority()
    cert_file, key_file = ca.server("gateway-one").write(tmp_path, "gateway")
    return Pki(ca, tmp_path, ca.write(tmp_path), cert_file, key_file)


@pytest.fixture
async def tls_gateway(
    pki: Pki, issuer: TestIssuer, upstream: EchoUpstream
) -> AsyncIterator[RunningGateway]:
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, extra=pki.tls())) as gw:
        yield gw


async def peer_name(url: str, context: ssl.SSLContext) -> str:
    """The common name of the certificate a new connection to `url` is shown."""
    connection = await RawConnection.open(url, context)
    try:
        certificate = connection.writer.get_extra_info("peercert")
        return str(dict(rdn[0] for rdn in certificate["subject"])["commonName"])
    finally:
        connection.close()


async def get(connection: RawConnection, path: str) -> Any:
    await connection.send(raw_request("GET", path, host="127.0.0.1"))
    response = await connection.response()
    assert response.status == 200, response.body
    return response.json()


# ---------------------------------------------------------------------------- the listener


async def test_the_public_listener_speaks_tls_1_3_with_alpn_http_1_1(pki, tls_gateway):
    assert tls_gateway.url.startswith("https://127.0.0.1:")
    context = client_context(pki.ca)
    context.set_alpn_protocols(["h2", "http/1.1"])
    connection = await RawConnection.open(tls_gateway.url, context)
    try:
        ssl_object = connection.writer.get_extra_info("ssl_object")
        assert ssl_object.version() == "TLSv1.3"
        assert ssl_object.selected_alpn_protocol() == "http/1.1"
        seen = await get(connection, "/public/hello")
    finally:
        connection.close()
    assert header_values(seen, "X-Forwarded-Proto") == ["https"]


async def test_a_client_that_does_not_trust_the_ca_fails_the_handshake(tls_gateway):
    with pytest.raises(ssl.SSLCertVerificationError):
        await RawConnection.open(tls_gateway.url, client_context(CertificateAuthority("Other")))


async def test_clients_limited_to_tls_1_0_or_1_1_are_refused(pki, tls_gateway):
    legacy = legacy_client_context(pki.ca)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await RawConnection.open(tls_gateway.url, legacy)
    assert await peer_name(tls_gateway.url, client_context(pki.ca)) == "gateway-one"
    # The refusal is the gateway's: a server that still allows TLS 1.1 takes this client.
    assert await legacy_handshake_version(pki, legacy) == "TLSv1.1"


async def legacy_handshake_version(pki: Pki, client: ssl.SSLContext) -> str:
    permissive = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        permissive.minimum_version = ssl.TLSVersion.TLSv1
    permissive.set_ciphers("DEFAULT:@SECLEVEL=0")
    permissive.load_cert_chain(pki.cert_file, pki.key_file)

    async def close(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(close, "127.0.0.1", 0, ssl=permissive)
    try:
        port = server.sockets[0].getsockname()[1]
        connection = await RawConnection.open(f"https://127.0.0.1:{port}", client)
        version = str(connection.writer.get_extra_info("ssl_object").version())
        connection.close()
        return version
    finally:
        server.close()


async def test_min_version_1_3_refuses_a_tls_1_2_client(pki, issuer, upstream):
    config = gateway_yaml(issuer.url, upstream.url, extra=pki.tls(min_version="1.3"))
    async with running_gateway(config) as gw:
        old = client_context(pki.ca)
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await RawConnection.open(gw.url, old)
        assert await peer_name(gw.url, client_context(pki.ca)) == "gateway-one"


# ---------------------------------------------------------------------------- rotation


async def test_a_rotated_certificate_reaches_new_connections_while_an_open_one_keeps_working(
    pki, tls_gateway
):
    context = client_context(pki.ca)
    kept = await RawConnection.open(tls_gateway.url, context)
    try:
        await get(kept, "/public/before")

        pki.rotate("gateway-two")
        names: list[str] = []

        async def rotated() -> bool:
            names.append(await peer_name(tls_gateway.url, context))
            return names[-1] == "gateway-two"

        for _ in range(100):
            if await rotated():
                break
            await asyncio.sleep(0.1)
        assert names[-1] == "gateway-two", names

        # The connection made before the rotation is the same one, still up and served.
        await get(kept, "/public/after")
        certificate = kept.writer.get_extra_info("peercert")
        assert ("commonName", "gateway-one") in [rdn[0] for rdn in certificate["subject"]]
    finally:
        kept.close()
    assert tls_gateway.certificate is not None and tls_gateway.certificate.reloads >= 1


@pytest.mark.parametrize("breakage", ["garbage certificate", "key of another certificate"])
async def test_a_broken_new_pair_keeps_the_old_certificate_and_logs_why(
    pki, tls_gateway, caplog, breakage
):
    context = client_context(pki.ca)
    certificate = tls_gateway.certificate
    assert certificate is not None
    caplog.set_level(logging.ERROR, logger="portcullis.tls")
    if breakage == "garbage certificate":
        replace_file(pki.cert_file, b"-----BEGIN CERTIFICATE-----\nbroken\n")
    else:
        replace_file(pki.cert_file, pki.ca.server("gateway-two").cert_pem)

    await wait_for(lambda: certificate.failures >= 1, timeout=10, what="a failed reload")
    assert await peer_name(tls_gateway.url, context) == "gateway-one"
    assert certificate.reloads == 0
    errors = [r for r in caplog.records if r.getMessage().startswith("TLS certificate not")]
    assert errors and errors[0].cert_file == str(pki.cert_file)
    assert "PRIVATE KEY" not in caplog.text

    # A whole pair written afterwards is taken.
    pki.rotate("gateway-three")
    await wait_for(lambda: certificate.reloads >= 1, timeout=10, what="a reload")
    assert await peer_name(tls_gateway.url, context) == "gateway-three"


@pytest.mark.slow
async def test_run_serves_tls_and_reloads_the_certificate_on_sighup(
    pki, issuer, upstream, tmp_path
):
    directory = tmp_path / "run"
    directory.mkdir()
    process = GatewayProcess(gateway_yaml(issuer.url, upstream.url, extra=pki.tls()), directory)
    try:
        await process.wait_ready()
        assert process.url.startswith("https://")
        context = client_context(pki.ca)
        assert await peer_name(process.url, context) == "gateway-one"
        pki.rotate("gateway-two")
        process.signal(signal.SIGHUP)
        names = [await peer_name(process.url, context)]
        for _ in range(50):
            if names[-1] == "gateway-two":
                break
            await asyncio.sleep(0.1)
            names.append(await peer_name(process.url, context))
        assert names[-1] == "gateway-two", process.log()
        assert "TLS certificate reloaded" in process.log()
    finally:
        await process.stop()


# ---------------------------------------------------------------------------- client certificates


async def test_client_auth_require_refuses_a_client_without_a_certificate_or_from_another_ca(
    pki, issuer, upstream, tmp_path
):
    extra = pki.tls(client_ca_file=f'"{pki.ca_file}"', client_auth="require")
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, extra=extra)) as gw:
        stranger = CertificateAuthority("Stranger CA").client("batch")
        for context in (
            client_context(pki.ca),
            client_context(pki.ca, stranger, tmp_path),
        ):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as s:
                with pytest.raises(aiohttp.ClientError):
                    async with s.get(gw.url + "/public/x") as resp:
                        await resp.read()
        assert upstream.requests == []

        trusted = client_context(pki.ca, pki.ca.client("batch"), tmp_path)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trusted)) as s:
            answer = await call(s, gw.url + "/public/x")
        assert answer.status == 200


async def test_a_verified_client_certificate_reaches_the_upstream_in_identity_headers(
    pki, issuer, upstream, tmp_path
):
    extra = pki.tls(client_ca_file=f'"{pki.ca_file}"', client_auth="require") + (
        "identity_headers: {client_cert_subject: X-Client-Cert-Subject, "
        "client_cert_san: X-Client-Cert-San}\n"
    )
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, extra=extra)) as gw:
        batch = pki.ca.client(
            "batch", "Example", dns=["batch.example"], uris=["spiffe://example/batch"]
        )
        context = client_context(pki.ca, batch, tmp_path)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as s:
            forged = {"X-Client-Cert-Subject": "CN=admin", "X_Client_Cert_San": "DNS:admin"}
            async with s.get(gw.url + "/public/x", headers=forged) as resp:
                assert resp.status == 200
                seen = await resp.json()
    assert header_values(seen, "X-Client-Cert-Subject") == ["O=Example,CN=batch"]
    assert header_values(seen, "X-Client-Cert-San") == [
        "DNS:batch.example, URI:spiffe://example/batch"
    ]
    assert header_values(seen, "X_Client_Cert_San") == []


async def test_a_route_requiring_a_client_certificate_refuses_a_request_without_one(
    pki, issuer, upstream, tmp_path
):
    extra = pki.tls(client_ca_file=f'"{pki.ca_file}"', client_auth="request")
    routes = "  - {name: machines, path: /machines/**, auth: none, client_cert: required}\n"
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, routes, extra)) as gw:
        anonymous = client_context(pki.ca)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=anonymous)) as s:
            refused = await call(s, gw.url + "/machines/run")
            other_route = await call(s, gw.url + "/public/x")
        assert refused.status == 403
        assert refused.body["error"]["code"] == "client_certificate_required"
        assert "WWW-Authenticate" not in refused.headers
        assert other_route.status == 200  # `request`: a client without one is still served
        assert [r["raw_path"] for r in upstream.requests] == ["/public/x"]

        identified = client_context(pki.ca, pki.ca.client("batch"), tmp_path)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=identified)) as s:
            allowed = await call(s, gw.url + "/machines/run")
        assert allowed.status == 200


# ---------------------------------------------------------------------------- upstream


async def https_upstream(
    tmp_path: Path, ca: CertificateAuthority, hosts: tuple[str, ...] = ("127.0.0.1",)
) -> tuple[EchoUpstream, ssl.SSLContext]:
    context = server_context(ca.server("orders", hosts), tmp_path, "upstream")
    return await EchoUpstream().start(context), context


def upstream_config(issuer: TestIssuer, url: str, **options: str) -> str:
    config = gateway_yaml(issuer.url, url)
    extra = "".join(f", {k}: {v}" for k, v in options.items())
    return config.replace(f'upstream: {{url: "{url}"', f'upstream: {{url: "{url}"{extra}', 1)


async def test_an_https_upstream_with_a_private_ca_is_reached_with_ca_file_only(
    issuer, client, tmp_path
):
    ca = CertificateAuthority("Upstream CA")
    upstream, _ = await https_upstream(tmp_path, ca)
    try:
        async with running_gateway(upstream_config(issuer, upstream.url)) as gw:
            assert (await call(client, gw.url + "/public/x")).status == 502
        ca_file = ca.write(tmp_path, "upstream-ca")
        async with running_gateway(
            upstream_config(issuer, upstream.url, ca_file=f'"{ca_file}"')
        ) as gw:
            answer = await call(client, gw.url + "/public/x")
        assert answer.status == 200, answer.body
        assert [r["raw_path"] for r in upstream.requests] == ["/public/x"]
    finally:
        await upstream.stop()


async def test_server_name_checks_the_upstream_certificate_against_another_name(
    issuer, client, tmp_path
):
    ca = CertificateAuthority("Upstream CA")
    ca_file = ca.write(tmp_path, "upstream-ca")
    upstream, _ = await https_upstream(tmp_path, ca, hosts=("orders.internal",))
    try:
        plain = upstream_config(issuer, upstream.url, ca_file=f'"{ca_file}"')
        async with running_gateway(plain) as gw:
            assert (await call(client, gw.url + "/public/x")).status == 502
        named = upstream_config(
            issuer, upstream.url, ca_file=f'"{ca_file}"', server_name="orders.internal"
        )
        async with running_gateway(named) as gw:
            assert (await call(client, gw.url + "/public/x")).status == 200
    finally:
        await upstream.stop()


async def test_the_gateway_presents_its_client_certificate_to_an_upstream_requiring_one(
    issuer, client, tmp_path
):
    ca = CertificateAuthority("Mesh CA")
    ca_file = ca.write(tmp_path, "mesh-ca")
    upstream, context = await https_upstream(tmp_path, ca)
    context.load_verify_locations(cafile=ca_file)
    context.verify_mode = ssl.CERT_REQUIRED
    cert_file, key_file = ca.client("gateway", "Example").write(tmp_path, "gateway-client")
    try:
        async with running_gateway(
            upstream_config(issuer, upstream.url, ca_file=f'"{ca_file}"')
        ) as gw:
            assert (await call(client, gw.url + "/public/x")).status == 502
        mutual = upstream_config(
            issuer,
            upstream.url,
            ca_file=f'"{ca_file}"',
            cert_file=f'"{cert_file}"',
            key_file=f'"{key_file}"',
        )
        async with running_gateway(mutual) as gw:
            answer = await call(client, gw.url + "/public/x")
        assert answer.status == 200, answer.body
        assert (("commonName", "gateway"),) in upstream.requests[-1]["client_cert_subject"]
    finally:
        await upstream.stop()


# ---------------------------------------------------------------------------- issuers


@pytest.fixture
async def https_issuer(tmp_path: Path) -> AsyncIterator[tuple[TestIssuer, Path]]:
    """An issuer on https://127.0.0.1 whose certificate a private CA signed, and that CA."""
    ca = CertificateAuthority("Issuer CA")
    server = TestIssuer()
    server.add_key("ES256")
    await server.start(ssl_context=server_context(ca.server("issuer"), tmp_path, "issuer"))
    yield server, ca.write(tmp_path, "issuer-ca")
    await server.stop()


async def test_keys_of_an_https_issuer_with_a_private_ca_are_fetched_with_its_ca_file(
    https_issuer, upstream, client
):
    issuer, ca_file = https_issuer
    assert issuer.url.startswith("https://127.0.0.1:")
    entry = issuer_entry(issuer.url, ca_file=f'"{ca_file}"')
    async with running_gateway(gateway_yaml(issuer.url, upstream.url, issuers=[entry])) as gw:
        answer = await call(client, gw.url + "/orders/1", issuer.token())
    assert answer.status == 200, answer.body
    assert issuer.requests[:2] == ["GET /.well-known/openid-configuration", "GET /jwks"]


async def test_an_https_issuer_with_a_private_ca_is_not_trusted_without_its_ca_file(
    https_issuer, upstream, client
):
    issuer, _ = https_issuer
    config = gateway_yaml(issuer.url, upstream.url)
    async with running_gateway(config, wait_ready=False) as gw:
        keyset = gw.gateway.keysets[issuer.url]
        await wait_for(lambda: keyset.failures >= 1, what="a failed key fetch")
        assert "SSL" in (keyset.last_error or "") or "Certificate" in (keyset.last_error or "")
        assert_unavailable(await call(client, gw.url + "/orders/1", issuer.token()))
    assert issuer.requests == []  # no handshake succeeded, so no request was ever made


async def test_introspection_at_an_https_issuer_with_a_private_ca_uses_its_ca_file(
    upstream, client, tmp_path
):
    ca = CertificateAuthority("Issuer CA")
    server = await IntrospectionServer().start(
        ssl_context=server_context(ca.server("issuer"), tmp_path, "introspection")
    )
    try:
        server.active("opaque-token", iss=server.url)
        entry = issuer_entry(
            server.url,
            mode="introspection",
            ca_file=f'"{ca.write(tmp_path, "issuer-ca")}"',
            introspection='{client_id: gateway, client_secret: "gateway-secret"}',
        )
        config = gateway_yaml(server.url, upstream.url, issuers=[entry])
        async with running_gateway(config) as gw:
            answer = await call(client, gw.url + "/orders/1", "opaque-token")
        assert answer.status == 200, answer.body
        assert len(server.calls) == 1
    finally:
        await server.stop()


# ---------------------------------------------------------------------------- settings


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        gateway_settings.load_text(text, "gw.yaml", {})
    return [str(p) for p in caught.value.problems]


def line_of(text: str, marker: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if marker in line)


def test_tls_files_that_do_not_load_are_reported_on_their_line(pki, tmp_path):
    missing = gateway_yaml(
        "https://auth.example.com",
        "http://127.0.0.1:9",
        extra=f'tls:\n  cert_file: "{tmp_path / "absent.crt"}"\n  key_file: "{pki.key_file}"\n',
    )
    assert problems(missing) == [
        f"gw.yaml:{line_of(missing, 'cert_file')}: tls.cert_file: cannot read "
        f"{tmp_path / 'absent.crt'}: No such file or directory"
    ]
    other_key = pki.ca.server("other").write(tmp_path, "other")[1]
    mismatched = gateway_yaml(
        "https://auth.example.com",
        "http://127.0.0.1:9",
        extra=f'tls:\n  cert_file: "{pki.cert_file}"\n  key_file: "{other_key}"\n',
    )
    assert problems(mismatched) == [
        f"gw.yaml:{line_of(mismatched, 'cert_file')}: tls: cert_file and key_file cannot be "
        "loaded: the private key does not belong to the certificate"
    ]
    replace_file(other_key, b"not a key")
    assert problems(mismatched) == [
        f"gw.yaml:{line_of(mismatched, 'cert_file')}: tls: cert_file and key_file cannot be "
        "loaded: not a PEM certificate chain and private key"
    ]


def test_tls_options_that_cannot_work_are_refused(pki, tmp_path):
    text = gateway_yaml(
        "https://auth.example.com",
        "http://127.0.0.1:9",
        "  - {name: machines, path: /machines/**, client_cert: required}\n",
        extra=(
            f'tls: {{cert_file: "{pki.cert_file}", key_file: "{pki.key_file}", '
            "min_version: 1.1, client_auth: require}\n"
            f"identity_headers: {{client_cert_subject: X-Client-Cert}}\n"
        ),
    ).replace(
        'upstream: {url: "http://127.0.0.1:9"',
        f'upstream: {{url: "http://127.0.0.1:9", ca_file: "{pki.ca_file}"',
    )
    found = problems(text)
    assert [p.split(": ", 1)[1] for p in found] == [
        "upstream.ca_file: only with an https:// url",
        "route 'machines': client_cert: required needs tls.client_ca_file (the gateway's "
        "listener verifies client certificates)",
        "tls.min_version: 1.1 is not a TLS version this server offers (1.2 or 1.3)",
        "tls.client_auth: needs client_ca_file (the CA that client certificates must chain to)",
        "identity_headers: client_cert_* needs tls.client_ca_file (the gateway's listener "
        "verifies client certificates)",
    ]


def test_an_upstream_client_certificate_needs_its_key_and_an_unreadable_ca_is_reported(
    pki, tmp_path
):
    text = gateway_yaml("https://auth.example.com", "https://orders.internal").replace(
        'upstream: {url: "https://orders.internal"',
        f'upstream: {{url: "https://orders.internal", cert_file: "{pki.cert_file}", '
        f'ca_file: "{tmp_path / "none.crt"}"',
    )
    found = problems(text)
    assert [p.split(": ", 1)[1] for p in found] == [
        "upstream: a client certificate needs both cert_file and key_file (key_file is missing)"
    ]
    text = text.replace(f'cert_file: "{pki.cert_file}", ', "")
    assert [p.split(": ", 1)[1] for p in problems(text)] == [
        f"upstream.ca_file: cannot read {tmp_path / 'none.crt'}: No such file or directory"
    ]


def test_tls_settings_are_read_with_their_defaults(pki):
    text = gateway_yaml(
        "https://auth.example.com",
        "http://127.0.0.1:9",
        extra=pki.tls(client_ca_file=f'"{pki.ca_file}"'),
    )
    settings = gateway_settings.load_text(text, "gw.yaml", {})
    assert settings.tls is not None
    assert (settings.tls.min_version, settings.tls.client_auth) == ("1.2", "request")
    assert settings.tls.client_ca_file == str(pki.ca_file)
