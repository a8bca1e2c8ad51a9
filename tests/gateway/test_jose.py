"""The JOSE helpers: canonical base64url decoding and the signature check of every algorithm
the gateway accepts, against signatures made by an independent implementation (PyJWT's)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from hypothesis import given
from hypothesis import strategies as st
from jwt.algorithms import get_default_algorithms

from gateway.dpop import ASYMMETRIC_ALGORITHMS
from gateway.jose import (
    SIGNATURE_ALGORITHMS,
    b64url_decode,
    decode_checked_alphabet,
    verify_signature,
)
from gateway.jwks import KEY_TYPE_OF_ALG
from gateway.settings import SUPPORTED_ALGORITHMS

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


CASES = [(alg, None) for alg in SUPPORTED_ALGORITHMS] + [("EdDSA", "Ed448")]
IDS = [alg if curve is None else f"{alg}-{curve}" for alg, curve in CASES]


def test_every_algorithm_the_gateway_accepts_has_a_signature_check() -> None:
    assert set(SUPPORTED_ALGORITHMS) == SIGNATURE_ALGORITHMS
    assert set(KEY_TYPE_OF_ALG) == SIGNATURE_ALGORITHMS  # access tokens and events
    assert set(ASYMMETRIC_ALGORITHMS) == SIGNATURE_ALGORITHMS  # DPoP proofs
    assert not {"none", "HS256", "HS384", "HS512"} & SIGNATURE_ALGORITHMS


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


@pytest.mark.parametrize("alg", SUPPORTED_ALGORITHMS)
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
