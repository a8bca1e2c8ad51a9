"""portcullis.tls: the `tls` section of a listener, checked as `run` would load it."""

from __future__ import annotations

import asyncio
import contextlib
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from authserver import settings as authserver_settings
from portcullis import sections
from portcullis.sections import section, setting
from portcullis.tls import RotatingCertificate, ServerTls, VerifyingServerTls
from portcullis.yamlconf import ConfigError
from tests.certificates import CertificateAuthority
from tests.support import wait_for


@section
class Verifying:
    tls: VerifyingServerTls = setting("A listener that may verify client certificates.")


@section
class Plain:
    tls: ServerTls = setting("A listener that verifies no client certificates.")


def parse(text: str, *, client_auth: bool = True, secrets: bool = True) -> tuple[Any, list[str]]:
    """The `tls` section of a file holding only it, or its problems."""
    holder = Verifying if client_auth else Plain
    try:
        return sections.load_text(holder, text, "conf.yaml", {}, secrets=secrets).tls, []
    except ConfigError as exc:
        return None, [str(p) for p in exc.problems]


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    return CertificateAuthority().server().write(tmp_path, "server")


@pytest.mark.parametrize(
    ("written", "expected"), [("1.2", "1.2"), ("1.3", "1.3"), ('"TLSv1.3"', "1.3")]
)
def test_min_version_is_1_2_or_1_3_however_it_is_written(pair, written, expected):
    cert, key = pair
    result, found = parse(
        f'tls: {{cert_file: "{cert}", key_file: "{key}", min_version: {written}}}'
    )
    assert found == []
    assert result == VerifyingServerTls(str(cert), str(key), expected)
    assert (result.client_ca_file, result.client_auth) == (None, "request")


@pytest.mark.parametrize("written", ["1.1", "1.0", '"SSLv3"', "true", "2"])
def test_a_min_version_below_1_2_or_unknown_is_refused(pair, written):
    cert, key = pair
    _, found = parse(f'tls: {{cert_file: "{cert}", key_file: "{key}", min_version: {written}}}')
    assert len(found) == 1
    assert "is not a TLS version this server offers (1.2 or 1.3)" in found[0]


def test_an_encrypted_private_key_is_reported_instead_of_prompting_for_a_passphrase(tmp_path):
    issued = CertificateAuthority().server()
    cert, _ = issued.write(tmp_path, "server")
    key = tmp_path / "encrypted.key"
    key.write_bytes(
        issued.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    _, found = parse(f'tls:\n  cert_file: "{cert}"\n  key_file: "{key}"\n')
    assert found == [
        "conf.yaml:2: tls: cert_file and key_file cannot be loaded: the private key is "
        "encrypted; give it unencrypted (protect the file)"
    ]


def test_a_ca_file_without_a_certificate_is_reported_on_its_line(pair):
    cert, key = pair
    text = f'tls:\n  cert_file: "{cert}"\n  key_file: "{key}"\n  client_ca_file: "{key}"\n'
    _, found = parse(text)
    assert found == [
        "conf.yaml:4: tls.client_ca_file: cannot be loaded: no PEM certificate in the file"
    ]


def test_without_secrets_the_files_are_not_read(tmp_path):
    text = f'tls: {{cert_file: "{tmp_path}/a.crt", key_file: "{tmp_path}/a.key"}}'
    result, found = parse(text, secrets=False)
    assert found == []
    assert result.cert_file == f"{tmp_path}/a.crt"


def test_a_listener_that_verifies_no_clients_knows_no_client_keys(pair):
    cert, key = pair
    _, found = parse(
        f'tls: {{cert_file: "{cert}", key_file: "{key}", client_auth: require}}',
        client_auth=False,
    )
    assert len(found) == 1 and "unknown key 'client_auth'" in found[0]


def test_an_authserver_serving_tls_must_have_an_https_issuer(pair):
    cert, key = pair
    text = (
        'issuer: "http://127.0.0.1:9000"\n'
        'storage: "sqlite://:memory:"\n'
        "keys: {dir: keys}\n"
        f'tls: {{cert_file: "{cert}", key_file: "{key}"}}\n'
    )
    with pytest.raises(ConfigError) as caught:
        authserver_settings.load_text(text, "auth.yaml", {})
    assert [str(p) for p in caught.value.problems] == [
        "auth.yaml:1: config.issuer: must be https:// when the server itself serves TLS (tls:)"
    ]
    https = authserver_settings.load_text(text.replace("http://", "https://"), "auth.yaml", {})
    assert https.tls == ServerTls(str(cert), str(key))


async def test_a_kubernetes_style_symlink_swap_is_seen_and_loaded(tmp_path):
    """A secret volume holds `tls.crt -> ..data/tls.crt` and swaps `..data` in one rename."""
    ca = CertificateAuthority()
    first, second = tmp_path / "..2024_first", tmp_path / "..2024_second"
    first.mkdir()
    second.mkdir()
    ca.server("first").write(first, "tls")
    ca.server("second").write(second, "tls")
    (tmp_path / "..data").symlink_to(first.name)
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).symlink_to(Path("..data") / name)
    certificate = RotatingCertificate(
        ServerTls(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")),
        interval=timedelta(milliseconds=20),
    )
    watcher = asyncio.create_task(certificate.watch())
    try:
        await asyncio.sleep(0.1)
        assert certificate.reloads == 0  # nothing changed yet
        swap = tmp_path / "..data_tmp"
        swap.symlink_to(second.name)
        os.replace(swap, tmp_path / "..data")
        await wait_for(lambda: certificate.reloads == 1, what="the swap to be loaded")
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    assert certificate.failures == 0
