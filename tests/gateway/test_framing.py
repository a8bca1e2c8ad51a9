"""Framing between client, gateway and upstream: what the upstream reads is what the gateway
admitted, byte for byte, and what the client reads is the answer to its own request.

The upstream records every connection's bytes and reads them with h11 (framing_support), a
parser that shares no code with the gateway's. The attacks are the request-smuggling forms
of a content coding decoded under the client's framing, an answer merged with bytes that
follow it, and request lines and transfer codings the gateway would pass on as something
else; a property test then runs generated sequences of requests through the gateway.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import os
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.framing_support import RecordingUpstream, Seen
from tests.hypothesis_profiles import examples
from tests.support import (
    UNBOUND_ADMIN_LISTEN,
    UNBOUND_LISTEN,
    Background,
    RawConnection,
    RawResponse,
    RunningGateway,
    TestIssuer,
    issuer_entry,
    raw_request,
    refused_exchange,
    start_gateway,
)

BUFFER = 1024  # forward.buffer_size here: bodies on either side of it take different paths
SMALL_LIMIT = 4 * BUFFER
IDENTITY = ("x-auth-subject", "x-auth-client-id", "x-auth-scopes", "x-auth-issuer")
SMUGGLED = (
    b"GET /admin/smuggled HTTP/1.1\r\nHost: upstream\r\nX-Auth-Subject: admin\r\n"
    b"Content-Length: 0\r\n\r\n"
)
# A request left incomplete: whatever the upstream reads next on the connection is its body.
CAPTURING = b"POST /admin/capture HTTP/1.1\r\nHost: upstream\r\nContent-Length: 700\r\n\r\n"


def config(issuer: str, upstream: str) -> str:
    return f"""
listen: "{UNBOUND_LISTEN}"
admin_listen: "{UNBOUND_ADMIN_LISTEN}"
upstream: {{url: "{upstream}", connect_timeout: 1s, read_timeout: 500ms, max_connections: 4}}
forward: {{buffer_size: {BUFFER}}}
issuers:
{issuer_entry(issuer)}
jwks: {{refetch_cooldown: 30s}}
routes:
  - {{name: public, path: "/public/**", auth: none}}
  - {{name: small, path: "/small/**", auth: none, max_body_size: {SMALL_LIMIT}}}
  - {{name: things, path: "/things/**"}}
