"""The low-S rule of ECDSA signatures (portcullis/jose.py), against signatures and
verifications of an independent implementation (cryptography's, OpenSSL underneath)."""

from __future__ import annotations

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)
from hypothesis import given
from hypothesis import strategies as st

from portcullis.jose import ECDSA_CURVES, is_low_s, low_s

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
