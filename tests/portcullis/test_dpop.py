"""The DPoP proof checks of RFC 9449 §4.3 (portcullis/dpop.py), which the gateway and the
authorization server both apply, without a server: each rule with a proof that breaks it,
the htu normalisation of RFC 3986 (with generated URIs), `ath`, the binding, and the
server's nonces. Proofs are signed by the test's own client (tests/dpop_proofs.py)."""

from __future__ import annotations

import hashlib
import hmac
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from portcullis.dpop import (
    ASYMMETRIC_ALGORITHMS,
    MAX_JTI,
    InvalidBinding,
    InvalidProof,
    NonceMaker,
    ProofChecker,
    ProofPolicy,
    UseNonce,
    access_token_hash,
    check_binding,
    normalise_uri,
    remove_dot_segments,
    same_resource,
)
from portcullis.jose import SIGNATURE_ALGORITHMS
from tests.dpop_proofs import REMOVE, DpopKey, token_hash
from tests.support import b64url, compact

URL = "https://api.example.com/orders/1"
TOKEN = "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJ1c2VyIn0.c2lnbmF0dXJl"
POLICY = ProofPolicy(frozenset(ASYMMETRIC_ALGORITHMS), max_age=60.0, leeway=5.0)


@pytest.fixture(scope="module")
def key() -> DpopKey:
    return DpopKey("ES256")


def check(
    proof: str | list[str],
    *,
    method="GET",
    uri=URL,
    token: str | None = TOKEN,
    now=None,
    policy=POLICY,
):
    headers = [proof] if isinstance(proof, str) else proof
    return ProofChecker(policy).check(
        headers,
        method=method,
        uri=uri,
        access_token=token,
        now=time.time() if now is None else now,
    )


def refused(proof: str | list[str], description: str, **request) -> None:
    with pytest.raises(InvalidProof) as caught:
        check(proof, **request)
    assert caught.value.description == description


def test_the_algorithms_are_every_asymmetric_signature_algorithm_and_never_a_mac():
    assert set(ASYMMETRIC_ALGORITHMS) == SIGNATURE_ALGORITHMS
    assert not {"none", "HS256", "HS384", "HS512"} & set(ASYMMETRIC_ALGORITHMS)


@pytest.mark.parametrize("alg", ["ES256", "ES384", "ES512", "RS256", "PS256", "EdDSA"])
def test_a_proof_of_each_algorithm_is_accepted_and_names_its_key(alg):
    client = DpopKey(alg)
    proof = check(client.proof("GET", URL, TOKEN))
    assert proof.jkt == client.jkt
    check_binding(proof, client.jkt)


def test_no_proof_and_two_proofs_are_refused(key):
    refused([], "the request has no DPoP proof")
    one = key.proof("GET", URL, TOKEN)
    refused([one, key.proof("GET", URL, TOKEN)], "the request has more than one DPoP header")


@pytest.mark.parametrize("text", ["", "abc", "a.b", "a.b.c.d", "eyJ.eyJ.sig=", "a b.c.d", "!!.x.y"])
def test_what_is_not_a_compact_jws_is_refused(text):
    refused(text, "the DPoP proof is not a signed JWT")


def test_a_header_that_is_not_json_is_refused():
    refused(
        f"{b64url(b'not json')}.{b64url({})}.{b64url(b'x')}",
        ("the DPoP proof's header is not base64url-encoded JSON"),
    )
    refused(
        f"{b64url(b'[1]')}.{b64url({})}.{b64url(b'x')}",
        ("the DPoP proof's header is not a JSON object"),
    )


@pytest.mark.parametrize("typ", ["JWT", "at+jwt", None, 7, REMOVE])
def test_typ_must_be_dpop_jwt(key, typ):
    refused(
        key.proof("GET", URL, TOKEN, header={"typ": typ}), "the DPoP proof's typ is not dpop+jwt"
    )


def test_typ_is_compared_as_a_media_type(key):
    for typ in ("DPoP+JWT", "application/dpop+jwt"):
        check(key.proof("GET", URL, TOKEN, header={"typ": typ}))


def test_crit_is_refused(key):
    refused(
        key.proof("GET", URL, TOKEN, header={"crit": ["exp"]}),
        "the DPoP proof has critical header parameters",
    )


def test_alg_none_is_refused(key):
    unsigned = key.proof("GET", URL, TOKEN, header={"alg": "none"}, sign_alg="none")
    refused(unsigned, "the DPoP proof is not a signed JWT")
    # With something in the signature's place, the algorithm is what refuses it.
    refused(unsigned + "AAAA", "the DPoP proof's signing algorithm is not accepted")


