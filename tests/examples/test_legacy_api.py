"""The example orders API on a real socket: the resource conventions it follows.

Requests carry X-Auth-Subject themselves here, as the gateway would set it. Expected
results are worked out from what the API lists, never written in by hand.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDictProxy

from examples.legacy_api import create_app
from tests.support import start_site

ME = "user-123"


@dataclass
class Answer:
    status: int
    headers: CIMultiDictProxy[str]
    raw: bytes

    @property
    def body(self) -> Any:
        assert self.headers.get("Content-Type") == "application/json", self.headers
        return json.loads(self.raw)


@dataclass
class Api:
    client: aiohttp.ClientSession
    url: str

    async def call(
        self,
        method: str,
        path: str,
        *,
        subject: str | None = ME,
        body: Any = None,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        sent = dict(headers or {})
        if subject is not None:
            sent["X-Auth-Subject"] = subject
        if body is not None:
            data = json.dumps(body).encode()
            sent.setdefault("Content-Type", "application/json")
        async with self.client.request(method, self.url + path, data=data, headers=sent) as resp:
            return Answer(resp.status, resp.headers, await resp.read())

    async def everything(self, subject: str = ME, query: str = "") -> list[dict[str, Any]]:
        """All of the caller's orders in one page (the test fails if one page is not enough)."""
        answer = await self.call("GET", f"/orders?limit=100{query}", subject=subject)
        assert answer.status == 200, answer.raw
        assert answer.body["pagination"] == {"nextCursor": None, "hasMore": False}
        data: list[dict[str, Any]] = answer.body["data"]
        return data

    async def walk(
        self, query: str, subject: str = ME, cursor: str | None = None
    ) -> list[list[dict[str, Any]]]:
        """Follow nextCursor from the first page (or `cursor`) until hasMore is false."""
        pages = []
        while True:
            suffix = f"&cursor={cursor}" if cursor else ""
            answer = await self.call("GET", f"/orders?{query}{suffix}", subject=subject)
            assert answer.status == 200, answer.raw
            pagination = answer.body["pagination"]
            pages.append(answer.body["data"])
            assert len(pages) < 100, "paging does not end"
            if not pagination["hasMore"]:
                assert pagination["nextCursor"] is None
                return pages
            assert isinstance(pagination["nextCursor"], str) and pagination["nextCursor"]
            cursor = pagination["nextCursor"]

    async def create(self, subject: str = ME, **fields: Any) -> dict[str, Any]:
        body = {"item": "Ceramic mug", "quantity": 1, "totalCents": 1200, **fields}
        answer = await self.call("POST", "/orders", subject=subject, body=body)
        assert answer.status == 201, answer.raw
        created: dict[str, Any] = answer.body
        return created


@pytest.fixture
async def api(client: aiohttp.ClientSession) -> AsyncIterator[Api]:
    runner, url = await start_site(create_app())
    yield Api(client, url)
    await runner.cleanup()


def assert_error(answer: Answer, status: int, code: str) -> list[tuple[str, str]]:
    """The resource error body with this status and code; returns (field, issue) pairs."""
    assert answer.status == status, answer.raw
    body = answer.body
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"code", "message", "details"}
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    details = []
    for detail in error["details"]:
        assert set(detail) == {"field", "issue"}
        assert isinstance(detail["issue"], str) and detail["issue"]
        details.append((detail["field"], detail["issue"]))
    return details


def ids(orders: list[dict[str, Any]]) -> list[str]:
    return [o["id"] for o in orders]


# ---------------------------------------------------------------------------- paging


async def test_paging_returns_each_of_the_callers_orders_once_until_has_more_is_false(api):
    everything = await api.everything()
    assert len(everything) > 7
    pages = await api.walk("limit=7")
    walked = [order for page in pages for order in page]
    assert all(len(page) == 7 for page in pages[:-1])
    assert 1 <= len(pages[-1]) <= 7
    assert len(pages) == math.ceil(len(everything) / 7)
    assert ids(walked) == ids(everything)
    assert len(set(ids(walked))) == len(walked)
    assert {o["owner"] for o in walked} == {ME}


