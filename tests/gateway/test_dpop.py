"""The gateway's own part of DPoP (gateway/core/dpop.py): the memory replay cache, which
accepts a proof once while it lives and refuses rather than forgets. The proof checks are
the kernel's, tested in tests/portcullis/test_dpop.py, and through a running gateway in
test_dpop_gateway.py."""

from __future__ import annotations

import pytest

from gateway.core.dpop import MemoryReplayCache, ReplayCacheUnavailable


async def test_memory_replay_cache_accepts_a_key_once_until_it_expires():
    cache = MemoryReplayCache(10)
    assert cache.first_use_now(b"a", until=100.0, now=0.0) is True
    assert cache.first_use_now(b"a", until=100.0, now=50.0) is False
    assert await cache.first_use(b"a", until=100.0, now=99.0) is False
    assert cache.first_use_now(b"a", until=200.0, now=100.0) is True  # expired: new again


def test_memory_replay_cache_refuses_rather_than_forget_a_live_entry():
    cache = MemoryReplayCache(2)
    assert cache.first_use_now(b"a", 100.0, 0.0)
    assert cache.first_use_now(b"b", 100.0, 0.0)
    with pytest.raises(ReplayCacheUnavailable):
        cache.first_use_now(b"c", 100.0, 1.0)
    assert cache.full == 1
    assert cache.first_use_now(b"a", 100.0, 1.0) is False, "a is still remembered"
    # Once the first ones expire there is room again, and the expired ones are gone.
    assert cache.first_use_now(b"c", 200.0, 100.0)
    assert len(cache) == 1


def test_memory_replay_cache_full_makes_room_of_entries_expired_behind_a_live_one():
    # Entries do not expire in the order they came: a proof whose iat is older than the last
    # one's expires first. A full cache drops every expired entry before refusing.
    cache = MemoryReplayCache(2)
    assert cache.first_use_now(b"fresh", 100.0, 0.0)
    assert cache.first_use_now(b"old", 10.0, 0.0)
    assert cache.first_use_now(b"next", 150.0, 50.0)
    assert cache.full == 0
    assert cache.first_use_now(b"fresh", 100.0, 50.0) is False, "a live entry is kept"
    with pytest.raises(ReplayCacheUnavailable):
        cache.first_use_now(b"more", 150.0, 50.0)


def test_the_request_path_checks_proofs_with_the_kernels_code():
    # One implementation of RFC 9449 for both services (portcullis/dpop.py).
    from gateway.core import dpop
    from portcullis import dpop as kernel

    for name in ("ProofChecker", "ProofPolicy", "NonceMaker", "check_binding", "UseNonce"):
        assert getattr(dpop, name) is getattr(kernel, name)
    assert dpop.InvalidProof is kernel.InvalidProof
    assert dpop.InvalidBinding is kernel.InvalidBinding