def test_a_mac_algorithm_is_refused_even_keyed_with_the_public_key(key):
    # The classic confusion: HS256 with the public key's bytes as the secret.
    head = {"typ": "dpop+jwt", "alg": "HS256", "jwk": key.jwk}
    body = {"jti": "j", "htm": "GET", "htu": URL, "iat": int(time.time()), "ath": "x"}
    secret = key.jwk["x"].encode()
    proof = compact(head, body, lambda data: hmac.new(secret, data, hashlib.sha256).digest())
    refused(proof, "the DPoP proof's signing algorithm is not accepted")


def test_a_header_without_alg_is_refused(key):
    refused(
        key.proof("GET", URL, TOKEN, header={"alg": REMOVE}, sign_alg="ES256"),
        "the DPoP proof's signing algorithm is not accepted",
    )


def test_an_algorithm_left_off_the_allow_list_is_refused():
    client = DpopKey("RS256")
    policy = ProofPolicy(frozenset({"ES256"}), 60.0, 5.0)
    refused(
        client.proof("GET", URL, TOKEN),
        "the DPoP proof's signing algorithm is not accepted",
        policy=policy,
    )


def test_the_checker_refuses_to_be_built_with_a_symmetric_algorithm():
    with pytest.raises(ValueError, match="HS256"):
        ProofChecker(ProofPolicy(frozenset({"ES256", "HS256"}), 60.0, 5.0))


def test_a_proof_without_jwk_is_refused(key):
    refused(
        key.proof("GET", URL, TOKEN, header={"jwk": REMOVE}), "the DPoP proof has no jwk header"
    )
    refused(key.proof("GET", URL, TOKEN, header={"jwk": "k"}), "the DPoP proof has no jwk header")


@pytest.mark.parametrize("alg", ["ES256", "RS256", "EdDSA"])
def test_a_private_key_in_jwk_is_refused(alg):
    client = DpopKey(alg)
    from jwt.algorithms import get_default_algorithms

    private_jwk = get_default_algorithms()[alg].to_jwk(client.private, as_dict=True)
    assert "d" in private_jwk
    refused(
        client.proof("GET", URL, TOKEN, header={"jwk": private_jwk}),
        "the DPoP proof's jwk holds a private key",
    )


def test_a_symmetric_jwk_is_refused(key):
    refused(
        key.proof("GET", URL, TOKEN, header={"jwk": {"kty": "oct", "k": "c2VjcmV0"}}),
        "the DPoP proof's jwk holds a private key",
    )


def test_a_key_of_another_type_or_curve_than_alg_needs_is_refused():
    p384 = DpopKey("ES384")
    refused(
        p384.proof("GET", URL, TOKEN, header={"alg": "ES256"}, sign_alg="ES384"),
        "the proof's key is not an EC key on P-256",
    )
    ec = DpopKey("ES256")
    refused(
        ec.proof("GET", URL, TOKEN, header={"alg": "RS256"}, sign_alg="ES256"),
        "the proof's key is not an RSA key",
    )
    refused(
        ec.proof("GET", URL, TOKEN, header={"alg": "EdDSA"}, sign_alg="ES256"),
        "the proof's key is not an Ed25519 or Ed448 key",
    )
    # X25519 is an OKP key too, but for key agreement (RFC 8037 §3.2), never for EdDSA.
    eddsa = DpopKey("EdDSA")
    x25519 = dict(eddsa.jwk, crv="X25519")
    refused(
        eddsa.proof("GET", URL, TOKEN, header={"jwk": x25519}),
        "the proof's key is not an Ed25519 or Ed448 key",
    )


def test_a_jwk_missing_a_member_is_refused(key):
    jwk = dict(key.jwk)
    del jwk["y"]
    refused(
        key.proof("GET", URL, TOKEN, header={"jwk": jwk}),
        "the DPoP proof's jwk is not a valid public key",
    )


def test_a_point_off_the_curve_is_refused(key):
    jwk = dict(key.jwk, y=b64url(b"\x01" * 32))
    refused(
        key.proof("GET", URL, TOKEN, header={"jwk": jwk}),
        "the DPoP proof's jwk is not a valid public key",
    )


def test_a_short_rsa_key_is_refused():
    from cryptography.hazmat.primitives.asymmetric import rsa

    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)  # noqa: S505
    short = DpopKey("RS256", weak)
    refused(short.proof("GET", URL, TOKEN), "the DPoP proof's RSA key is shorter than 2048 bits")


