"""TLS for both services: listeners that pick up rotated certificates, and client contexts
that trust a private certificate authority.

Owns: the `tls` section of a listener (`cert_file`, `key_file`, `min_version`, and where a
service verifies its clients `client_ca_file` and `client_auth`), checking at load that the
files named there load (so `check` finds what `run` would die on), building SSLContexts, and
`RotatingCertificate`.

Rotation: cert-manager and Kubernetes secret volumes replace certificate files in place. A
listener keeps one SSLContext for its socket; every handshake is moved onto the context
built from the files as they were last seen whole (the server-name callback runs for every
ClientHello, with or without SNI). A changed pair is loaded into a new context first, so a
broken or half-written pair never replaces a working one, and connections established
before the change keep the certificate they were made with.

Knows nothing about OAuth, the gateway or the authserver.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from .yamlconf import Reader, Section, non_empty_string, one_of

log = logging.getLogger("portcullis.tls")

CHECK_EVERY = timedelta(seconds=1)
VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
ALPN = ["http/1.1"]  # HTTP/2 is not served: offering it would break clients that pick it


@dataclass(frozen=True)
class ServerTls:
    """A listener's TLS: its certificate chain and key, and how clients are verified."""

    cert_file: str
    key_file: str
    min_version: str = "1.2"  # "1.2" | "1.3"; TLS 1.3 is chosen whenever the client has it
    client_ca_file: str | None = None
    client_auth: str = "none"  # none | request (verified when sent) | require


# ---------------------------------------------------------------------------- contexts


def server_context(settings: ServerTls) -> ssl.SSLContext:
    """A server context from the files as they are now; raises OSError, ssl.SSLError or
    ValueError (an encrypted key)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = VERSIONS[settings.min_version]
    context.set_alpn_protocols(ALPN)
    context.load_cert_chain(settings.cert_file, settings.key_file, password=_no_passphrase)
    if settings.client_ca_file is not None:
        context.load_verify_locations(cafile=settings.client_ca_file)
        # With `request`, a client without a certificate is served (rules decide what it
        # may do); a certificate that does not verify fails the handshake either way.
        context.verify_mode = (
            ssl.CERT_REQUIRED if settings.client_auth == "require" else ssl.CERT_OPTIONAL
        )
    return context


def client_context(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """A client context verifying servers against `ca_file` only (the system's CAs when
    None), presenting `cert_file` for mutual TLS when given."""
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None and key_file is not None:
        context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
    return context


def _no_passphrase() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal, and a server would hang.
    raise ValueError("the private key is encrypted; give it unencrypted (protect the file)")


def _reason(exc: Exception) -> str:
    """What went wrong loading certificate files, in words for an operator."""
    if not isinstance(exc, ssl.SSLError):
        return str(exc)
    known = {
        "KEY_VALUES_MISMATCH": "the private key does not belong to the certificate",
        "NO_CERTIFICATE_OR_CRL_FOUND": "no PEM certificate in the file",
    }
    if exc.reason in known:
        return known[exc.reason]
    if "PEM lib" in str(exc):
        return "not a PEM certificate chain and private key"
    return (exc.reason or str(exc)).lower().replace("_", " ")


def check_files(
    reader: Reader, sec: Section, files: Mapping[str, str], build: Callable[[], object]
) -> None:
    """Report, on its line, each of `files` (key: path) that cannot be read; when all can,
    report on the first one's line what keeps `build` (a context made from them) from
    loading them."""
    unreadable = False
    for key, path in files.items():
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            reader.problem(
                sec.line_of(key), f"{sec.where}.{key}: cannot read {path}: {exc.strerror}"
            )
            unreadable = True
    if unreadable:
        return
    try:
        build()
    except (OSError, ssl.SSLError, ValueError) as exc:
        first = next(iter(files))
        # One file: `tls.client_ca_file: …`; a pair: `tls: cert_file and key_file …`.
        what = f"{sec.where}.{first}:" if len(files) == 1 else f"{sec.where}: {' and '.join(files)}"
        reader.problem(sec.line_of(first), f"{what} cannot be loaded: {_reason(exc)}")


# ---------------------------------------------------------------------------- settings


def parse_server(
    reader: Reader, raw: Any, where: str, line: int, *, client_auth: bool
) -> ServerTls | None:
    """A listener's `tls` mapping; `client_auth` allows client_ca_file and client_auth.

    With `reader.secrets`, the pair (and the client CA) are loaded as `run` would load them,
    and a failure is reported on the line of the file that failed.
    """
    sec = reader.section(raw, where, line)
    if sec is None:
        return None
    cert_file = sec.get("cert_file", non_empty_string)
    key_file = sec.get("key_file", non_empty_string)
    min_version = sec.get("min_version", _version, ServerTls.min_version)
    ca_file: str | None = None
    auth = "none"
    if client_auth:
        ca_file = sec.get("client_ca_file", non_empty_string, None)
        auth = sec.get("client_auth", one_of("request", "require"), "request")
        if ca_file is None:
            auth = "none"
            if sec.has("client_auth"):
                reader.problem(
                    sec.line_of("client_auth"),
                    f"{where}.client_auth: needs client_ca_file (the CA that client "
                    "certificates must chain to)",
                )
    sec.finish()
    if cert_file is None or key_file is None:
        return None
    result = ServerTls(cert_file, key_file, min_version, ca_file, auth)
    if reader.secrets:
        check_files(
            reader,
            sec,
            {"cert_file": cert_file, "key_file": key_file},
            lambda: server_context(replace(result, client_ca_file=None)),
        )
        if ca_file is not None:
            check_ca(reader, sec, "client_ca_file", ca_file)
    return result


def check_ca(reader: Reader, sec: Section, key: str, ca_file: str) -> None:
    """Report a CA file that `run` could not load, on the line of `key`."""
    check_files(reader, sec, {key: ca_file}, lambda: client_context(ca_file))


def check_client_pair(reader: Reader, sec: Section, cert_file: str, key_file: str) -> None:
    """Report a client certificate and key that `run` could not load."""
    check_files(
        reader,
        sec,
        {"cert_file": cert_file, "key_file": key_file},
        lambda: client_context(None, cert_file, key_file),
    )


def _version(value: Any) -> str:
    # `min_version: 1.2` unquoted is a YAML float; it means the same as "1.2".
    text = str(value).removeprefix("TLSv")
    if isinstance(value, bool) or text not in VERSIONS:
        raise ValueError(f"{value!r} is not a TLS version this server offers (1.2 or 1.3)")
    return text


# ---------------------------------------------------------------------------- rotation


FileState = tuple[tuple[int, int, int, str] | None, ...]


def file_state(*paths: str | None) -> FileState:
    """What identifies the files' current contents (inode, size, mtime, digest); None for a
    file that cannot be read. Following symbolic links, as Kubernetes' `..data` swap needs."""
    state: list[tuple[int, int, int, str] | None] = []
    for path in paths:
        if path is None:
            continue
        try:
            stat = os.stat(path)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            state.append(None)
            continue
        state.append((stat.st_ino, stat.st_size, stat.st_mtime_ns, digest))
    return tuple(state)


