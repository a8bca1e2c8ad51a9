"""The kernel's JOSE (portcullis/jose.py), against an independent implementation of each
standard (PyJWT's signers, cryptography's ECDSA, RFC 7638's example, hand-made base64url):
the signature check of every asymmetric algorithm, canonical base64url, the RFC 7638
thumbprint, and the low-S rule of ECDSA signatures."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)
from hypothesis import given
from hypothesis import strategies as st
from jwt.algorithms import get_default_algorithms

from portcullis.jose import (
    ECDSA_CURVES,
    SIGNATURE_ALGORITHMS,
    b64url_decode,
    decode_checked_alphabet,
    is_low_s,
    is_thumbprint,
    low_s,
    thumbprint,
    verify_signature,
)
from tests.dpop_proofs import DpopKey, jwk_thumbprint

# ---------------------------------------------------------------------------- signatures

SIGNERS = get_default_algorithms()
SIGNING_INPUT = b"eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJ1c2VyLTEyMyJ9"
RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
OTHER_RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def private_key(alg: str, curve: str | None = None) -> Any:
    """A new private key for `alg` (for EdDSA, `curve` picks Ed448 over Ed25519)."""
    if alg.startswith(("RS", "PS")):
        return RSA_KEY  # RSA keys are slow to make: one for all, another for the wrong-key case
    if alg == "EdDSA":
        return (ed448.Ed448PrivateKey if curve == "Ed448" else ed25519.Ed25519PrivateKey).generate()
    curves = {"ES256": ec.SECP256R1(), "ES384": ec.SECP384R1(), "ES512": ec.SECP521R1()}
    return ec.generate_private_key(curves[alg])


def other_private_key(alg: str, curve: str | None = None) -> Any:
    return OTHER_RSA_KEY if alg.startswith(("RS", "PS")) else private_key(alg, curve)


ALGORITHMS = sorted(SIGNATURE_ALGORITHMS)
CASES = [(alg, None) for alg in ALGORITHMS] + [("EdDSA", "Ed448")]
IDS = [alg if curve is None else f"{alg}-{curve}" for alg, curve in CASES]


@pytest.mark.parametrize(("alg", "curve"), CASES, ids=IDS)
def test_a_good_signature_verifies(alg: str, curve: str | None) -> None:
    key = private_key(alg, curve)
    signature = SIGNERS[alg].sign(SIGNING_INPUT, key)
    assert verify_signature(alg, key.public_key(), SIGNING_INPUT, signature)


@pytest.mark.parametrize(("alg", "curve"), CASES, ids=IDS)
def test_a_signature_of_other_input_or_with_a_flipped_bit_fails(
    alg: str, curve: str | None
) -> None:
    key = private_key(alg, curve)
    signature = SIGNERS[alg].sign(SIGNING_INPUT, key)
    public = key.public_key()
    assert not verify_signature(alg, public, SIGNING_INPUT + b"x", signature)
    assert not verify_signature(alg, public, SIGNING_INPUT[:-1] + b"Q", signature)
    for index in (0, len(signature) // 2, len(signature) - 1):
        tampered = bytearray(signature)
        tampered[index] ^= 0x01
        assert not verify_signature(alg, public, SIGNING_INPUT, bytes(tampered))


@pytest.mark.parametrize(("alg", "curve"), CASES, ids=IDS)
def test_a_signature_of_the_wrong_length_fails(alg: str, curve: str | None) -> None:
    key = private_key(alg, curve)
    signature = SIGNERS[alg].sign(SIGNING_INPUT, key)
    public = key.public_key()
    for wrong in (b"", signature[:-1], signature + b"\x00", b"\x00" + signature, signature * 2):
        assert not verify_signature(alg, public, SIGNING_INPUT, wrong)


@pytest.mark.parametrize("alg", ["ES256", "ES384", "ES512"])
def test_an_ecdsa_signature_whose_halves_are_padded_differently_fails(alg: str) -> None:
    # R and S are fixed-width (RFC 7518 §3.4): the same numbers spelt one byte shorter or
    # longer each are not the signature, even though their DER encoding would be.
    key = private_key(alg)
    signature = SIGNERS[alg].sign(SIGNING_INPUT, key)
    half = len(signature) // 2
    r, s = signature[:half], signature[half:]
    public = key.public_key()
    assert not verify_signature(alg, public, SIGNING_INPUT, b"\x00" + r + b"\x00" + s)
    if r[0] == 0 and s[0] == 0:
        assert not verify_signature(alg, public, SIGNING_INPUT, r[1:] + s[1:])


@pytest.mark.parametrize(("alg", "curve"), CASES, ids=IDS)
def test_a_signature_by_another_key_of_the_same_type_fails(alg: str, curve: str | None) -> None:
    signature = SIGNERS[alg].sign(SIGNING_INPUT, private_key(alg, curve))
    other = other_private_key(alg, curve).public_key()
    assert not verify_signature(alg, other, SIGNING_INPUT, signature)


def test_pss_and_pkcs1_signatures_are_not_taken_for_each_other() -> None:
    for signed_as, checked_as in (("RS256", "PS256"), ("PS256", "RS256"), ("RS256", "RS384")):
        signature = SIGNERS[signed_as].sign(SIGNING_INPUT, RSA_KEY)
        assert not verify_signature(checked_as, RSA_KEY.public_key(), SIGNING_INPUT, signature)


def test_ed25519_and_ed448_keys_are_both_eddsa_keys_but_not_each_others() -> None:
    signed = ed25519.Ed25519PrivateKey.generate()
    signature = SIGNERS["EdDSA"].sign(SIGNING_INPUT, signed)
    other_curve = ed448.Ed448PrivateKey.generate().public_key()
    assert not verify_signature("EdDSA", other_curve, SIGNING_INPUT, signature)


# What each algorithm needs (RFC 7518 §3.3-3.5, RFC 8037 §3.1): a key type, and for ECDSA one curve.
FITTING_KEY = {
    "RS": rsa.RSAPublicKey,
    "PS": rsa.RSAPublicKey,
    "ES256": ec.SECP256R1,
    "ES384": ec.SECP384R1,
    "ES512": ec.SECP521R1,
    "EdDSA": ed25519.Ed25519PublicKey | ed448.Ed448PublicKey,
}


def fits(alg: str, key: Any) -> bool:
    if alg.startswith("ES"):
        return isinstance(key, ec.EllipticCurvePublicKey) and isinstance(
            key.curve, FITTING_KEY[alg]
        )
    return isinstance(key, FITTING_KEY[alg if alg == "EdDSA" else alg[:2]])


UNFIT_CANDIDATES = [
    RSA_KEY.public_key(),
    ec.generate_private_key(ec.SECP256R1()).public_key(),
    ec.generate_private_key(ec.SECP384R1()).public_key(),
    ec.generate_private_key(ec.SECP521R1()).public_key(),
    ed25519.Ed25519PrivateKey.generate().public_key(),
    ed448.Ed448PrivateKey.generate().public_key(),
    b"a symmetric secret",
    None,
]


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_a_key_of_another_type_or_curve_than_the_algorithm_needs_never_verifies(
    alg: str,
) -> None:
    # RFC 8725 §3.1. Whatever the signature, the answer is no, never an error.
    signature = SIGNERS[alg].sign(SIGNING_INPUT, private_key(alg))
    unfit = [key for key in UNFIT_CANDIDATES if not fits(alg, key)]
    assert len(unfit) >= 5
    for key in unfit:
        assert not verify_signature(alg, key, SIGNING_INPUT, signature)


@pytest.mark.parametrize(("alg", "curve"), CASES, ids=IDS)
def test_a_private_key_is_not_a_verification_key(alg: str, curve: str | None) -> None:
    key = private_key(alg, curve)
    signature = SIGNERS[alg].sign(SIGNING_INPUT, key)
    assert not verify_signature(alg, key, SIGNING_INPUT, signature)


# ---------------------------------------------------------------------------- base64url


@given(st.binary(max_size=200))
def test_checked_alphabet_decoding_reads_every_canonical_spelling(data: bytes) -> None:
    text = base64.urlsafe_b64encode(data).rstrip(b"=").decode()
    assert decode_checked_alphabet(text) == data
    assert b64url_decode(text) == data


@pytest.mark.parametrize(
    "text",
    [
        "A",  # a length no bytes encode to
        "AAAAA",
        "AB",  # 2 characters left: the last must leave its 4 unused bits zero
        "AAAAAAx",  # 3 characters left: 2 unused bits
        "_-_-_-_-_-_-_-_-_9",  # 2 left, "9" has a pad bit set
    ],
)
def test_checked_alphabet_decoding_refuses_what_is_not_canonical(text: str) -> None:
    with pytest.raises(binascii.Error):
        decode_checked_alphabet(text)
    with pytest.raises(binascii.Error):
        b64url_decode(text)


@pytest.mark.parametrize("text", ["AA==", "AA=", "A+/A", "AAA\n", "AA AA", "AAAé"])
def test_the_full_decoder_still_refuses_characters_outside_the_alphabet(text: str) -> None:
    with pytest.raises(binascii.Error):
        b64url_decode(text)


def test_both_url_safe_characters_decode_as_their_standard_counterparts() -> None:
    assert decode_checked_alphabet("-_-_") == base64.b64decode("+/+/")


# ---------------------------------------------------------------------------- thumbprints

# RFC 7638 §3.1: the example RSA key and its thumbprint.
RFC7638_KEY = {
    "kty": "RSA",
    "n": (
        "0vx7agoebGcQSuuPiLJXZptN9nndrQmbXEps2aiAFbWhM78LhWx4cbbfAAtVT86zwu1RK7aPFFxuhDR1L6tS"
        "oc_BJECPebWKRXjBZCiFV4n3oknjhMstn64tZ_2W-5JsGY4Hc5n9yBXArwl93lqt7_RN5w6Cf0h4QyQ5v-65Y"
        "GjQR0_FDW2QvzqY368QQMicAtaSqzs8KJZgnYb9c7d0zgdAZHzu6qMQvRL5hajrn1n91CbOpbISD08qNLyrd"
        "kt-bFTWhAI4vMQFh6WeZu0fM4lFd2NcRwr3XPksINHaQ-G_xBniIqbw0Ls1jF44-csFCur-kEgU8awapJzKnq"
        "DKgw"
    ),
    "e": "AQAB",
    "alg": "RS256",
    "kid": "2011-04-29",
}
RFC7638_THUMBPRINT = "NzbLsXh8uDCcd-6MNwXF4W_7noWXFZAfHkxZsRGC9Xs"


def test_thumbprint_of_rfc_7638_example() -> None:
    assert thumbprint(RFC7638_KEY) == RFC7638_THUMBPRINT
    assert jwk_thumbprint(RFC7638_KEY) == thumbprint(RFC7638_KEY)


@pytest.mark.parametrize("alg", ["ES256", "ES384", "ES512", "RS256", "EdDSA"])
def test_thumbprint_of_each_key_type_covers_only_the_required_members(alg: str) -> None:
    key = DpopKey(alg)
    assert thumbprint(dict(key.jwk, kid="a", use="sig", alg=alg)) == thumbprint(key.jwk)
    assert thumbprint(key.jwk) == key.jkt  # the test's own RFC 7638 reading


@pytest.mark.parametrize(
    "jwk",
    [
        {"kty": "oct", "k": "c2VjcmV0"},
        {"kty": "EC", "crv": "P-256", "x": "abc"},
        {"kty": "EC", "crv": "P-256", "x": "abc", "y": ""},
        {"kty": "RSA", "n": "abc", "e": 65537},
        {},
    ],
    ids=["symmetric", "missing-member", "empty-member", "number-member", "empty"],
)
def test_a_key_without_a_thumbprint_is_refused(jwk: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        thumbprint(jwk)


def test_a_thumbprint_is_told_from_what_is_none() -> None:
    assert is_thumbprint(RFC7638_THUMBPRINT)
    assert is_thumbprint(DpopKey().jkt)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "abc",
        RFC7638_THUMBPRINT[:-1] + "=",
        "a" * 44,
        RFC7638_THUMBPRINT + "\n",
        RFC7638_THUMBPRINT[:-1] + "t",  # 43 characters, but pad bits set: no 32 bytes spell it
        RFC7638_THUMBPRINT[:-1] + "+",
    ],
)
def test_what_is_no_thumbprint_is_told(value: str) -> None:
    assert not is_thumbprint(value)


# ---------------------------------------------------------------------------- low S

CURVES = {
    "ES256": (ec.SECP256R1(), hashes.SHA256()),
    "ES384": (ec.SECP384R1(), hashes.SHA384()),
    "ES512": (ec.SECP521R1(), hashes.SHA512()),
}
DATA = b"eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJ1c2VyLTEyMyJ9"


def jws_signature(alg: str, key: ec.EllipticCurvePrivateKey) -> bytes:
    width = ECDSA_CURVES[alg].width
    r, s = decode_dss_signature(key.sign(DATA, ec.ECDSA(CURVES[alg][1])))
    return r.to_bytes(width, "big") + s.to_bytes(width, "big")


def verifies(alg: str, key: ec.EllipticCurvePrivateKey, signature: bytes) -> bool:
    width = ECDSA_CURVES[alg].width
    der = encode_dss_signature(
        int.from_bytes(signature[:width], "big"), int.from_bytes(signature[width:], "big")
    )
    try:
        key.public_key().verify(der, DATA, ec.ECDSA(CURVES[alg][1]))
    except InvalidSignature:
        return False
    return True


def twin(alg: str, signature: bytes) -> bytes:
    """(r, n - s): the other signature that verifies."""
    order, width = ECDSA_CURVES[alg]
    s = int.from_bytes(signature[width:], "big")
    return signature[:width] + (order - s).to_bytes(width, "big")


@pytest.mark.parametrize("alg", sorted(CURVES))
def test_a_signature_and_its_twin_both_verify_and_exactly_one_is_low_s(alg: str) -> None:
    # The twin verifies only with the curve's true order: this checks the table too.
    key = ec.generate_private_key(CURVES[alg][0])
    for _ in range(16):
        signature = jws_signature(alg, key)
        other = twin(alg, signature)
        assert verifies(alg, key, signature) and verifies(alg, key, other)
        assert is_low_s(alg, signature) != is_low_s(alg, other)


@pytest.mark.parametrize("alg", sorted(CURVES))
def test_low_s_gives_the_low_spelling_of_either_and_keeps_a_low_one(alg: str) -> None:
    key = ec.generate_private_key(CURVES[alg][0])
    seen_high = False
    for _ in range(32):
        signature = jws_signature(alg, key)
        canonical = low_s(alg, signature)
        assert is_low_s(alg, canonical)
        assert verifies(alg, key, canonical)
        assert low_s(alg, twin(alg, signature)) == canonical
        assert low_s(alg, canonical) == canonical
        seen_high |= canonical != signature
    assert seen_high, "cryptography signs high S half the time: 32 low ones in a row"


@pytest.mark.parametrize("alg", sorted(CURVES))
def test_the_boundary_is_half_the_order(alg: str) -> None:
    order, width = ECDSA_CURVES[alg]
    r = (1).to_bytes(width, "big")
    half = r + (order // 2).to_bytes(width, "big")
    above = r + (order // 2 + 1).to_bytes(width, "big")
    assert is_low_s(alg, half)
    assert not is_low_s(alg, above)
    assert low_s(alg, above) == half
    assert low_s(alg, half) == half


@pytest.mark.parametrize("alg", sorted(CURVES))
def test_a_signature_of_another_length_or_an_s_beyond_the_order_is_left_as_it_is(
    alg: str,
) -> None:
    order, width = ECDSA_CURVES[alg]
    for wrong in (b"", b"\xff" * (2 * width - 1), b"\xff" * (2 * width + 1)):
        assert not is_low_s(alg, wrong)
        assert low_s(alg, wrong) == wrong
    r = (1).to_bytes(width, "big")
    for s in (order, 2 ** (8 * width) - 1):
        beyond = r + s.to_bytes(width, "big")
        assert not is_low_s(alg, beyond)
        assert low_s(alg, beyond) == beyond


@pytest.mark.parametrize("alg", ["RS256", "PS256", "EdDSA", "HS256", "none", "es256"])
@given(signature=st.binary(max_size=300))
def test_other_algorithms_have_one_spelling_already(alg: str, signature: bytes) -> None:
    assert is_low_s(alg, signature)
    assert low_s(alg, signature) is signature


@given(data=st.data())
def test_low_s_is_a_projection_onto_the_low_half(data: st.DataObject) -> None:
    alg = data.draw(st.sampled_from(sorted(CURVES)))
    order, width = ECDSA_CURVES[alg]
    r = data.draw(st.integers(min_value=1, max_value=order - 1))
    s = data.draw(st.integers(min_value=1, max_value=order - 1))
    signature = r.to_bytes(width, "big") + s.to_bytes(width, "big")
    canonical = low_s(alg, signature)
    assert is_low_s(alg, canonical)
    assert canonical[:width] == signature[:width]
    assert int.from_bytes(canonical[width:], "big") in (s, order - s)
    assert (canonical == signature) == is_low_s(alg, signature)