def test_a_proof_signed_by_another_key_than_its_jwk_is_refused(key):
    other = DpopKey("ES256")
    refused(
        other.proof("GET", URL, TOKEN, header={"jwk": key.jwk}),
        "the DPoP proof's signature is invalid",
    )


def test_a_changed_payload_breaks_the_signature(key):
    head, _, signature = key.proof("GET", URL, TOKEN).split(".")
    body = {"jti": "j", "htm": "GET", "htu": URL, "iat": int(time.time()), "ath": "x"}
    refused(f"{head}.{b64url(body)}.{signature}", "the DPoP proof's signature is invalid")


@pytest.mark.parametrize(
    ("claims", "description"),
    [
        ({"jti": REMOVE}, "the DPoP proof has no usable jti"),
        ({"jti": ""}, "the DPoP proof has no usable jti"),
        ({"jti": 12}, "the DPoP proof has no usable jti"),
        ({"jti": "j" * (MAX_JTI + 1)}, "the DPoP proof has no usable jti"),
        ({"jti": "j" * 513}, "the DPoP proof has no usable jti"),
        ({"htm": REMOVE}, "the DPoP proof lacks htm or htu"),
        ({"htu": REMOVE}, "the DPoP proof lacks htm or htu"),
        ({"htu": ["https://api.example.com/orders/1"]}, "the DPoP proof lacks htm or htu"),
        ({"iat": REMOVE}, "the DPoP proof has no numeric iat"),
        ({"iat": "1700000000"}, "the DPoP proof has no numeric iat"),
        ({"iat": True}, "the DPoP proof has no numeric iat"),
        ({"ath": REMOVE}, "the DPoP proof has no ath, the hash of the access token"),
        ({"ath": 1}, "the DPoP proof has no ath, the hash of the access token"),
    ],
)
def test_a_missing_or_mistyped_claim_is_refused(key, claims, description):
    refused(key.proof("GET", URL, TOKEN, **claims), description)


@pytest.mark.parametrize("iat", [float("nan"), float("inf"), float("-inf")])
def test_an_iat_that_is_no_json_number_is_refused(key, iat):
    # Python's json writes NaN and Infinity, which are not JSON (RFC 8259 §6): no time.
    refused(
        key.proof("GET", URL, TOKEN, iat=iat),
        "the DPoP proof's payload is not base64url-encoded JSON",
    )


def test_a_jti_of_the_longest_length_is_accepted(key):
    assert check(key.proof("GET", URL, TOKEN, jti="j" * MAX_JTI)).jti == "j" * MAX_JTI
    assert MAX_JTI == 256


def test_htm_must_be_the_method_in_its_case(key):
    refused(key.proof("POST", URL, TOKEN), "the DPoP proof is for another method")
    refused(key.proof("get", URL, TOKEN), "the DPoP proof is for another method")
    check(key.proof("POST", URL, TOKEN), method="POST")


@pytest.mark.parametrize(
    "htu",
    [
        "https://api.example.com/orders/2",
        "http://api.example.com/orders/1",
        "https://evil.example.com/orders/1",
        "https://api.example.com:8443/orders/1",
        "https://api.example.com/orders/1/",
        "https://api.example.com/Orders/1",
        "/orders/1",
        "https://user@api.example.com/orders/1",
        "https://api.example.com/orders/1/../2",
        "https://api.example.com/orders/%2e%2e/orders/2",
        "https://api.example.com/orders/1\t",
        "https://api.example.com/orders/\n1",
        "https://api.example.com/orders/1\x7f",
        "https://api.example.com/orders/1 ",
        "https://api.example.com/orders/é",
        "not a url",
    ],
)
def test_htu_must_be_the_requests_uri(key, htu):
    refused(key.proof("GET", htu, TOKEN), "the DPoP proof is for another URI")


@pytest.mark.parametrize(
    "htu",
    [
        "https://api.example.com/orders/1?page=2",
        "https://api.example.com/orders/1#top",
        "HTTPS://API.Example.COM/orders/1",
        "https://api.example.com:443/orders/1",
        "https://api.example.com/orders/%31",
        "https://api.example.com/x/../orders/./1",
        "https://api.example.com/./orders/1",
        "https://api.example.com/x/%2e%2e/orders/1",
        "https://api.example.com/%2E%2E/orders/%2e/1",
    ],
)
def test_htu_ignores_query_and_fragment_and_is_normalised(key, htu):
    check(key.proof("GET", htu, TOKEN), uri="https://api.example.com/orders/1?q=other")


