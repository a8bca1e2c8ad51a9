"""Token signatures are checked together at the end of a turn of the event loop: each caller
gets the verdict its own signature earns, whatever else is in the batch."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from gateway.verifiers.signatures import SignatureBatch
from portcullis.jose import verify_signature
from tests.support import assert_invalid_token, call, gateway_yaml, running_gateway


def es256(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    """A JWS ES256 signature (R and S, 32 bytes each) of `data`."""
    r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


KEY = ec.generate_private_key(ec.SECP256R1())
OTHER = ec.generate_private_key(ec.SECP256R1())


async def test_the_checks_of_one_turn_run_as_one_batch_each_with_its_own_verdict():
    batch = SignatureBatch()
    public = KEY.public_key()
    cases = []
    for n in range(12):
        data = f"payload {n}".encode()
        signed_by = KEY if n % 3 else OTHER  # every third signed by a key not checked against
        signature = es256(signed_by, data)
        if n % 4 == 1:
            data += b"!"  # tampered after signing
        cases.append((data, signature, verify_signature("ES256", public, data, signature)))
    futures = [batch.verify("ES256", public, data, signature) for data, signature, _ in cases]
    assert batch.batches == 0  # nothing checked before the turn ends
    verdicts = await asyncio.gather(*futures)
    assert verdicts == [expected for _, _, expected in cases]
    assert True in verdicts and False in verdicts
    assert batch.batches == 1

    # The next turn's checks are a batch of their own.
    data = b"later"
    assert await batch.verify("ES256", public, data, es256(KEY, data)) is True
    assert batch.batches == 2


async def test_a_caller_that_stops_waiting_is_skipped_and_the_others_are_answered():
    batch = SignatureBatch()
    public = KEY.public_key()
    data = b"payload"
    signature = es256(KEY, data)
    gone = asyncio.ensure_future(batch.verify("ES256", public, data, signature))
    kept = batch.verify("ES256", public, data, signature)
    gone.cancel()
    assert await kept is True
    with pytest.raises(asyncio.CancelledError):
        await gone


async def test_a_check_that_fails_fails_for_its_own_caller_alone():
    batch = SignatureBatch()
    public = KEY.public_key()
    data = b"payload"
    broken = batch.verify("none", public, data, b"")  # no such algorithm: KeyError
    good = batch.verify("ES256", public, data, es256(KEY, data))
    with pytest.raises(KeyError):
        await broken
    assert await good is True


async def test_fresh_tokens_arriving_together_each_get_their_own_answer(issuer, upstream):
    """Through the gateway, with the cache off: valid, tampered and foreign tokens sent at
    once are verified in shared batches and answered each as alone."""
    config = gateway_yaml(issuer.url, upstream.url, extra="token_cache_size: 0")
    async with running_gateway(config) as gateway, aiohttp.ClientSession() as client:
        valid = [issuer.token("ES256", sub=f"user-{n}") for n in range(20)]
        tampered = []
        for token in valid[:9]:
            header, payload, _ = token.split(".")
            # Another token's signature: well-formed, but not of this header and payload.
            tampered.append(f"{header}.{payload}.{valid[19].split('.')[2]}")
        answers = await asyncio.gather(
            *(call(client, gateway.url + "/orders/1", token) for token in valid + tampered)
        )
        for n, answer in enumerate(answers[:20]):
            assert answer.status == 200, n
        for answer in answers[20:]:
            assert_invalid_token(answer, "the token signature is invalid")
        assert len(upstream.requests) == 20
