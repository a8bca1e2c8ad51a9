"""DPoP (RFC 9449) for both services, once: the checks of a proof, the URI comparison its
`htu` needs, `ath`, the binding of a token to a key and server-provided nonces.

Pure: given the request's method and URI, the access token it presents (if any) and the
time, a `ProofChecker` tells whether the values of the request's `DPoP` header hold a proof
for this request, and of which key. No I/O, no policy: which algorithms are accepted, how
old a proof may be and the nonces' key come from the caller's settings (`ProofPolicy`,
`NonceMaker`); a proof used twice is caught by the caller's replay cache, given
`Proof.replay_key` until `Proof.replay_until`; how a refusal is answered is the caller's.

The checks of RFC 9449 §4.3, in this order; a failure is `InvalidProof`, its description
naming the rule broken (never a value), for the client:
 1. exactly one `DPoP` header (item 1);
 2. a compact JWS, each part canonical base64url, header and payload JSON objects (item 2);
 3. `typ` is `dpop+jwt` (item 4), compared as a media type (RFC 7515 §4.1.9); no `crit`
    parameter (none is understood: RFC 7515 §4.1.11);
 4. `alg` on the allow-list, which never holds `none` or a MAC algorithm (item 5);
 5. `jwk` is a public key of the type (and curve, and size) `alg` needs, with no private
    member (item 7);
 6. the signature verifies with that key (item 6);
 7. the claims of §4.2 are there and well typed: `jti`, `htm`, `htu`, `iat`, and `ath` when
    the proof comes with an access token (item 3, §7);
 8. `htm` is the request's method (item 8);
 9. `htu` is the request's URI, query and fragment ignored, both compared after RFC 3986
    §6.2.2 (case, percent-encoding, dot segments) and §6.2.3 (default port, empty path)
    normalisation; a URI with a control character, a space or anything beyond ASCII is no
    URI and never matches (item 9);
10. with server-provided nonces on (§9, item 10), a `nonce` a `NonceMaker` with the
    caller's key made and that has not expired; else `UseNonce`, so that the caller
    answers with a fresh nonce;
11. `iat` is no older than `max_age`, and no newer than now, both give or take `leeway`
    (item 11, §11.1);
12. `ath` is the base64url SHA-256 of the access token presented (item 12, §7).
Then the binding (item 12, §6.1): a token's `cnf.jkt` must be the RFC 7638 thumbprint of
the proof's key, `check_binding`, whose failure is `InvalidBinding`.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import math
import re
import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from jwt.algorithms import Algorithm, get_default_algorithms
from jwt.exceptions import InvalidKeyError

from .jose import (
    NotAnObject,
    b64url_decode,
    b64url_encode,
    compact_parts,
    decode_checked_alphabet,
    json_object,
    thumbprint,
    verify_signature,
)

_KEY_LOADERS: Mapping[str, Algorithm] = get_default_algorithms()  # from_jwk of each alg
# RFC 9449 §4.2: an asymmetric algorithm; `none` and the MAC algorithms never qualify. In
# this order in a challenge's `algs` (§7.1) and in discovery (§5.1).
ASYMMETRIC_ALGORITHMS = (
    "ES256", "ES384", "ES512", "PS256", "PS384", "PS512", "RS256", "RS384", "RS512", "EdDSA",
)  # fmt: skip
_EC_CURVES = {"ES256": "P-256", "ES384": "P-384", "ES512": "P-521"}
_OKP_CURVES = frozenset({"Ed25519", "Ed448"})
_MIN_RSA_BITS = 2048  # RFC 7518 §3.3, §3.5
# RFC 7517 §9.3, RFC 7518 §6.2.2, §6.3.2, §6.4, RFC 8037 §2: members only a private (or a
# symmetric) key has.
_PRIVATE_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})
_DPOP_TYPES = frozenset({"dpop+jwt", "application/dpop+jwt"})  # RFC 7515 §4.1.9
MAX_JTI = 256  # characters; a jti is a random identifier (§4.2), not a document
_KEYS_KEPT = 1024  # public keys built from proofs' jwk, by thumbprint


class InvalidProof(Exception):
    """The DPoP proof is not acceptable (error="invalid_dpop_proof", §7.1 and §5). The
    description is for the client: it names the rule broken, never a value."""

    def __init__(self, description: str) -> None:
        super().__init__(description)
        self.description = description


class UseNonce(InvalidProof):
    """The proof lacks a nonce this server made, or its nonce has expired
    (error="use_dpop_nonce", with a nonce to use: §8, §9)."""


class InvalidBinding(Exception):
    """The token and the proof do not belong together (§6.1; error="invalid_token" at a
    resource, §7.1)."""

    def __init__(self, description: str) -> None:
        super().__init__(description)
        self.description = description


@dataclass(frozen=True, slots=True)
class Proof:
    """A proof that passed every check of `ProofChecker.check`."""

    jkt: str  # RFC 7638 thumbprint of its key, base64url
    jti: str
    replay_until: float  # seconds since the epoch: past this, `iat` refuses it anyway

    @property
    def replay_key(self) -> bytes:
        """What a replay cache records of the proof (§11.1: a `jti` is unique per key):
        its key and its `jti`, digested, so that its length is no cache's business and one
        client's `jti` cannot collide with another's. Never the signature: a proof's ECDSA
        twin (r, n - s), which verifies too, is that proof used again (jose.py)."""
        return hashlib.sha256(f"{self.jkt}.{self.jti}".encode()).digest()[:16]


# ---------------------------------------------------------------------------- htu

_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PERCENT = re.compile(r"%([0-9A-Fa-f]{2})")
_DEFAULT_PORTS = {"http": 80, "https": 443}
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


def _percent_normalised(text: str) -> str:
    """RFC 3986 §6.2.2.1: percent-encodings in upper case; §6.2.2.2: those of unreserved
    characters decoded."""

    def one(match: re.Match[str]) -> str:
        char = chr(int(match.group(1), 16))
        return char if char in _UNRESERVED else "%" + match.group(1).upper()

    return _PERCENT.sub(one, text) if "%" in text else text


def remove_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4 (applied by §6.2.2.3)."""
    output: list[str] = []
    while path:
        if path.startswith("../"):
            path = path[3:]
        elif path.startswith("./") or path.startswith("/./"):
            path = path[2:]
        elif path == "/.":
            path = "/"
        elif path.startswith("/../"):
            path = path[3:]
            if output:
                output.pop()
        elif path == "/..":
            path = "/"
            if output:
                output.pop()
        elif path in (".", ".."):
            path = ""
        else:
            start = 1 if path.startswith("/") else 0
            end = path.find("/", start)
            end = len(path) if end < 0 else end
            output.append(path[:end])
            path = path[end:]
    return "".join(output)