def test_iat_older_than_max_age_and_leeway_is_refused(key):
    now = time.time()
    check(key.proof("GET", URL, TOKEN, iat=now - 65), now=now)
    refused(key.proof("GET", URL, TOKEN, iat=now - 65.5), "the DPoP proof is too old", now=now)


def test_iat_in_the_future_beyond_leeway_is_refused(key):
    now = time.time()
    check(key.proof("GET", URL, TOKEN, iat=now + 5), now=now)
    refused(
        key.proof("GET", URL, TOKEN, iat=now + 5.5),
        "the DPoP proof is dated in the future",
        now=now,
    )


def test_ath_must_hash_the_token_presented(key):
    refused(key.proof("GET", URL, "another-token"), "the DPoP proof is for another access token")
    refused(key.proof("GET", URL, TOKEN, ath="x"), "the DPoP proof is for another access token")


def test_ath_is_rfc_9449s_hash_of_the_token():
    # §4.2: base64url of the SHA-256 of the token's ASCII, computed here independently.
    assert access_token_hash(TOKEN) == token_hash(TOKEN)
    assert len(access_token_hash(TOKEN)) == 43


def test_a_proof_without_an_access_token_needs_no_ath(key):
    # At a token endpoint no token is presented yet (§4.3 item 12 applies with one only).
    assert check(key.proof("POST", URL), method="POST", token=None).jkt == key.jkt
    assert check(key.proof("POST", URL, ath="anything"), method="POST", token=None)


def test_a_proof_of_another_key_than_the_tokens_fails_the_binding(key):
    proof = check(key.proof("GET", URL, TOKEN))
    with pytest.raises(InvalidBinding):
        check_binding(proof, DpopKey("ES256").jkt)


def test_proofs_of_one_key_share_a_thumbprint_and_get_distinct_replay_keys(key):
    first, second = check(key.proof("GET", URL, TOKEN)), check(key.proof("GET", URL, TOKEN))
    assert first.jkt == second.jkt
    assert first.replay_key != second.replay_key
    same_jti = [check(key.proof("GET", URL, TOKEN, jti="fixed")) for _ in range(2)]
    assert same_jti[0].replay_key == same_jti[1].replay_key
    other = check(DpopKey("ES256").proof("GET", URL, TOKEN, jti="fixed"))
    assert other.replay_key != same_jti[0].replay_key  # a jti is another key's own


def test_a_proof_is_remembered_until_iat_stops_accepting_it(key):
    now = time.time()
    proof = check(key.proof("GET", URL, TOKEN, iat=now), now=now)
    assert proof.replay_until == pytest.approx(now + 65)


# ---------------------------------------------------------------------------- htu


def test_remove_dot_segments_of_rfc_3986_examples():
    # RFC 3986 §5.2.4's two worked examples.
    assert remove_dot_segments("/a/b/c/./../../g") == "/a/g"
    assert remove_dot_segments("mid/content=5/../6") == "mid/6"


@pytest.mark.parametrize(
    ("uri", "normal"),
    [
        ("HTTP://Example.COM", "http://example.com/"),
        ("http://example.com:80/a", "http://example.com/a"),
        ("https://example.com:443/a", "https://example.com/a"),
        ("https://example.com:8443/a", "https://example.com:8443/a"),
        ("http://example.com:/a", "http://example.com/a"),
        ("http://example.com/%7euser/%2f%41", "http://example.com/~user/%2FA"),
        ("http://[::1]:8080/a/./b/../c", "http://[::1]:8080/a/c"),
        ("http://example.com/a?b#c", "http://example.com/a"),
    ],
)
def test_normalise_uri(uri, normal):
    assert normalise_uri(uri) == normal


@pytest.mark.parametrize(
    "uri",
    [
        "/relative",
        "ftp://example.com/",
        "https://",
        "https://u:p@example.com/",
        "https://a\tb/",
        "https://[::1/",
        "https://example.com:99999/",
        "https://exa mple.com/",
    ],
)
def test_what_normalise_uri_refuses(uri):
    assert normalise_uri(uri) is None