class RotatingCertificate:
    """The TLS context of one listener, following its certificate files as they change.

    `context` is given to the listening socket. `watch()` polls the files every `interval`
    and `reload()` (also for SIGHUP) loads them now. Counters: `reloads`, `failures`.
    """

    def __init__(self, settings: ServerTls, *, interval: timedelta = CHECK_EVERY) -> None:
        self.settings = settings
        self.interval = interval
        self._state = self._files()
        self._current = server_context(settings)
        self.context = server_context(settings)
        self.context.sni_callback = self._select
        self.reloads = 0
        self.failures = 0

    def _files(self) -> FileState:
        s = self.settings
        return file_state(s.cert_file, s.key_file, s.client_ca_file)

    def _select(
        self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext
    ) -> None:
        """Every handshake gets the pair loaded last (SSL_set_SSL_CTX; the connection's own
        settings stay those of the listening context, which are the same)."""
        connection.context = self._current

    def reload(self) -> bool:
        """Load the files now; on failure log why and keep serving the previous pair."""
        self._state = self._files()  # before loading: a change while loading is seen next time
        try:
            fresh = server_context(self.settings)
        except (OSError, ssl.SSLError, ValueError) as exc:
            self.failures += 1
            log.error(
                "TLS certificate not reloaded; the previous one stays in use",
                extra={"cert_file": self.settings.cert_file, "reason": _reason(exc)},
            )
            return False
        self._current = fresh
        self.reloads += 1
        log.info("TLS certificate reloaded", extra={"cert_file": self.settings.cert_file})
        return True

    async def watch(self) -> None:
        """Reload whenever the certificate, key or client CA file changes."""
        while True:
            await asyncio.sleep(self.interval.total_seconds())
            if self._files() != self._state:
                self.reload()
