"""The admin API's collection machinery and validation adapter, without a server."""

from __future__ import annotations

from typing import Any

import pytest
from multidict import MultiDict

from authserver.admin import validation
from authserver.admin.collection import MAX_LIMIT, Collection, page, parse_query
from authserver.admin.http import ApiError, merge_patch
from authserver.admin.users import new_user_id
from authserver.declarations import DeclaredClient

PEOPLE = Collection(
    key="id",
    fields=("id", "name", "age", "admin", "tags"),
    filters=frozenset({"name", "admin", "tags"}),
    sortable=frozenset({"id", "name", "age"}),
    search=("name",),
)


def people() -> list[dict[str, Any]]:
    return [
        {"id": "1", "name": "Ada", "age": 36, "admin": True, "tags": ["math"]},
        {"id": "2", "name": "Bob", "age": None, "admin": False, "tags": []},
        {"id": "3", "name": "Cy", "age": 36, "admin": False, "tags": ["math", "art"]},
        {"id": "4", "name": "Di", "age": 20, "admin": True, "tags": ["art"]},
    ]


def query(**params: Any) -> Any:
    items = [
        (k, v)
        for k, values in params.items()
        for v in (values if isinstance(values, list) else [values])
    ]
    return parse_query(PEOPLE, MultiDict(items))


def ids(result: dict[str, Any]) -> list[str]:
    return [item["id"] for item in result["data"]]


def test_sorting_puts_nulls_first_and_breaks_ties_by_id_in_either_direction() -> None:
    assert ids(page(PEOPLE, query(sort="age"), people())) == ["2", "4", "1", "3"]
    assert ids(page(PEOPLE, query(sort="-age"), people())) == ["1", "3", "4", "2"]


def test_repeated_filters_mean_or_and_different_ones_and() -> None:
    assert ids(page(PEOPLE, query(name=["Ada", "Di"]), people())) == ["1", "4"]
    assert ids(page(PEOPLE, query(tags="art", admin="false"), people())) == ["3"]
    assert ids(page(PEOPLE, query(q="d"), people())) == ["1", "4"]


def test_every_item_is_seen_once_across_pages_while_items_come_and_go() -> None:
    items = people()
    first = page(PEOPLE, query(sort="-age", limit="2"), items)
    assert ids(first) == ["1", "3"] and first["pagination"]["hasMore"]
    items = [i for i in items if i["id"] != "1"] + [
        {"id": "0", "name": "Zed", "age": 99, "admin": False, "tags": []}
    ]
    rest = page(
        PEOPLE, query(sort="-age", limit="2", cursor=first["pagination"]["nextCursor"]), items
    )
    assert ids(rest) == ["4", "2"]
    assert rest["pagination"] == {"nextCursor": None, "hasMore": False}


def test_a_cursor_belongs_to_its_sort_and_filters() -> None:
    cursor = page(PEOPLE, query(sort="name", limit="1"), people())["pagination"]["nextCursor"]
    for params in ({"sort": "age"}, {"sort": "name", "name": "Ada"}, {"sort": "name", "q": "x"}):
        with pytest.raises(ApiError) as refused:
            query(cursor=cursor, **params)
        assert refused.value.status == 422
        assert [field for field, _ in refused.value.details] == ["cursor"]


def test_limits_are_clamped_above_and_refused_below() -> None:
    assert query(limit="100000").limit == MAX_LIMIT
    assert query().limit == 20
    with pytest.raises(ApiError) as refused:
        query(limit="0", fields="id,colour", sort="tags", extra="1")
    assert sorted(f for f, _ in refused.value.details) == ["extra", "fields", "limit", "sort"]


def test_field_selection_keeps_only_the_fields_named() -> None:
    assert page(PEOPLE, query(fields="name,id", limit="1"), people())["data"] == [
        {"name": "Ada", "id": "1"}
    ]


def test_merge_patch_follows_rfc_7396() -> None:
    # RFC 7396 Appendix A, a few of its cases.
    assert merge_patch({"a": "b"}, {"a": "c"}) == {"a": "c"}
    assert merge_patch({"a": "b", "b": "c"}, {"a": None}) == {"b": "c"}
    assert merge_patch({"a": [{"b": "c"}]}, {"a": [1]}) == {"a": [1]}
    assert merge_patch({"e": None}, {"a": 1}) == {"e": None, "a": 1}
    assert merge_patch({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}) == {"a": {"b": "d"}}


def test_validation_reports_the_configuration_rules_at_json_paths() -> None:
    with pytest.raises(ApiError) as refused:
        validation.build(
            DeclaredClient,
            {
                "client_id": "x",
                "redirect_uris": ["https://ok.example/cb", "https://ok.example/cb#frag"],
                "grant_types": ["authorization_code"],
                "jwks": {"keys": [{"kty": "oct", "k": "c2VjcmV0"}]},
            },
        )
    details = dict(refused.value.details)
    assert "fragment" in details["redirectUris[1]"]
    assert "private key material" in details["jwks"]
    built = validation.build(
        DeclaredClient,
        {"client_id": "x", "grant_types": ["client_credentials"], "client_secret": "s" * 40},
    )
    assert built.token_endpoint_auth_method == "client_secret_basic"


def test_ids_made_for_users_never_start_with_a_dash() -> None:
    """One random base64url id in 64 would, and `users delete ID` would read it as an option
    (exit 2): the users command test failed that way about one run in 64."""
    ids = [new_user_id() for _ in range(5000)]
    assert [i for i in ids if i.startswith("-")] == []
    assert len(set(ids)) == 5000 and {len(i) for i in ids} == {22}