_segment = st.text(alphabet="abcXYZ019-._~%:@!$&'()*+,;=", max_size=8)
_path = st.lists(_segment, max_size=5).map(lambda parts: "/" + "/".join(parts))
_host = st.from_regex(r"[a-z][a-z0-9-]{0,10}(\.[a-z][a-z0-9-]{0,10}){0,2}", fullmatch=True)
_scheme = st.sampled_from(["http", "https"])
_port = st.one_of(st.none(), st.integers(1, 65535))


def _uri(scheme: str, host: str, port: int | None, path: str) -> str:
    return f"{scheme}://{host}{'' if port is None else f':{port}'}{path}"


def _flip_case(text: str) -> str:
    return "".join(c.upper() if i % 2 else c.lower() for i, c in enumerate(text))


@given(_scheme, _host, _port, _path)
def test_normalising_twice_changes_nothing(scheme, host, port, path):
    once = normalise_uri(_uri(scheme, host, port, path))
    if once is not None:
        assert normalise_uri(once) == once


@given(_scheme, _host, _port, _path)
def test_scheme_and_host_case_and_a_default_port_never_change_the_resource(
    scheme, host, port, path
):
    uri = _uri(scheme, host, port, path)
    if normalise_uri(uri) is None:
        return
    assert same_resource(_uri(_flip_case(scheme), _flip_case(host), port, path), uri)
    if port is None:
        default = 80 if scheme == "http" else 443
        assert same_resource(_uri(scheme, host, default, path), uri)


@given(_scheme, _host, _path, st.text(alphabet="abc=&/?", max_size=10))
def test_a_query_never_changes_the_resource(scheme, host, path, query):
    uri = _uri(scheme, host, None, path)
    if normalise_uri(uri) is not None:
        assert same_resource(f"{uri}?{query}", uri)


@given(_scheme, _host, _path, _path)
def test_different_paths_after_normalisation_are_different_resources(scheme, host, a, b):
    first, second = _uri(scheme, host, None, a), _uri(scheme, host, None, b)
    if normalise_uri(first) is None or normalise_uri(second) is None:
        return
    assert same_resource(first, second) == (normalise_uri(first) == normalise_uri(second))


# ---------------------------------------------------------------------------- nonces


def test_a_nonce_is_accepted_for_its_lifetime_and_by_every_maker_with_the_key():
    maker = NonceMaker(b"k" * 32, lifetime=300.0)
    made = 1_000_050.0  # a multiple of 75 s, a quarter of the lifetime: a nonce starts here
    nonce = maker.current(made)
    assert maker.current(made + 74) == nonce, "one nonce for a quarter of the lifetime"
    assert maker.current(made + 75) != nonce
    assert maker.valid(nonce, made)
    assert NonceMaker(b"k" * 32, 300.0).valid(nonce, made + 300)
    assert not maker.valid(nonce, made + 301), "expired"
    assert not maker.valid(nonce, made - 1), "made after now"
    assert not NonceMaker(b"x" * 32, 300.0).valid(nonce, made), "another key's"


@pytest.mark.parametrize(
    "forged", ["", "abc", "A" * 32, "not base64!", "not-base64!", "AAAA", "A" * 35]
)
def test_a_made_up_nonce_is_refused(forged):
    assert not NonceMaker(b"k" * 32, 300.0).valid(forged, 1_000_000.0)


def test_a_nonce_lifetime_shorter_than_four_seconds_is_refused():
    with pytest.raises(ValueError, match="4 seconds"):
        NonceMaker(b"k" * 32, 3.9)


def test_with_nonces_a_proof_must_carry_a_current_one(key):
    maker = NonceMaker(b"k" * 32, 300.0)
    checker = ProofChecker(POLICY, maker)
    now = time.time()

    def run(proof: str) -> None:
        checker.check([proof], method="GET", uri=URL, access_token=TOKEN, now=now)

    for nonce in (REMOVE, "stale", maker.current(now - 400)):
        with pytest.raises(UseNonce):
            run(key.proof("GET", URL, TOKEN, nonce=nonce))
    run(key.proof("GET", URL, TOKEN, nonce=maker.current(now)))


def test_the_nonce_is_checked_before_the_age_of_the_proof(key):
    # §4.3: item 10 (the nonce) before item 11 (iat): a stale proof without a nonce is told
    # the nonce to use, so its client's next proof can pass both.
    maker = NonceMaker(b"k" * 32, 300.0)
    now = time.time()
    with pytest.raises(UseNonce):
        ProofChecker(POLICY, maker).check(
            [key.proof("GET", URL, TOKEN, iat=now - 600)],
            method="GET",
            uri=URL,
            access_token=TOKEN,
            now=now,
        )