async def test_paging_keeps_the_requested_filter_and_sort_on_every_page(api):
    query = "&status=delivered&status=paid&sort=-totalCents"
    expected = await api.everything(query=query)
    assert len(expected) > 3
    pages = await api.walk("limit=3" + query)
    assert [o for page in pages for o in page] == expected


async def test_orders_created_while_paging_neither_repeat_nor_push_out_listed_orders(api):
    before = await api.everything()
    first = await api.call("GET", "/orders?limit=5")
    cursor = first.body["pagination"]["nextCursor"]
    for _ in range(3):
        await api.create()
    rest = await api.walk("limit=5", cursor=cursor)
    walked = first.body["data"] + [o for page in rest for o in page]
    assert ids(walked) == ids(before)


async def test_default_page_size_is_20(api):
    for n in range(25):
        await api.create(subject="dave", item=f"Filter pack {n}")
    answer = await api.call("GET", "/orders", subject="dave")
    assert answer.status == 200
    assert len(answer.body["data"]) == 20
    assert answer.body["pagination"]["hasMore"] is True
    assert len(await api.everything(subject="dave")) == 25


@pytest.mark.parametrize("limit", ["0", "101", "-1", "ten", "", "2.5", "%EF%BC%95"])
async def test_limit_outside_1_to_100_is_refused_with_400(api, limit):
    answer = await api.call("GET", f"/orders?limit={limit}")
    assert [field for field, _ in assert_error(answer, 400, "bad_request")] == ["limit"]


@pytest.mark.parametrize("cursor", ["not-a-cursor", "e30", "eyJxIjoxfQ", "%21%21"])
async def test_cursor_not_given_out_by_the_api_is_refused_with_400(api, cursor):
    answer = await api.call("GET", f"/orders?limit=3&cursor={cursor}")
    assert [field for field, _ in assert_error(answer, 400, "bad_request")] == ["cursor"]


async def test_cursor_used_with_another_sort_is_refused_with_400(api):
    first = await api.call("GET", "/orders?limit=3&sort=totalCents")
    cursor = first.body["pagination"]["nextCursor"]
    same = await api.call("GET", f"/orders?limit=3&sort=totalCents&cursor={cursor}")
    assert same.status == 200
    other = await api.call("GET", f"/orders?limit=3&sort=-totalCents&cursor={cursor}")
    assert [field for field, _ in assert_error(other, 400, "bad_request")] == ["cursor"]


# ---------------------------------------------------------------------------- filter, sort, fields


async def test_repeated_status_keys_select_orders_in_any_of_those_statuses(api):
    everything = await api.everything()
    wanted = {"paid", "shipped"}
    expected = [o for o in everything if o["status"] in wanted]
    assert {o["status"] for o in expected} == wanted
    assert len(expected) < len(everything)
    found = await api.everything(query="&status=paid&status=shipped")
    assert found == expected


async def test_unknown_status_is_refused_with_400(api):
    answer = await api.call("GET", "/orders?status=paid&status=lost")
    assert [field for field, _ in assert_error(answer, 400, "bad_request")] == ["status"]


@pytest.mark.parametrize("field", ["totalCents", "createdAt", "item", "status"])
async def test_sort_orders_by_a_field_ascending_and_with_minus_descending(api, field):
    ascending = await api.everything(query=f"&sort={field}")
    descending = await api.everything(query=f"&sort=-{field}")
    values = [o[field] for o in ascending]
    assert values == sorted(values)
    assert len(set(values)) > 1
    assert descending == list(reversed(ascending))
    assert sorted(ids(ascending)) == sorted(ids(await api.everything()))


