"""The key ring: signing keys per algorithm, their public JWK Set, and their lifecycle.

Keys live in `keys.dir`: one PEM file per private key (mode 0600) and `keyring.json` with
each key's algorithm and dates. On first start a key is generated for every algorithm the
server signs with. A key goes `next` (published, not yet signing) → `active` (signing) →
`retired` (published until every token it signed has expired) → removed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import jwt
import orjson
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

METADATA = "keyring.json"


@dataclass(frozen=True)
class KeyInfo:
    kid: str
    alg: str
    state: str  # next | active | retired
    created_at: float
    activate_at: float | None = None  # for `next`: when it starts signing
    retired_at: float | None = None
    remove_after: float | None = None  # for `retired`: when the last token it signed expires


def _generate(alg: str) -> Any:
    if alg == "ES256":
        return ec.generate_private_key(ec.SECP256R1())
    if alg == "RS256":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    if alg == "EdDSA":
        return ed25519.Ed25519PrivateKey.generate()
    raise ValueError(f"unsupported signing algorithm {alg}")


def public_jwk(private_key: Any, kid: str, alg: str) -> dict[str, Any]:
    public = private_key.public_key()
    if isinstance(public, rsa.RSAPublicKey):
        jwk = RSAAlgorithm.to_jwk(public, as_dict=True)
    elif isinstance(public, ec.EllipticCurvePublicKey):
        jwk = ECAlgorithm.to_jwk(public, as_dict=True)
    else:
        jwk = OKPAlgorithm.to_jwk(public, as_dict=True)
    return {**jwk, "kid": kid, "use": "sig", "alg": alg}


def _write_private(path: Path, key: Any) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


class KeyRing:
    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)
        self._infos: dict[str, KeyInfo] = {}
        self._private: dict[str, Any] = {}
        self._jwks_body = b""
        self.jwks_etag = ""

    # ------------------------------------------------------------------ persistence

    def load(self, algorithms: Iterable[str]) -> None:
        """Read the ring, generating an active key for any algorithm that has none."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.reload()
        now = time.time()
        changed = False
        for alg in dict.fromkeys(algorithms):
            if not any(i.alg == alg and i.state == "active" for i in self._infos.values()):
                self._add(alg, "active", now)
                changed = True
        if changed:
            self._save()
        self._publish()

    def reload(self) -> None:
        path = self.dir / METADATA
        infos: dict[str, KeyInfo] = {}
        if path.exists():
            for entry in json.loads(path.read_text()):
                info = KeyInfo(**entry)
                infos[info.kid] = info
        self._infos = infos
        # The keys are this server's own, written by `_add` into a directory only it can
        # read; the RSA consistency check (over 100 ms a key) would only slow every start.
        self._private = {
            kid: serialization.load_pem_private_key(
                (self.dir / f"{kid}.pem").read_bytes(), None, unsafe_skip_rsa_key_validation=True
            )
            for kid in infos
        }
        self._publish()

    def _add(self, alg: str, state: str, now: float, activate_at: float | None = None) -> KeyInfo:
        kid = f"{alg.lower()}-{time.strftime('%Y%m%d', time.gmtime(now))}-{secrets.token_hex(4)}"
        key = _generate(alg)
        _write_private(self.dir / f"{kid}.pem", key)
        info = KeyInfo(kid=kid, alg=alg, state=state, created_at=now, activate_at=activate_at)
        self._infos[kid] = info
        self._private[kid] = key
        return info

    def _save(self) -> None:
        tmp = self.dir / (METADATA + ".tmp")
        tmp.write_text(json.dumps([asdict(i) for i in self._infos.values()], indent=2))
        os.replace(tmp, self.dir / METADATA)

    # ------------------------------------------------------------------ lifecycle

    def retire(self, kid: str, now: float, last_token_expiry: float) -> None:
        """Stop signing with `kid`; keep it published until `last_token_expiry`."""
        info = self._infos[kid]
        self._infos[kid] = replace(
            info, state="retired", retired_at=now, remove_after=last_token_expiry
        )
        self._save()
        self._publish()

    def purge(self, now: float) -> list[str]:
        """Remove retired keys whose every token has expired."""
        gone = [
            i.kid
            for i in self._infos.values()
            if i.state == "retired" and i.remove_after is not None and i.remove_after <= now
        ]
        for kid in gone:
            del self._infos[kid]
            self._private.pop(kid, None)
            (self.dir / f"{kid}.pem").unlink(missing_ok=True)
        if gone:
            self._save()
            self._publish()
        return gone

    def infos(self) -> list[KeyInfo]:
        return sorted(self._infos.values(), key=lambda i: i.created_at)

    # ------------------------------------------------------------------ use

    def active(self, alg: str) -> KeyInfo:
        for info in self._infos.values():
            if info.alg == alg and info.state == "active":
                return info
        raise LookupError(f"no active {alg} key")

    def sign(self, alg: str, claims: Mapping[str, Any], typ: str = "JWT") -> str:
        info = self.active(alg)
        return jwt.encode(
            dict(claims),
            self._private[info.kid],
            algorithm=alg,
            headers={"kid": info.kid, "typ": typ},
        )

    def verify(self, token: str, algorithms: Iterable[str], **options: Any) -> dict[str, Any]:
        """Decode a token this server signed, with any published key (for introspection)."""
        header = jwt.get_unverified_header(token)
        kid = header.get("kid")
        if not isinstance(kid, str) or kid not in self._private:
            raise jwt.InvalidTokenError("unknown key")
        info = self._infos[kid]
        if header.get("alg") != info.alg or info.alg not in set(algorithms):
            raise jwt.InvalidTokenError("algorithm does not match the key")
        key = self._private[kid].public_key()
        return jwt.decode(token, key, algorithms=[info.alg], **options)

    def _publish(self) -> None:
        keys = [public_jwk(self._private[i.kid], i.kid, i.alg) for i in self.infos()]
        self._jwks_body = orjson.dumps({"keys": keys})
        digest = hashlib.sha256(self._jwks_body).digest()
        self.jwks_etag = '"' + base64.urlsafe_b64encode(digest[:12]).decode() + '"'

    @property
    def jwks_body(self) -> bytes:
        return self._jwks_body
