"""The token endpoint in the lane (authserver/lanes.py): a plain token request is answered
there, with the very answer aiohttp's path gives (status, fields in order, body), counted
alike; a request the lane does not take is answered by aiohttp as before."""

from __future__ import annotations

import base64
import json
from typing import Any

import jwt
import pytest

from portcullis.lane import LaneServer
from tests.authserver.conftest import SECRET, RunningAuthServer
from tests.support import RawConnection, RawResponse, raw_request

FORM = "application/x-www-form-urlencoded"
# The same media type with a parameter: aiohttp's path reads it as the form; the lane leaves
# such a request to it.
FORM_WITH_CHARSET = FORM + "; charset=utf-8"


def basic(client_id: str, secret: str) -> str:
    return "Basic " + base64.b64encode(f"{client_id}:{secret}".encode()).decode()


def lane_requests(server: RunningAuthServer) -> int:
    assert isinstance(server.runner.server, LaneServer)
    return server.runner.server.lane_requests


async def exchange(
    server: RunningAuthServer, body: str, *headers: tuple[str, str], content_type: str = FORM
) -> RawResponse:
    data = body.encode()
    request = raw_request(
        "POST",
        "/token",
        [("Content-Type", content_type), ("Content-Length", str(len(data))), *headers],
        data,
        host=server.url.split("://")[1],
    )
    connection = await RawConnection.open(server.url)
    try:
        await connection.send(request)
        return await connection.response()
    finally:
        connection.close()


def comparable(answer: RawResponse) -> tuple[int, list[tuple[str, str]], Any]:
    """Status, fields in order (Date's value aside) and the JSON body, a token's own
    values (its jti, signature, times) aside."""
    fields = [(name, "-" if name == "Date" else value) for name, value in answer.headers.items()]
    body = json.loads(answer.body)
    if "access_token" in body:
        claims = jwt.decode(body.pop("access_token"), options={"verify_signature": False})
        body["claims"] = sorted(claims)
    if "Content-Length" in answer.headers:
        fields = [(n, "-" if n == "Content-Length" else v) for n, v in fields]
    return answer.status, fields, body


CASES = {
    "issued": ("grant_type=client_credentials&scope=orders:read", basic("machine", SECRET)),
    "issued, default scope": ("grant_type=client_credentials", basic("machine", SECRET)),
    "wrong secret": ("grant_type=client_credentials", basic("machine", "wrong")),
    "no grant_type": ("scope=orders:read", basic("machine", SECRET)),
    "unknown grant_type": ("grant_type=password", basic("machine", SECRET)),
    "parameter twice": ("grant_type=client_credentials&scope=a&scope=b", basic("machine", SECRET)),
    "not UTF-8": ("grant_type=client_credentials&scope=%ff", basic("machine", SECRET)),
    "scope not allowed": ("grant_type=client_credentials&scope=openid", basic("machine", SECRET)),
    "secret in the form": (
        f"grant_type=client_credentials&client_id=machine-post&client_secret={SECRET}",
        None,
    ),
    "bad code": ("grant_type=authorization_code&code=nope&client_id=spa", None),
    "bad refresh token": ("grant_type=refresh_token&refresh_token=nope&client_id=spa", None),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_the_lane_answers_as_aiohttps_path_does(
    authserver: RunningAuthServer, case: str
) -> None:
    body, authorization = CASES[case]
    headers = [("Authorization", authorization)] if authorization else []
    before = lane_requests(authserver)
    in_lane = await exchange(authserver, body, *headers)
    assert lane_requests(authserver) == before + 1
    through_aiohttp = await exchange(authserver, body, *headers, content_type=FORM_WITH_CHARSET)
    assert lane_requests(authserver) == before + 1
    assert comparable(in_lane) == comparable(through_aiohttp)


async def test_answers_of_the_lane_are_counted_by_status_as_aiohttps_are(
    authserver: RunningAuthServer,
) -> None:
    requests = authserver.services.token.metrics.requests
    before = dict(requests)
    body, authorization = CASES["issued"]
    await exchange(authserver, body, ("Authorization", authorization))
    await exchange(authserver, body, ("Authorization", basic("machine", "wrong")))
    assert requests.get(("token", 200), 0) == before.get(("token", 200), 0) + 1
    assert requests.get(("token", 401), 0) == before.get(("token", 401), 0) + 1


async def test_a_cross_origin_request_is_left_to_the_cors_middleware(
    authserver: RunningAuthServer,
) -> None:
    before = lane_requests(authserver)
    body, authorization = CASES["issued"]
    answer = await exchange(
        authserver, body, ("Authorization", authorization), ("Origin", "http://127.0.0.1")
    )
    assert answer.status == 200
    assert lane_requests(authserver) == before
    assert answer.headers["Vary"] == "Origin"
