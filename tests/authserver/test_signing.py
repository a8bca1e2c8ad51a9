"""What the token endpoint's signing keeps per ring and per process: the encoded protected
header of each key (it must always name the key that signed, across rotations, and go with
the key), the block of random bytes `jti`s and nonces are cut from (unique, and never
shared with a forked child), and the one spelling of its ECDSA signatures."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import jwt
import pytest

from authserver.keys import KeyRing, RotationPolicy, _ecdsa_sha256
from authserver.tokens import new_jti
from portcullis.jose import is_low_s
from portcullis.unique import UniqueBytes
from tests.support import ecdsa_twin


def header_and_claims(ring: KeyRing, token: str) -> tuple[dict[str, object], dict[str, object]]:
    """The token's header, and its claims once verified with the published key it names."""
    header = jwt.get_unverified_header(token)
    jwks = jwt.PyJWKSet.from_json(ring.jwks_body.decode())
    key = next(k for k in jwks.keys if k.key_id == header["kid"])
    claims = jwt.decode(token, key.key, algorithms=[key.algorithm_name], audience="api")
    return header, claims


def test_every_token_names_the_key_that_signed_it_before_and_after_a_rotation(
    tmp_path: Path,
) -> None:
    now = [1_000_000.0]
    policy = RotationPolicy(publish_ahead=60, retain=300)
    ring = KeyRing(tmp_path / "keys", policy, clock=lambda: now[0])
    ring.load(["ES256", "RS256"])
    first = ring.active("ES256")
    claims = {"sub": "s", "aud": "api", "n": 1}

    for typ in ("at+jwt", "JWT", "at+jwt"):  # the second at+jwt from the kept header
        header, verified = header_and_claims(ring, ring.sign("ES256", claims, typ=typ))
        assert header == {"alg": "ES256", "kid": first.kid, "typ": typ}
        assert verified == claims
    header, _ = header_and_claims(ring, ring.sign("RS256", claims, typ="at+jwt"))
    assert header == {"alg": "RS256", "kid": ring.active("RS256").kid, "typ": "at+jwt"}

    (rotation,) = ring.rotate(["ES256"], now[0])
    second = rotation.info
    # Published, not signing yet: the old key's header still.
    now[0] = second.active_from - 1
    ring.check(now[0])
    header, _ = header_and_claims(ring, ring.sign("ES256", claims, typ="at+jwt"))
    assert header["kid"] == first.kid
    # From its activation on, the new key signs and its own header says so, even before the
    # transition is written.
    now[0] = second.active_from
    header, verified = header_and_claims(ring, ring.sign("ES256", claims, typ="at+jwt"))
    assert header == {"alg": "ES256", "kid": second.kid, "typ": "at+jwt"}
    assert verified == claims
    ring.check(now[0] + 1)
    header, _ = header_and_claims(ring, ring.sign("ES256", claims, typ="JWT"))
    assert header == {"alg": "ES256", "kid": second.kid, "typ": "JWT"}


def test_the_kept_headers_go_with_the_keys_they_belong_to(tmp_path: Path) -> None:
    now = [1_000_000.0]
    policy = RotationPolicy(publish_ahead=60, retain=300)
    ring = KeyRing(tmp_path / "keys", policy, clock=lambda: now[0])
    ring.load(["ES256"])
    signed_by: set[str] = set()
    for _ in range(20):
        for typ in ("at+jwt", "JWT"):
            signed_by.add(jwt.get_unverified_header(ring.sign("ES256", {"n": 1}, typ=typ))["kid"])
        (rotation,) = ring.rotate(["ES256"], now[0])
        now[0] = rotation.info.active_from + policy.retain + 1
        ring.check(now[0])  # activates the successor and removes what has expired
    assert len(signed_by) == 20  # every rotation took effect
    kept = ring._snap.headers
    assert len(kept) <= 2 * len(ring.infos()) <= 4
    assert {kid for kid, _ in kept} <= {info.kid for info in ring.infos()}


def test_jtis_are_22_url_safe_characters_and_do_not_repeat() -> None:
    seen = {new_jti() for _ in range(50_000)}
    assert len(seen) == 50_000
    alphabet = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert all(len(jti) == 22 and set(jti) <= alphabet for jti in seen)


def test_unique_bytes_are_never_handed_out_twice_across_blocks() -> None:
    source = UniqueBytes()
    taken = [source.take(n) for n in [16, 12, UniqueBytes.BLOCK, 7] * 300]
    assert [len(t) for t in taken] == [16, 12, UniqueBytes.BLOCK, 7] * 300
    assert len(set(taken)) == len(taken)


def test_a_forked_child_does_not_reuse_its_parents_block() -> None:
    source = UniqueBytes()
    source.take(16)  # the parent now holds a block with bytes left in it
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next bytes, to the parent, then out
        try:
            os.write(write_end, source.take(16))
        finally:
            os._exit(0)
    os.close(write_end)
    child = os.read(read_end, 16)
    os.close(read_end)
    os.waitpid(pid, 0)
    parent = source.take(16)
    assert len(child) == 16 and child != parent


def test_repeatable_signatures_repeat_and_the_others_still_verify(tmp_path: Path) -> None:
    ring = KeyRing(tmp_path / "keys", RotationPolicy(publish_ahead=60, retain=300))
    ring.load(["ES256", "RS256"])
    claims = {"sub": "s", "aud": "api", "jti": "one"}
    # A rotated refresh's response, signed again within the grace window, is the same
    # (where OpenSSL signs deterministically: 3.2 and later).
    if _ecdsa_sha256().deterministic_signing:
        again = ring.sign("ES256", claims, typ="at+jwt")
        assert ring.sign("ES256", claims, typ="at+jwt") == again
    # A token signed once (client_credentials) need not be: ES256 draws its nonce.
    once = {ring.sign("ES256", claims, typ="at+jwt", repeatable=False) for _ in range(3)}
    assert len(once) == 3
    for token in once:
        header, verified = header_and_claims(ring, token)
        assert header["alg"] == "ES256" and verified == claims
    # RS256 signatures are deterministic either way.
    assert ring.sign("RS256", claims, repeatable=False) == ring.sign("RS256", claims)


def _signature(token: str) -> bytes:
    part = token.rpartition(".")[2]
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def test_es256_signatures_are_low_s_whether_repeatable_or_not(tmp_path: Path) -> None:
    # OpenSSL gives a high S half the time: 64 low ones in a row are the signer's doing.
    ring = KeyRing(tmp_path / "keys", RotationPolicy(publish_ahead=60, retain=300))
    ring.load(["ES256"])
    for n in range(32):
        for repeatable in (True, False):
            token = ring.sign("ES256", {"sub": "s", "n": n}, repeatable=repeatable)
            assert is_low_s("ES256", _signature(token))


def test_the_ring_refuses_the_other_spelling_of_its_own_signature(tmp_path: Path) -> None:
    ring = KeyRing(tmp_path / "keys", RotationPolicy(publish_ahead=60, retain=300))
    ring.load(["ES256"])
    token = ring.sign("ES256", {"sub": "s", "aud": "api"}, typ="at+jwt")
    twin = ecdsa_twin(token)
    # A genuine signature of the ring's key (PyJWT alone takes it), in the spelling the
    # ring never signs: refused as a bad signature is.
    assert header_and_claims(ring, twin)[1] == {"sub": "s", "aud": "api"}
    assert ring.verify(token, ["ES256"], audience="api")["sub"] == "s"
    with pytest.raises(jwt.InvalidSignatureError):
        ring.verify(twin, ["ES256"], audience="api")
