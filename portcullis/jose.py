"""ECDSA signatures of JWS (ES256, ES384, ES512) in one spelling: the low-S form. Pure,
standard library only.

An ECDSA signature is a pair (r, s); RFC 7518 §3.4 writes it as R || S, each a big-endian
integer as wide as the curve's order n. Whoever holds a signature (r, s) can make a second
one without the key: (r, n - s) verifies just as well (SEC 1 §4.1.4 only ever reads s
through its inverse, and negating s negates the point whose x is compared with r). So every
ES* token has two spellings that verify, and anything keyed on a token's text (a cache of
verified tokens, say) sees two tokens. The canonical spelling is the one with s <= n / 2
(`is_low_s`; the rule of Bitcoin's BIP 62 and of libsecp256k1); `low_s` turns either one
into it. Other algorithms have one spelling already: RSA signatures are one integer below
the modulus, and EdDSA's S must be below the group order (RFC 8032 §5.1.7), which the
verifiers enforce.

RFC 7515 and RFC 7518 do not require low S, and most signers do not produce it
(cryptography, OpenSSL, Java's ECDSA as in Keycloak, browsers' WebCrypto: random S, high half
the time). So which spellings are accepted is decided per kind of JWS, by who signs it and
what is keyed on it:

- Access tokens at the gateway are accepted in either spelling: the gateway trusts any
  standards issuer, and refusing high S would refuse half of those issuers' tokens. Instead
  what is keyed on a token is keyed on its low-S spelling (gateway/verifiers/cache.py
  `canonical_spelling`): a token and its twin are one entry of the verified-token cache and
  of the introspection caches, in memory and in Redis. The deny-set names tokens by `jti`
  and so covers both spellings.
- Revocation events (SETs) at the gateway come from this project's authorization server
  alone, which signs low S: a high-S SET is refused like one whose signature does not verify.
- Tokens the authorization server reads back (its access tokens at introspection, userinfo,
  revocation and the admin API; its ID tokens as logout hints) are its own, signed low S by
  its key ring (authserver/keys.py): a high-S one is refused like a bad signature.
- DPoP proofs (RFC 9449) at both and client assertions (RFC 7523) at the authorization
  server are signed by clients, often with WebCrypto: refusing high S would refuse half of
  their proofs, so both spellings are accepted. Nothing keys on their signatures: the replay
  caches hold the key's thumbprint and the `jti` (a proof), or the client and the `jti` (an
  assertion), so a used proof's twin is a replay and refused as one; `ath` is the hash of
  the access token, not of the proof.

So the authorization server goes first in an upgrade: gateways refuse the high-S half of
the events an earlier server signs, and a server refuses the high-S tokens an earlier one
issued, for the rest of their lifetime.

Curve orders from SEC 2 (version 2) §2.4.2, §2.5.1, §2.6.1 (secp256r1, secp384r1,
secp521r1: the P-256, P-384 and P-521 of RFC 7518 §3.4).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple


class Curve(NamedTuple):
    order: int  # n
    width: int  # bytes of R, and of S, in a JWS signature (RFC 7518 §3.4)


def _hex(digits: str) -> int:
    """An integer written as SEC 2 writes it: hexadecimal digits in groups."""
    return int(digits.replace(" ", ""), 16)


ECDSA_CURVES: Mapping[str, Curve] = {
    "ES256": Curve(
        _hex("FFFFFFFF 00000000 FFFFFFFF FFFFFFFF BCE6FAAD A7179E84 F3B9CAC2 FC632551"),
        32,
    ),
    "ES384": Curve(
        _hex(
            "FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF"
            "C7634D81 F4372DDF 581A0DB2 48B0A77A ECEC196A CCC52973"
        ),
        48,
    ),
    "ES512": Curve(
        _hex(
            "01FF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFF FFFFFFFA"
            "51868783 BF2F966B 7FCC0148 F709A5D0 3BB5C9B8 899C47AE BB6FB71E 91386409"
        ),
        66,
    ),
}


def is_low_s(alg: str, signature: bytes) -> bool:
    """Whether `signature`, a JWS signature by `alg`, is in its one canonical spelling: for
    ES256, ES384 and ES512, R || S of the curve's width with S at most half the order; for
    any other algorithm, always (it has one spelling). A signature of another length than
    its curve's is not."""
    curve = ECDSA_CURVES.get(alg)
    if curve is None:
        return True
    if len(signature) != 2 * curve.width:
        return False
    # n is odd: s <= n >> 1 is s < n / 2, and of s and n - s exactly one is so.
    return int.from_bytes(signature[curve.width :], "big") <= curve.order >> 1


def low_s(alg: str, signature: bytes) -> bytes:
    """`signature` in its low-S spelling: for ES256, ES384 and ES512, S replaced by n - S
    when S is above half the order; anything else (another algorithm, another length, an S
    that is no residue mod n) unchanged, which no verifier accepts any more than before."""
    curve = ECDSA_CURVES.get(alg)
    if curve is None or len(signature) != 2 * curve.width:
        return signature
    width = curve.width
    s = int.from_bytes(signature[width:], "big")
    if not curve.order >> 1 < s < curve.order:
        return signature
    return signature[:width] + (curve.order - s).to_bytes(width, "big")
