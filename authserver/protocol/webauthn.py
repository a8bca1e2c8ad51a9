"""The rules of passkeys (WebAuthn Level 3) that need no cryptography: the relying party
this server is, the methods (RFC 8176) a passkey sign-in proves, the signature counter's
rule, and reading what a browser posts.

- Relying party: its id is the issuer's host (WebAuthn §5.1.2: a registrable domain
  suffix of the origin's effective domain, here the domain itself), and the one origin a
  ceremony may come from is the issuer's (§7.1 step 9, §7.2 step 13). An IP address is no
  valid RP ID (§5.1.2 asks for a domain), and a browser offers WebAuthn only in a secure
  context: an https issuer, or http on `localhost`.
- Methods: a passkey is a key the user possesses, `hwk` when it cannot leave its device
  and `swk` when it may be synced to others (RFC 8176 §2; WebAuthn §6.1.3: the BE flag
  says whether the credential is backup eligible, i.e. multi-device). The user presence
  test of every ceremony is `user` (RFC 8176 §2, WebAuthn §6.1 flag UP). With user
  verification (flag UV: a PIN or a biometric the authenticator checked, §6.2.3) the
  passkey alone is two factors, `mfa`; without it a second factor only after a password.
- Counter: a signature counter (§6.1.1) must grow from one assertion to the next unless
  both the stored and the new value are 0 (an authenticator that keeps none); anything
  else is a sign of a cloned authenticator (§7.2 step 22), and the sign-in is refused.

Pure: standard library only.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from urllib.parse import urlsplit

PRESENCE = "user"  # RFC 8176 §2: user presence test
DEVICE_BOUND = "hwk"  # RFC 8176 §2: proof of possession of a hardware-secured key
SYNCED = "swk"  # RFC 8176 §2: proof of possession of a software-secured key
MULTIPLE = "mfa"
PASSWORD = "pwd"  # noqa: S105 - a method's name

# A credential id is at most 1023 bytes (WebAuthn §5.8.3 note, §6.5.1 credentialIdLength).
MAX_CREDENTIAL_ID = 1023
_BASE64URL = re.compile(r"^[A-Za-z0-9_-]*$")


def rp_id(issuer: str) -> str | None:
    """The RP ID of this server, or None when its issuer cannot be one: not a domain, or
    not in a secure context (WebAuthn §5.1.2; Secure Contexts §3.1)."""
    parts = urlsplit(issuer)
    host = parts.hostname
    if not host:
        return None
    try:
        ipaddress.ip_address(host)
        return None  # an IP address is no domain
    except ValueError:
        pass
    if parts.scheme == "https":
        return host
    if parts.scheme == "http" and (host == "localhost" or host.endswith(".localhost")):
        return host
    return None


def origin(issuer: str) -> str:
    """The issuer's origin (RFC 6454 §6.2 serialisation), as a browser puts it in
    `clientDataJSON.origin` (WebAuthn §5.8.1)."""
    parts = urlsplit(issuer)
    host = parts.hostname or ""
    default = {"https": 443, "http": 80}.get(parts.scheme)
    port = f":{parts.port}" if parts.port is not None and parts.port != default else ""
    return f"{parts.scheme}://{host}{port}"


def methods(
    *, backup_eligible: bool, user_verified: bool, first: tuple[str, ...] | None = None
) -> tuple[str, ...]:
    """The `amr` of a sign-in by a passkey: alone (passwordless, `first` None) or as the
    second step after a first one whose methods are `first` (a password here, or what an
    upstream provider named)."""
    key = SYNCED if backup_eligible else DEVICE_BOUND
    if first is not None:
        # The passkey is a factor of its own whatever the first step was.
        kept = [m for m in first if m not in (key, PRESENCE, MULTIPLE)]
        return (*dict.fromkeys(kept), key, PRESENCE, MULTIPLE)
    if user_verified:
        # Something the user has (the key) and something they know or are (the
        # authenticator's PIN or biometric, WebAuthn §6.2.3): two factors.
        return (key, PRESENCE, MULTIPLE)
    return (key, PRESENCE)


def counter_moves_on(stored: int, new: int) -> bool:
    """WebAuthn §6.1.1, §7.2 step 22: whether an assertion's counter may follow `stored`."""
    if stored == 0 and new == 0:
        return True
    return new > stored


def base64url(text: object, max_bytes: int = 1 << 16) -> bytes | None:
    """Unpadded base64url (RFC 4648 §5, as WebAuthn's JSON forms use it, §5.1.8), or None
    when `text` is not that, or longer than `max_bytes` decoded."""
    if not isinstance(text, str) or not _BASE64URL.match(text) or len(text) % 4 == 1:
        return None
    if len(text) > (max_bytes * 4 + 2) // 3:
        return None
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None


def encoded(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


TRANSPORTS = frozenset({"usb", "nfc", "ble", "smart-card", "hybrid", "internal"})  # §5.8.4


def known_transports(given: object) -> tuple[str, ...]:
    """The transports of `getTransports()` (WebAuthn §5.2.1) this server knows, in order;
    anything else is dropped (§5.8.4: relying parties ignore unknown values)."""
    if not isinstance(given, list):
        return ()
    return tuple(dict.fromkeys(t for t in given if isinstance(t, str) and t in TRANSPORTS))


def passkey_name(typed: str) -> str | None:
    """A name the user gave a passkey, trimmed: 1 to 64 printable characters."""
    name = " ".join(typed.split())
    if not name or len(name) > 64 or not name.isprintable():
        return None
    return name
