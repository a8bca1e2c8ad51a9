"""TLS for both services: listeners that pick up rotated certificates, and client contexts
that trust a private certificate authority.

Owns: the `tls` section of a listener (`cert_file`, `key_file`, `min_version`, and where a
service verifies its clients `client_ca_file` and `client_auth`), declared for
portcullis.sections, checking at load that the files named there load (so `check` finds
what `run` would die on), building SSLContexts, and `RotatingCertificate`.

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
from datetime import timedelta
from typing import Any, Literal

from .sections import Check, section, setting

log = logging.getLogger("portcullis.tls")

CHECK_EVERY = timedelta(seconds=1)
VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
ALPN = ["http/1.1"]  # HTTP/2 is not served: offering it would break clients that pick it


def _version(value: Any) -> str:
    # `min_version: 1.2` unquoted is a YAML float; it means the same as "1.2".
    text = str(value).removeprefix("TLSv")
    if isinstance(value, bool) or text not in VERSIONS:
        raise ValueError(f"{value!r} is not a TLS version this server offers (1.2 or 1.3)")
    return text


_VERSION = {"title": "1.2 | 1.3", "enum": [1.2, 1.3, "1.2", "1.3", "TLSv1.2", "TLSv1.3"]}


@section
class ServerTls:
    """TLS of the listener: it serves HTTPS itself, picking up renewed certificate files."""

    cert_file: str = setting("PEM certificate chain, the server's certificate first.")
    key_file: str = setting("PEM private key of the certificate (unencrypted).")
    min_version: str = setting(
        "Oldest TLS version accepted; 1.3 is chosen whenever the client has it.",
        default="1.2",
        parser=_version,
        schema=_VERSION,
    )

    @property
    def client_ca_file(self) -> str | None:
        return None  # a listener that verifies no client certificates

    @property
    def client_auth(self) -> str:
        return "none"

    def validate(self, check: Check) -> None:
        """With secrets, the pair is loaded as `run` would load it, and a failure is
        reported on the line of the file that failed."""
        if check.secrets:
            pair = {"cert_file": self.cert_file, "key_file": self.key_file}
            plain = ServerTls(self.cert_file, self.key_file, self.min_version)
            check_files(check, pair, lambda: server_context(plain))


@section
class VerifyingServerTls(ServerTls):
    """TLS of the listener: it serves HTTPS itself, picking up renewed certificate files,
    and may verify client certificates."""

    client_ca_file: str | None = setting(
        "CA that client certificates must chain to; none are asked for without it.",
        default=None,
    )
    client_auth: Literal["request", "require"] = setting(
        "With client_ca_file: `request` serves clients without a certificate (routes "
        "decide), `require` refuses them in the handshake.",
        default="request",
    )

    def validate(self, check: Check) -> None:
        if self.client_ca_file is None and check.has("client_auth"):
            check.problem(
                "needs client_ca_file (the CA that client certificates must chain to)",
                key="client_auth",
            )
        super().validate(check)
        if check.secrets and self.client_ca_file is not None:
            check_ca(check, "client_ca_file", self.client_ca_file)


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


def check_files(check: Check, files: Mapping[str, str], build: Callable[[], object]) -> None:
    """Report, on its line, each of `files` (field: path) that cannot be read; when all can,
    report on the first one's line what keeps `build` (a context made from them) from
    loading them."""
    unreadable = False
    for key, path in files.items():
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            check.problem(f"cannot read {path}: {exc.strerror}", key=key)
            unreadable = True
    if unreadable:
        return
    try:
        build()
    except (OSError, ssl.SSLError, ValueError) as exc:
        first = next(iter(files))
        if len(files) == 1:  # `tls.client_ca_file: …`; a pair: `tls: cert_file and key_file …`
            check.problem(f"cannot be loaded: {_reason(exc)}", key=first)
        else:
            check.problem_at(
                check.line_of(first),
                f"{check.where}: {' and '.join(files)} cannot be loaded: {_reason(exc)}",
            )


def check_ca(check: Check, key: str, ca_file: str) -> None:
    """Report a CA file that `run` could not load, on the line of `key`."""
    check_files(check, {key: ca_file}, lambda: client_context(ca_file))


def check_client_pair(check: Check, cert_file: str, key_file: str) -> None:
    """Report a client certificate and key that `run` could not load."""
    check_files(
        check,
        {"cert_file": cert_file, "key_file": key_file},
        lambda: client_context(None, cert_file, key_file),
    )


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
            # Reading and hashing the files, and loading a changed pair, happen off the event
            # loop; the new context is swapped in with one assignment, which handshakes read.
            if await asyncio.to_thread(self._files) != self._state:
                await asyncio.to_thread(self.reload)