def normalise_uri(uri: str) -> str | None:
    """An absolute http(s) URI without its query and fragment, in the form RFC 3986
    §6.2.2 (case, percent-encoding, dot segments) and §6.2.3 (default port, empty path)
    give it; None when `uri` is no such URI: one with a character outside visible ASCII
    (RFC 3986 §2 has no place for controls, spaces or other characters unencoded), or with
    user information, which a request's URI never has."""
    if not _VISIBLE_ASCII.fullmatch(uri):
        return None  # urlsplit would quietly drop tabs and newlines
    try:
        parts = urlsplit(uri)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or "@" in parts.netloc:
        return None
    host = _percent_normalised(parts.hostname).lower()  # urlsplit leaves [] off IPv6
    if ":" in host:
        host = f"[{host}]"
    authority = host if port is None or port == _DEFAULT_PORTS[scheme] else f"{host}:{port}"
    path = remove_dot_segments(_percent_normalised(parts.path)) or "/"
    return f"{scheme}://{authority}{path}"


def _without_query(uri: str) -> str:
    end = len(uri)
    for mark in ("?", "#"):
        found = uri.find(mark)
        if 0 <= found < end:
            end = found
    return uri[:end]


def same_resource(htu: str, request_uri: str) -> bool:
    """Whether a proof's `htu` names the request's URI (§4.3 item 9): the same once query
    and fragment are dropped and both are normalised."""
    htu_base, request_base = _without_query(htu), _without_query(request_uri)
    if htu_base == request_base:
        return True  # the common case: the client wrote the URI as it sent it
    normalised = normalise_uri(htu_base)
    return normalised is not None and normalised == normalise_uri(request_base)


# ---------------------------------------------------------------------------- ath


def access_token_hash(token: str) -> str:
    """`ath` (§4.2): base64url of the SHA-256 of the token's ASCII."""
    return b64url_encode(hashlib.sha256(token.encode("ascii", "replace")).digest())


# ---------------------------------------------------------------------------- nonces