"""


@dataclass
class Setup:
    issuer: TestIssuer
    upstream: RecordingUpstream
    gateway: RunningGateway


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    issuer = TestIssuer()
    issuer.add_key("ES256")
    await issuer.start()
    upstream = RecordingUpstream()
    await upstream.start()
    gateway = await start_gateway(config(issuer.url, upstream.url))
    try:
        yield Setup(issuer, upstream, gateway)
    finally:
        await gateway.stop()
        await upstream.stop()
        await issuer.stop()


def smuggling_body(coding: str, size: int) -> tuple[bytes, bytes]:
    """A coded body whose decoding holds, past the coded length, a run of CRLFs and a
    request of the attacker's; (coded, decoded)."""
    filler = os.urandom(size)  # random bytes: the coded form is about as long
    decoded = filler + b"\r\n" * (size // 2 + 64) + SMUGGLED
    coded = gzip.compress(decoded) if coding == "gzip" else zlib.compress(decoded)
    assert len(coded) < len(decoded) - len(SMUGGLED)
    return coded, decoded


def assert_only(upstream: RecordingUpstream, targets: list[str]) -> list[Seen]:
    """The upstream read exactly these requests, as HTTP/1.1 with no framing fault."""
    assert upstream.errors == []
    seen = upstream.requests
    assert [r.target for r in seen] == targets
    assert all(r.complete for r in seen)
    return seen


# ---------------------------------------------------------------------------- content codings


@pytest.mark.parametrize("method", ["POST", "PUT"])
@pytest.mark.parametrize("coding", ["gzip", "deflate"])
@pytest.mark.parametrize("size", [BUFFER // 4, 3 * BUFFER], ids=["in-buffer", "streamed"])
async def test_a_content_coded_body_goes_upstream_as_sent_and_smuggles_no_request(
    setup, method, coding, size
):
    coded, _ = smuggling_body(coding, size)
    connection = await RawConnection.open(setup.gateway.url)
    try:
        await connection.send(
            raw_request(
                method,
                "/public/upload",
                [("Content-Encoding", coding), ("Content-Length", str(len(coded)))],
                coded,
            )
        )
        answer = await connection.response()
    finally:
        connection.close()
    assert answer.status == 200, answer.body
    (seen,) = assert_only(setup.upstream, ["/public/upload"])
    assert seen.body == coded  # byte for byte: the coding is the upstream's to undo
    assert seen.header("content-length") == [str(len(coded))]
    assert seen.header("content-encoding") == [coding]
    assert seen.header("x-auth-subject") == []
    assert answer.json()["sha256"] == hashlib.sha256(coded).hexdigest()


async def test_a_chunked_content_coded_body_goes_upstream_as_sent(setup):
    coded, _ = smuggling_body("gzip", 3 * BUFFER)
    chunks = [coded[i : i + 700] for i in range(0, len(coded), 700)]
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    answer = await _exchange(
        setup,
        raw_request(
            "POST",
            "/public/upload",
            [("Content-Encoding", "gzip"), ("Transfer-Encoding", "chunked")],
            body,
        ),
    )
    assert answer.status == 200
    (seen,) = assert_only(setup.upstream, ["/public/upload"])
    assert seen.body == coded


async def test_a_smuggled_incomplete_request_cannot_capture_the_next_clients_request(setup):
    filler = os.urandom(3 * BUFFER)
    decoded = filler + b"\r\n" * (2 * BUFFER) + CAPTURING
    coded = gzip.compress(decoded)
    attacker = await _exchange(
        setup,
        raw_request(
            "POST",
            "/public/upload",
            [("Content-Encoding", "gzip"), ("Content-Length", str(len(coded)))],
            coded,
        ),
    )
    assert attacker.status == 200
    token = setup.issuer.token(sub="victim")
    victim = await _exchange(
        setup,
        raw_request(
            "GET",
            "/things/mine",
            [("Authorization", f"Bearer {token}"), ("X-Marker", "victim")],
        ),
    )
    assert victim.status == 200
    assert victim.json()["marker"] == "victim"
    assert victim.json()["target"] == "/things/mine"
    _, seen = assert_only(setup.upstream, ["/public/upload", "/things/mine"])
    assert seen.header("x-auth-subject") == ["victim"]
    assert all(token.encode() not in r.body for r in setup.upstream.requests)


async def test_the_body_size_limit_counts_the_bytes_sent_not_what_they_decode_to(setup):
    # 100 KiB of zeros codes to about 100 bytes: under the limit as sent.
    coded = gzip.compress(bytes(100 * 1024))
    answer = await _exchange(
        setup,
        raw_request(
            "POST",
            "/small/upload",
            [("Content-Encoding", "gzip"), ("Content-Length", str(len(coded)))],
            coded,
        ),
    )
    assert answer.status == 200
    (seen,) = assert_only(setup.upstream, ["/small/upload"])
    assert seen.body == coded
    # And coded bytes over it are refused whatever they decode to.
    big = os.urandom(SMALL_LIMIT + 1)
    answer = await _exchange(
        setup,
        raw_request(
            "POST",
            "/small/upload",
            [("Content-Encoding", "gzip"), ("Transfer-Encoding", "chunked")],
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big),
        ),
    )
    assert answer.status == 413


# ---------------------------------------------------------------------------- the upstream's answer


async def test_bytes_after_the_upstreams_answer_are_no_part_of_it_and_end_the_connection(setup):
    first = await _exchange(
        setup, raw_request("GET", "/public/first", [("X-Answer", "extra"), ("X-Marker", "1")])
    )
    assert first.status == 200
    assert first.json()["marker"] == "1"
    assert "Location" not in first.headers and "Set-Cookie" not in first.headers
    assert first.headers.getall("Content-Type") == ["application/json"]
    second = await _exchange(setup, raw_request("GET", "/public/second", [("X-Marker", "2")]))
    assert (second.status, second.json()["marker"]) == (200, "2")
    # The second went on a connection of its own: the first was closed, not reused.
    assert [len(c.requests) for c in setup.upstream.connections] == [1, 1]
    assert_only(setup.upstream, ["/public/first", "/public/second"])


# ---------------------------------------------------------------------------- request lines


@pytest.mark.parametrize(
    ("line", "status"),
    [
        (b"GET /public/x\r\n\r\n", 400),
        (b"GET /public/x HTTP/2.0\r\nHost: gateway.test\r\n\r\n", 505),
    ],
    ids=["http-0.9", "http-2.0"],
)
async def test_a_request_line_in_a_version_not_served_is_refused_in_http_1_1(setup, line, status):
    answer = await refused_exchange(setup.gateway.url, line)
    assert (answer.version, answer.status) == ("HTTP/1.1", status)
    assert setup.upstream.requests == []


@pytest.mark.parametrize(
    ("version", "codings", "status"),
    [
        ("1.1", "gzip, chunked", 501),
        ("1.1", "deflate,chunked", 501),
        ("1.0", "chunked", 400),
    ],
)
async def test_transfer_codings_but_chunked_alone_are_refused(setup, version, codings, status):
    coded = gzip.compress(b"hello")
    request = (
        f"POST /public/x HTTP/{version}\r\nHost: gateway.test\r\n"
        f"Transfer-Encoding: {codings}\r\n\r\n"
    ).encode() + b"%x\r\n%s\r\n0\r\n\r\n" % (len(coded), coded)
    connection = await RawConnection.open(setup.gateway.url)
    try:
        await connection.send(request)
        answer = await connection.response()
        assert await connection.closed_by_peer()
    finally:
        connection.close()
    assert answer.status == status
    assert setup.upstream.requests == []


async def _exchange(setup: Setup, request: bytes) -> RawResponse:
    connection = await RawConnection.open(setup.gateway.url)
    try:
        await connection.send(request)
        return await connection.response()
    finally:
        connection.close()


# ---------------------------------------------------------------------------- the property

# A gateway, its issuer and the recording upstream on an event loop of their own, for the
# whole module: hypothesis runs its examples one after another against the same processes.


@pytest.fixture(scope="module")
def background() -> Iterator[tuple[Background, Setup]]:
    runner = Background()

    async def start() -> Setup:
        issuer = TestIssuer()
        issuer.add_key("ES256")
        await issuer.start()
        upstream = RecordingUpstream()
        await upstream.start()
        return Setup(issuer, upstream, await start_gateway(config(issuer.url, upstream.url)))

    async def stop(setup: Setup) -> None:
        await setup.gateway.stop()
        await setup.upstream.stop()
        await setup.issuer.stop()

    setup = runner.run(start())
    try:
        yield runner, setup
    finally:
        runner.run(stop(setup))
        runner.close()


@dataclass(frozen=True)
class Spec:
    """One request of a generated sequence."""

    method: str
    route: str  # public | small | things (a token needed)
    body: bytes | None
    chunked: tuple[int, ...] | None  # chunk sizes, when sent chunked
    coding: str | None  # a Content-Encoding label (the body is coded when it is gzip/deflate)
    spoof: bool  # the client sends identity headers of its own
    answer: str  # echo | extra | early | silent

    def expected(self) -> int | None:
        """The status the gateway must give, None when more than one is right."""
        if self.route == "small" and self.body is not None and len(self.body) > SMALL_LIMIT:
            return 413
        if self.answer == "silent":
            return 504
        if self.answer == "early":
            return None  # 200 (the early answer) or 502 (the upstream reset mid-body)
        return 200

    @property
    def admitted(self) -> bool:
        return self.expected() != 413


SIZES = st.sampled_from([0, 1, BUFFER - 1, BUFFER, BUFFER + 1, 3 * BUFFER + 7]) | st.integers(
    0, 5 * BUFFER
)


@st.composite
def specs(draw: Any, last: bool) -> Spec:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE"]))
    has_body = method != "GET" and draw(st.booleans())
    coding = draw(st.sampled_from([None, "gzip", "deflate", "br"]))
    body = None
    if has_body:
        size = draw(SIZES)
        if coding in ("gzip", "deflate"):
            raw = os.urandom(size) + b"\r\n" * draw(st.integers(0, BUFFER)) + SMUGGLED
            body = gzip.compress(raw) if coding == "gzip" else zlib.compress(raw)
        else:
            body = os.urandom(size)
    chunked = None
    if body is not None and draw(st.booleans()):
        chunked = tuple(draw(st.lists(st.integers(1, 2 * BUFFER), min_size=1, max_size=6)))
    answers = ["echo", "extra"] + (["early", "silent"] if last else [])
    answer = draw(st.sampled_from(answers))
    if answer == "early" and body is None:
        answer = "echo"
    return Spec(
        method,
        draw(st.sampled_from(["public", "small", "things"])),
        body,
        chunked,
        coding,
        draw(st.booleans()),
        answer,
    )


@st.composite
def sequences(draw: Any) -> tuple[list[Spec], bool]:
    count = draw(st.integers(1, 5))
    sequence = [draw(specs(last=i == count - 1)) for i in range(count)]
    return sequence, draw(st.booleans())  # pipelined, or one at a time


def encode(spec: Spec, marker: str, token: str) -> bytes:
    headers = [("X-Marker", marker), ("X-Answer", spec.answer)]
    if spec.route == "things":
        headers.append(("Authorization", f"Bearer {token}"))
    if spec.spoof:
        headers += [("X-Auth-Subject", "admin"), ("X_Auth_Subject", "admin")]
    if spec.coding is not None:
        headers.append(("Content-Encoding", spec.coding))
    body = b""
    if spec.body is not None:
        if spec.chunked is None:
            headers.append(("Content-Length", str(len(spec.body))))
            body = spec.body
        else:
            parts, rest, sizes = [], spec.body, list(spec.chunked)
            while rest:
                size = sizes.pop(0) if sizes else len(rest)
                parts.append(b"%x\r\n%s\r\n" % (len(rest[:size]), rest[:size]))
                rest = rest[size:]
            headers.append(("Transfer-Encoding", "chunked"))
            body = b"".join(parts) + b"0\r\n\r\n"
    return raw_request(spec.method, f"/{spec.route}/{marker}", headers, body)


async def run_sequence(setup: Setup, sequence: list[Spec], pipelined: bool) -> list[Any]:
    """Send the sequence on one client connection; the answers (None where the connection
    ended before one came, which only a refusal that closes it may do)."""
    token = setup.issuer.token(sub="subject-of-token", client_id="client-of-token")
    markers = [os.urandom(6).hex() for _ in sequence]
    requests = [encode(spec, marker, token) for spec, marker in zip(sequence, markers, strict=True)]
    connection = await RawConnection.open(setup.gateway.url)
    answers: list[Any] = []
    try:
        if pipelined:
            await connection.send(b"".join(requests))
        for request in requests:
            if not pipelined:
                await connection.send(request)
            try:
                answers.append(await connection.response(timeout=10))
            except (asyncio.IncompleteReadError, ConnectionError):
                answers.append(None)
                break
            if answers[-1].headers.get("Connection", "").lower() == "close":
                break
    finally:
        connection.close()
    return [markers, answers]


def check_sequence(setup: Setup, sequence: list[Spec], markers: list[str], answers: list[Any]):
    upstream = setup.upstream
    assert upstream.errors == [], "the upstream read bytes that are not HTTP/1.1"
    answered = sequence[: len(answers)]
    # Every request was answered, unless a refusal before it closed the connection.
    for index, answer in enumerate(answers):
        spec, marker = sequence[index], markers[index]
        assert answer is not None, f"no answer to request {index}"
        expected = spec.expected()
        if expected is None:
            assert answer.status in (200, 502)
        else:
            assert answer.status == expected, (spec, answer.status, answer.body[:200])
        assert "Set-Cookie" not in answer.headers and "Location" not in answer.headers
        if answer.status == 200 and spec.answer in ("echo", "extra"):
            echoed = answer.json()
            assert echoed["marker"] == marker  # the client's own answer
            assert echoed["sha256"] == hashlib.sha256(spec.body or b"").hexdigest()
            assert answer.headers.getall("Content-Type") == ["application/json"]
    if len(answers) < len(sequence):
        # Only an answer that closes the connection may leave requests after it unanswered.
        assert answers and answers[-1] is not None
        assert answers[-1].headers.get("Connection", "").lower() == "close"
    # The upstream read exactly the admitted requests, in order, as they were sent.
    admitted = [(s, m) for s, m in zip(answered, markers, strict=False) if s.admitted]
    seen = upstream.requests
    assert [r.header("x-marker") for r in seen] == [[m] for _, m in admitted]
    for (spec, _), request in zip(admitted, seen, strict=True):
        assert request.method == spec.method
        if spec.answer != "early":
            assert request.complete
            assert request.body == (spec.body or b"")
        assert request.header("content-encoding") == ([spec.coding] if spec.coding else [])
        subject = ["subject-of-token"] if spec.route == "things" else []
        assert request.header("x-auth-subject") == subject
        assert request.header("x_auth_subject") == []
        for name in IDENTITY[1:]:
            assert len(request.header(name)) == (1 if spec.route == "things" else 0)
    assert not any(r.target.startswith("/admin") for r in seen)


def framing_property(background: tuple[Background, Setup], case: Any) -> None:
    runner, setup = background
    sequence, pipelined = case
    setup.upstream.clear()
    markers, answers = runner.run(run_sequence(setup, sequence, pipelined))
    runner.run(_settle())
    check_sequence(setup, sequence, markers, answers)


PROPERTY_SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}


@settings(max_examples=examples(40), **PROPERTY_SETTINGS)
@given(case=sequences())
def test_the_upstream_reads_exactly_the_admitted_requests_and_each_client_its_own_answer(
    background, case
):
    framing_property(background, case)


@pytest.mark.long
@settings(max_examples=1000, **PROPERTY_SETTINGS)
@given(case=sequences())
def test_the_framing_property_over_many_more_sequences(background, case):
    framing_property(background, case)


async def _settle() -> None:
    """Let the upstream's readers take in what has already arrived."""
    for _ in range(3):
        await asyncio.sleep(0)