async def test_sort_by_an_unknown_field_is_refused_with_400(api):
    answer = await api.call("GET", "/orders?sort=-colour")
    assert [field for field, _ in assert_error(answer, 400, "bad_request")] == ["sort"]


async def test_fields_keeps_only_the_named_fields_and_the_id(api):
    everything = {o["id"]: o for o in await api.everything()}
    selected = await api.everything(query="&fields=status,totalCents")
    assert len(selected) == len(everything)
    for order in selected:
        assert set(order) == {"id", "status", "totalCents"}
        full = everything[order["id"]]
        assert (order["status"], order["totalCents"]) == (full["status"], full["totalCents"])

    some_id = next(iter(everything))
    single = await api.call("GET", f"/orders/{some_id}?fields=item")
    assert single.status == 200
    assert single.body == {"id": some_id, "item": everything[some_id]["item"]}


async def test_fields_naming_an_unknown_field_is_refused_with_400(api):
    answer = await api.call("GET", "/orders?fields=id,colour")
    assert [field for field, _ in assert_error(answer, 400, "bad_request")] == ["fields"]


async def test_q_finds_orders_whose_item_contains_the_text_ignoring_case(api):
    everything = await api.everything()
    word = everything[0]["item"].split()[0]
    expected = [o for o in everything if word.casefold() in o["item"].casefold()]
    assert 0 < len(expected) < len(everything)
    found = await api.everything(query=f"&q={word.upper()}")
    assert found == expected


async def test_unknown_query_parameter_is_refused_with_400(api):
    answer = await api.call("GET", "/orders?colour=red")
    assert [field for field, _ in assert_error(answer, 400, "bad_request")] == ["colour"]


# ---------------------------------------------------------------------------- single orders


async def test_create_answers_201_with_location_and_the_caller_as_owner(api):
    answer = await api.call(
        "POST",
        "/orders",
        subject="erin",
        body={"item": "Hand grinder", "quantity": 2, "totalCents": 17800},
    )
    assert answer.status == 201, answer.raw
    created = answer.body
    assert answer.headers["Location"] == f"/orders/{created['id']}"
    assert isinstance(created["id"], str)
    assert created["owner"] == "erin"
    assert created["status"] == "pending"
    assert created["currency"] == "EUR"
    assert (created["item"], created["quantity"], created["totalCents"]) == (
        "Hand grinder",
        2,
        17800,
    )
    for stamp in ("createdAt", "updatedAt"):
        assert created[stamp].endswith("Z")
        datetime.fromisoformat(created[stamp])

    fetched = await api.call("GET", answer.headers["Location"], subject="erin")
    assert fetched.status == 200
    assert fetched.body == created
    assert ids(await api.everything(subject="erin")) == [created["id"]]


async def test_create_with_invalid_fields_is_422_with_a_detail_for_each_field(api):
    before = await api.everything()
    answer = await api.call(
        "POST",
        "/orders",
        body={
            "item": " ",
            "quantity": 0,
            "totalCents": "12",
            "currency": "XYZ",
            "owner": "bob",
            "colour": "red",
        },
    )
    details = assert_error(answer, 422, "validation_error")
    assert {field for field, _ in details} == {
        "item",
        "quantity",
        "totalCents",
        "currency",
        "owner",
        "colour",
    }
    assert await api.everything() == before


async def test_create_without_required_fields_names_each_missing_one(api):
    answer = await api.call("POST", "/orders", body={"currency": "USD"})
    details = assert_error(answer, 422, "validation_error")
    assert {field for field, _ in details} == {"item", "quantity", "totalCents"}


@pytest.mark.parametrize("payload", [b'{"item": "Mug",', b"\xff\xfe", b""])
async def test_malformed_json_is_400_and_creates_nothing(api, payload):
    before = await api.everything()
    answer = await api.call(
        "POST", "/orders", data=payload, headers={"Content-Type": "application/json"}
    )
    assert [field for field, _ in assert_error(answer, 400, "bad_request")] == ["body"]
    assert await api.everything() == before