class NonceMaker:
    """Server-provided nonces (§8, §9) that need no state: the time a nonce was made, and a
    MAC of it under `key`, so every server with the same key accepts the nonces of the
    others. One nonce is handed out for a quarter of `lifetime` (§9 lets a server give the
    same one to many requests), so each is good for at least three quarters of it, and at
    most `lifetime`."""

    def __init__(self, key: bytes, lifetime: float) -> None:
        if lifetime < 4:
            raise ValueError("a nonce lifetime is at least 4 seconds: a quarter of it is one")
        self._key = key
        self.lifetime = lifetime
        self._step = int(lifetime // 4)
        self._made: tuple[int, str] = (-1, "")

    def current(self, now: float) -> str:
        """The nonce to hand out at `now`."""
        made = int(now) // self._step * self._step
        if self._made[0] != made:
            stamp = struct.pack(">Q", made)
            self._made = (made, b64url_encode(stamp + self._mac(stamp)))
        return self._made[1]

    def valid(self, nonce: str, now: float) -> bool:
        """Whether `nonce` was made with this key no longer than `lifetime` ago."""
        try:
            raw = b64url_decode(nonce)
        except binascii.Error:
            return False
        if len(raw) != 24:
            return False
        stamp, mac = raw[:8], raw[8:]
        if not hmac.compare_digest(mac, self._mac(stamp)):
            return False
        made: int = struct.unpack(">Q", stamp)[0]
        return made <= now and now - made <= self.lifetime

    def _mac(self, stamp: bytes) -> bytes:
        return hmac.new(self._key, b"dpop-nonce:" + stamp, hashlib.sha256).digest()[:16]


# ---------------------------------------------------------------------------- the checker


@dataclass(frozen=True, slots=True)
class ProofPolicy:
    """What a proof must meet, from the caller's settings (seconds and algorithm names)."""

    algorithms: frozenset[str]
    max_age: float
    leeway: float

    @property
    def challenge_algorithms(self) -> str:
        """The `algs` challenge parameter (§7.1): the accepted algorithms, space-separated."""
        return " ".join(a for a in ASYMMETRIC_ALGORITHMS if a in self.algorithms)


def _key_problem(alg: str, jwk: Mapping[str, Any]) -> str | None:
    """Why `jwk` cannot verify `alg`, if it cannot (RFC 8725 §3.1: the key's type is the one
    the algorithm needs)."""
    kty = jwk.get("kty")
    if alg in _EC_CURVES:
        if kty != "EC" or jwk.get("crv") != _EC_CURVES[alg]:
            return f"the proof's key is not an EC key on {_EC_CURVES[alg]}"
    elif alg == "EdDSA":
        if kty != "OKP" or jwk.get("crv") not in _OKP_CURVES:
            return "the proof's key is not an Ed25519 or Ed448 key"
    elif kty != "RSA":
        return "the proof's key is not an RSA key"
    return None


class ProofChecker:
    """The checks of the module's docstring, with the public keys of recent proofs kept (by
    thumbprint, bounded) so a client's key is not rebuilt on every request."""

    def __init__(self, policy: ProofPolicy, nonces: NonceMaker | None = None) -> None:
        """`nonces`: when given, every proof must carry a nonce it made (§9)."""
        unknown = policy.algorithms - set(ASYMMETRIC_ALGORITHMS)
        if unknown:
            raise ValueError(f"not asymmetric signature algorithms: {sorted(unknown)}")
        self.policy = policy
        self.nonces = nonces
        self._keys: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def check(
        self,
        headers: Sequence[str],
        *,
        method: str,
        uri: str,
        access_token: str | None,
        now: float,
    ) -> Proof:
        """The proof in the request's `DPoP` header values, checked against the request's
        method, URI (as the client sent it: the external one behind a proxy) and the access
        token it presents (None where none is, at a token endpoint: then no `ath`);
        raises InvalidProof."""
        # 1. one header (§4.3 item 1)
        if not headers:
            raise InvalidProof("the request has no DPoP proof")
        if len(headers) > 1:
            raise InvalidProof("the request has more than one DPoP header")
        proof = headers[0].strip(" \t")  # RFC 9110 §5.5: optional whitespace only
        # 2. a compact JWS (item 2)
        parts = compact_parts(proof)
        if parts is None:
            raise InvalidProof("the DPoP proof is not a signed JWT")
        header_b64, payload_b64, signature_b64 = parts
        header = _json_object(header_b64, "header")
        # 3. typ (item 4), crit
        typ = header.get("typ")
        if not isinstance(typ, str) or typ.lower() not in _DPOP_TYPES:
            raise InvalidProof("the DPoP proof's typ is not dpop+jwt")
        if "crit" in header:
            raise InvalidProof("the DPoP proof has critical header parameters")
        # 4. alg (item 5)
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self.policy.algorithms:
            raise InvalidProof("the DPoP proof's signing algorithm is not accepted")
        # 5. jwk: a public key fit for alg (item 7)
        jwk = header.get("jwk")
        if not isinstance(jwk, dict):
            raise InvalidProof("the DPoP proof has no jwk header")
        if _PRIVATE_MEMBERS & jwk.keys():
            raise InvalidProof("the DPoP proof's jwk holds a private key")
        problem = _key_problem(alg, jwk)
        if problem is not None:
            raise InvalidProof(problem)
        try:
            jkt = thumbprint(jwk)
        except ValueError:
            raise InvalidProof("the DPoP proof's jwk is not a valid public key") from None
        key = self._key(alg, jkt, jwk)
        # 6. signature (item 6)
        try:
            signature = decode_checked_alphabet(signature_b64)
        except binascii.Error:
            raise InvalidProof("the DPoP proof's signature is not base64url") from None
        signing_input = proof[: len(header_b64) + 1 + len(payload_b64)].encode("ascii")
        if not verify_signature(alg, key, signing_input, signature):
            raise InvalidProof("the DPoP proof's signature is invalid")
        # 7. claims (item 3)
        claims = _json_object(payload_b64, "payload")
        jti, htm, htu, iat, ath = (claims.get(n) for n in ("jti", "htm", "htu", "iat", "ath"))
        if not isinstance(jti, str) or not 0 < len(jti) <= MAX_JTI:
            raise InvalidProof("the DPoP proof has no usable jti")
        if not isinstance(htm, str) or not isinstance(htu, str):
            raise InvalidProof("the DPoP proof lacks htm or htu")
        if isinstance(iat, bool) or not isinstance(iat, int | float) or not math.isfinite(iat):
            raise InvalidProof("the DPoP proof has no numeric iat")
        if access_token is not None and not isinstance(ath, str):
            raise InvalidProof("the DPoP proof has no ath, the hash of the access token")
        # 8. htm (item 8): methods are case-sensitive (RFC 9110 §9.1)
        if htm != method:
            raise InvalidProof("the DPoP proof is for another method")
        # 9. htu (item 9)
        if not same_resource(htu, uri):
            raise InvalidProof("the DPoP proof is for another URI")
        # 10. the server's nonce, when it provides them (item 10, §9)
        nonces = self.nonces
        if nonces is not None:
            nonce = claims.get("nonce")
            if not isinstance(nonce, str) or not nonces.valid(nonce, now):
                raise UseNonce("the DPoP proof must carry a current nonce from DPoP-Nonce")
        # 11. iat (item 11)
        policy = self.policy
        if now - iat > policy.max_age + policy.leeway:
            raise InvalidProof("the DPoP proof is too old")
        if iat - now > policy.leeway:
            raise InvalidProof("the DPoP proof is dated in the future")
        # 12. ath (item 12, §7)
        if access_token is not None and ath != access_token_hash(access_token):
            raise InvalidProof("the DPoP proof is for another access token")
        return Proof(jkt, jti, float(iat) + policy.max_age + policy.leeway)

    def _key(self, alg: str, jkt: str, jwk: Mapping[str, Any]) -> Any:
        """The public key of `jwk`, built once for each (algorithm family, thumbprint): the
        thumbprint covers every member that builds the key (RFC 7638 §3.2)."""
        family = "RSA" if alg[0] in "RP" else alg
        slot = (family, jkt)
        key = self._keys.get(slot)
        if key is not None:
            self._keys.move_to_end(slot)
            return key
        try:
            key = _KEY_LOADERS[alg].from_jwk(dict(jwk))
        except (InvalidKeyError, ValueError, TypeError, KeyError):
            raise InvalidProof("the DPoP proof's jwk is not a valid public key") from None
        if family == "RSA" and key.key_size < _MIN_RSA_BITS:
            raise InvalidProof("the DPoP proof's RSA key is shorter than 2048 bits")
        self._keys[slot] = key
        if len(self._keys) > _KEYS_KEPT:
            self._keys.popitem(last=False)
        return key


def _json_object(part: str, what: str) -> dict[str, Any]:
    """The JSON object the proof's header or payload (`what`) encodes."""
    try:
        return json_object(part)
    except NotAnObject as exc:
        raise InvalidProof(f"the DPoP proof's {what} {exc.problem}") from None


def check_binding(proof: Proof, jkt: str) -> None:
    """§4.3 item 12, §6.1: the token is bound to the proof's key."""
    if proof.jkt != jkt:
        raise InvalidBinding("the token is bound to another key than the DPoP proof's")
