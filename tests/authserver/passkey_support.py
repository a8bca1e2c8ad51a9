"""A software authenticator for the passkey tests: it makes what a browser posts after
`navigator.credentials.create()` and `.get()` (WebAuthn §5.1.8's JSON forms), built here
from the specification with `cryptography` (a P-256 key, ES256) and fido2's CBOR encoder,
so that the server's checks meet bytes it did not make. Each field can be spoiled on
purpose: the origin, the RP ID, the challenge, the flags, the counter, the signature.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from fido2 import cbor
from fido2.cose import ES256

UP, UV, BE, BS, AT = 0x01, 0x04, 0x08, 0x10, 0x40  # WebAuthn §6.1 flags


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass
class SoftAuthenticator:
    """One credential on one software authenticator."""

    origin: str
    backup_eligible: bool = False
    key: ec.EllipticCurvePrivateKey = field(
        default_factory=lambda: ec.generate_private_key(ec.SECP256R1())
    )
    credential_id: bytes = field(default_factory=lambda: os.urandom(16))
    counter: int = 0
    user_handle: bytes | None = None
    rp_id: str | None = None
    # The BS flag alone, whatever BE says (None: set with BE, as an honest authenticator).
    backed_up: bool | None = None

    def _flags(self, verified: bool, attested: bool = False) -> int:
        flags = UP | (UV if verified else 0)
        if self.backup_eligible:
            flags |= BE
        if self.backup_eligible if self.backed_up is None else self.backed_up:
            flags |= BS
        return flags | (AT if attested else 0)

    def create(
        self,
        options: dict[str, Any],
        *,
        origin: str | None = None,
        verified: bool = True,
        attested: bool = True,
        public_key: dict[int, Any] | None = None,
    ) -> dict[str, Any]:
        """RegistrationResponseJSON for `options` (PublicKeyCredentialCreationOptionsJSON).
        `attested` False leaves the attested credential data (and its AT flag) out;
        `public_key` replaces the credential's COSE_Key."""
        self.rp_id = options["rp"]["id"]
        self.user_handle = unb64(options["user"]["id"])
        client_data = json.dumps(
            {
                "type": "webauthn.create",
                "challenge": options["challenge"],
                "origin": origin or self.origin,
                "crossOrigin": False,
            }
        ).encode()
        public = cbor.encode(public_key or dict(ES256.from_cryptography_key(self.key.public_key())))
        auth_data = (
            hashlib.sha256(self.rp_id.encode()).digest()
            + bytes([self._flags(verified, attested=attested)])
            + struct.pack(">I", self.counter)
        )
        if attested:
            auth_data += (
                bytes(16)  # AAGUID: none
                + struct.pack(">H", len(self.credential_id))
                + self.credential_id
                + public
            )
        attestation = cbor.encode({"fmt": "none", "attStmt": {}, "authData": auth_data})
        return {
            "id": b64(self.credential_id),
            "rawId": b64(self.credential_id),
            "type": "public-key",
            "response": {
                "clientDataJSON": b64(client_data),
                "attestationObject": b64(attestation),
                "transports": ["internal", "bogus"],
            },
            "clientExtensionResults": {},
        }

    def get(
        self,
        options: dict[str, Any],
        *,
        origin: str | None = None,
        rp_id: str | None = None,
        challenge: str | None = None,
        verified: bool = True,
        counter: int | None = None,
        user_handle: bool = True,
        bad_signature: bool = False,
    ) -> dict[str, Any]:
        """AuthenticationResponseJSON for `options` (PublicKeyCredentialRequestOptionsJSON)."""
        self.counter = self.counter + 1 if counter is None else counter
        client_data = json.dumps(
            {
                "type": "webauthn.get",
                "challenge": challenge or options["challenge"],
                "origin": origin or self.origin,
                "crossOrigin": False,
            }
        ).encode()
        auth_data = (
            hashlib.sha256((rp_id or options["rpId"]).encode()).digest()
            + bytes([self._flags(verified)])
            + struct.pack(">I", self.counter)
        )
        signed = auth_data + hashlib.sha256(client_data).digest()
        signature = self.key.sign(signed, ec.ECDSA(hashes.SHA256()))
        if bad_signature:
            signature = self.key.sign(signed + b"x", ec.ECDSA(hashes.SHA256()))
        response: dict[str, Any] = {
            "clientDataJSON": b64(client_data),
            "authenticatorData": b64(auth_data),
            "signature": b64(signature),
        }
        if user_handle and self.user_handle is not None:
            response["userHandle"] = b64(self.user_handle)
        return {
            "id": b64(self.credential_id),
            "rawId": b64(self.credential_id),
            "type": "public-key",
            "response": response,
            "clientExtensionResults": {},
        }


@dataclass
class PasskeyForm:
    action: str
    mode: str
    options: dict[str, Any]
    fields: dict[str, str]


class _PasskeyFormParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.forms: list[PasskeyForm] = []
        self._inside = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "form":
            self._inside = "data-passkey" in a
            if self._inside:
                options = json.loads(a["data-options"])
                self.forms.append(PasskeyForm(a["action"], a["data-passkey"], options, {}))
        elif tag == "input" and self._inside and a.get("type") == "hidden":
            self.forms[-1].fields[a.get("name", "")] = a.get("value", "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._inside = False


def passkey_form(html: str) -> PasskeyForm | None:
    """The page's passkey form (templates/_passkey_form.html), if it has one."""
    parser = _PasskeyFormParser()
    parser.feed(html)
    return parser.forms[0] if parser.forms else None