async def test_json_that_is_not_an_object_is_422(api):
    answer = await api.call("POST", "/orders", body=[{"item": "Mug"}])
    assert [field for field, _ in assert_error(answer, 422, "validation_error")] == ["body"]


async def test_body_that_is_not_json_is_415(api):
    answer = await api.call(
        "POST",
        "/orders",
        data=b"item=Mug",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert_error(answer, 415, "unsupported_media_type")


async def test_single_order_has_an_etag_and_a_matching_if_none_match_gets_304(api):
    order = await api.create()
    path = f"/orders/{order['id']}"
    first = await api.call("GET", path)
    assert first.status == 200
    etag = first.headers["ETag"]
    assert etag.startswith('"') and etag.endswith('"')
    assert first.headers["Cache-Control"] == "private, no-cache"

    for condition in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        again = await api.call("GET", path, headers={"If-None-Match": condition})
        assert again.status == 304, condition
        assert again.raw == b""
        assert again.headers["ETag"] == etag

    other = await api.call("GET", path, headers={"If-None-Match": '"something-else"'})
    assert other.status == 200
    assert other.body == first.body

    replaced = await api.call("PUT", path, body={**first.body, "quantity": 3})
    assert replaced.status == 200
    stale = await api.call("GET", path, headers={"If-None-Match": etag})
    assert stale.status == 200
    assert stale.headers["ETag"] != etag
    assert stale.body["quantity"] == 3


async def test_put_replaces_every_writable_field(api):
    order = await api.create()
    path = f"/orders/{order['id']}"
    new = {
        "item": "Milk frother",
        "quantity": 4,
        "totalCents": 13600,
        "currency": "GBP",
        "status": "paid",
    }
    answer = await api.call("PUT", path, body=new)
    assert answer.status == 200, answer.raw
    assert {k: answer.body[k] for k in new} == new
    assert (answer.body["id"], answer.body["owner"], answer.body["createdAt"]) == (
        order["id"],
        ME,
        order["createdAt"],
    )
    assert answer.body["updatedAt"] >= order["updatedAt"]
    assert (await api.call("GET", path)).body == answer.body


async def test_put_must_give_every_writable_field_and_may_not_change_read_only_ones(api):
    order = await api.create()
    answer = await api.call(
        "PUT", f"/orders/{order['id']}", body={"item": "Mug", "owner": "bob", "id": order["id"]}
    )
    details = assert_error(answer, 422, "validation_error")
    assert {field for field, _ in details} == {
        "owner",
        "quantity",
        "totalCents",
        "currency",
        "status",
    }
    unchanged = await api.call("GET", f"/orders/{order['id']}")
    assert unchanged.body == order


async def test_status_change_outside_the_lifecycle_is_409(api):
    order = await api.create()
    path = f"/orders/{order['id']}"
    skip = await api.call("PUT", path, body={**order, "status": "delivered"})
    assert [field for field, _ in assert_error(skip, 409, "conflict")] == ["status"]
    paid = await api.call("PUT", path, body={**order, "status": "paid"})
    assert paid.status == 200
    back = await api.call("PUT", path, body={**paid.body, "status": "pending"})
    assert [field for field, _ in assert_error(back, 409, "conflict")] == ["status"]
    edit = await api.call("PUT", path, body={**paid.body, "quantity": 9})
    assert [field for field, _ in assert_error(edit, 409, "conflict")] == ["quantity"]
    assert (await api.call("GET", path)).body == paid.body


async def test_delete_answers_204_and_the_order_is_gone(api):
    order = await api.create()
    path = f"/orders/{order['id']}"
    answer = await api.call("DELETE", path)
    assert answer.status == 204
    assert answer.raw == b""
    assert_error(await api.call("GET", path), 404, "not_found")
    assert_error(await api.call("DELETE", path), 404, "not_found")
    assert order["id"] not in ids(await api.everything())


async def test_deleting_a_shipped_order_is_409_and_keeps_it(api):
    shipped = next(o for o in await api.everything() if o["status"] == "shipped")
    answer = await api.call("DELETE", f"/orders/{shipped['id']}")
    assert [field for field, _ in assert_error(answer, 409, "conflict")] == ["status"]
    assert (await api.call("GET", f"/orders/{shipped['id']}")).body == shipped


async def test_unknown_order_is_404(api):
    assert_error(await api.call("GET", "/orders/ord_9999"), 404, "not_found")
    assert_error(await api.call("PUT", "/orders/ord_9999", body={}), 404, "not_found")


async def test_another_owners_order_is_404_and_left_alone(api):
    # A pending order: one its owner could change or delete, so only ownership stops us.
    target = next(o for o in await api.everything(subject="bob") if o["status"] == "pending")
    path = f"/orders/{target['id']}"
    assert_error(await api.call("GET", path), 404, "not_found")
    assert_error(await api.call("PUT", path, body={**target, "quantity": 9}), 404, "not_found")
    assert_error(await api.call("DELETE", path), 404, "not_found")
    assert target["id"] not in ids(await api.everything())
    assert (await api.call("GET", path, subject="bob")).body == target


# ---------------------------------------------------------------------------- HTTP conventions


@pytest.mark.parametrize(
    "accept",
    [
        "text/html",
        "application/xml",
        "*/*;q=0",
        "text/html, application/json;q=0",
        "*/*, application/json;q=0",
    ],
)
async def test_accept_that_excludes_json_is_406(api, accept):
    for path in ("/orders", "/me", "/healthz"):
        answer = await api.call("GET", path, headers={"Accept": accept})
        assert_error(answer, 406, "not_acceptable")


@pytest.mark.parametrize(
    "accept", ["application/json", "*/*", "application/*", "text/html, application/json;q=0.5"]
)
async def test_accept_that_allows_json_is_served_json(api, accept):
    answer = await api.call("GET", "/orders?limit=1", headers={"Accept": accept})
    assert answer.status == 200
    assert answer.headers["Content-Type"] == "application/json"
    assert len(answer.body["data"]) == 1


async def test_request_without_a_subject_is_401_and_reveals_nothing(api):
    for method, path in (("GET", "/me"), ("GET", "/orders"), ("GET", "/orders/ord_0001")):
        answer = await api.call(method, path, subject=None)
        details = assert_error(answer, 401, "unauthenticated")
        assert details == [("X-Auth-Subject", "is missing")]
        assert answer.headers["WWW-Authenticate"].startswith("Bearer ")
    refused = await api.call("POST", "/orders", subject=None, body={"item": "Mug"})
    assert_error(refused, 401, "unauthenticated")


async def test_me_reports_the_identity_the_headers_give(api):
    answer = await api.call(
        "GET",
        "/me",
        subject="alice",
        headers={"X-Auth-Client-Id": "webapp", "X-Auth-Scopes": "orders:read profile"},
    )
    assert answer.status == 200
    assert answer.body == {
        "subject": "alice",
        "clientId": "webapp",
        "scopes": ["orders:read", "profile"],
    }
    assert answer.headers["Cache-Control"] == "no-store"


async def test_healthz_needs_no_identity(api):
    answer = await api.call("GET", "/healthz", subject=None)
    assert answer.status == 200
    assert answer.body == {"status": "ok"}


async def test_unknown_path_is_404_and_unsupported_method_is_405_as_error_bodies(api):
    assert_error(await api.call("GET", "/customers"), 404, "not_found")
    answer = await api.call("PATCH", "/orders/ord_0001", body={"quantity": 2})
    assert_error(answer, 405, "method_not_allowed")
    assert set(answer.headers["Allow"].split(", ")) >= {"GET", "PUT", "DELETE"}
