"""Collections of the admin API, once for every resource: paging, filters, sorting, field
selection and search over a resource's representations.

- `limit`: 1 to 200, 20 when absent; a larger one is clamped to 200, a smaller one or one
  that is not a whole number is 422.
- `cursor`: opaque; it names the last item of the previous page by its sort key, never by
  its position, so rows added or removed meanwhile neither repeat nor skip an item that
  stayed. It belongs to its sort, filters and search: used with others it is 422.
- `field=value` on the fields a resource lists as filters; repeated keys mean OR, distinct
  ones AND. A boolean matches `true`/`false`, a list any of its items.
- `sort=field` or `sort=-field` (descending), comma-separated for several; the resource's
  id always breaks ties, so the order is total and stable.
- `fields=a,b`: only those fields in each item.
- `q`: case-insensitive substring search over the resource's search fields.
Any other parameter is 422, as is an unknown field named in sort, fields or a filter.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from multidict import MultiMapping

from .http import invalid

DEFAULT_LIMIT = 20
MAX_LIMIT = 200
_CURSOR_VERSION = 1


@dataclass(frozen=True)
class Collection:
    """What a resource's collection offers: its id field (the tie-breaker), the fields
    that filter and sort it, and those `q` searches."""

    key: str
    fields: tuple[str, ...]
    filters: frozenset[str]
    sortable: frozenset[str]
    search: tuple[str, ...]


@dataclass(frozen=True)
class Query:
    limit: int
    sort: tuple[tuple[str, bool], ...]  # (field, descending), the key last
    filters: Mapping[str, tuple[str, ...]]
    fields: tuple[str, ...] | None
    q: str | None
    after: tuple[Any, ...] | None  # the sort key of the last item already given

    @property
    def fingerprint(self) -> str:
        """What a cursor is bound to besides its sort: the filters and the search."""
        text = orjson.dumps(
            {"f": {k: list(v) for k, v in sorted(self.filters.items())}, "q": self.q}
        )
        return hashlib.sha256(text).hexdigest()[:16]


def parse_query(collection: Collection, params: MultiMapping[str]) -> Query:
    """The query of a collection request; 422 listing every problem."""
    problems: list[tuple[str, str]] = []
    known = {"limit", "cursor", "sort", "fields", "q"}
    for name in params:
        if name not in known and name not in collection.filters:
            problems.append(
                (name, f"unknown parameter; filters: {', '.join(sorted(collection.filters))}")
            )
    for name in known:
        if len(params.getall(name, [])) > 1:
            problems.append((name, "given more than once"))

    limit = DEFAULT_LIMIT
    if "limit" in params:
        text = params["limit"]
        # ASCII digits only: str.isdigit() also takes digits int() cannot read ("²").
        if not (text.isascii() and text.isdigit()) or int(text) < 1:
            problems.append(("limit", f"must be a whole number from 1 to {MAX_LIMIT}"))
        else:
            limit = min(int(text), MAX_LIMIT)

    sort: list[tuple[str, bool]] = []
    for item in params.get("sort", "").split(","):
        if not item:
            continue
        name, descending = (item[1:], True) if item.startswith("-") else (item, False)
        if name not in collection.sortable:
            problems.append(
                (
                    "sort",
                    f"cannot sort by {name!r}; sortable: {', '.join(sorted(collection.sortable))}",
                )
            )
        elif name not in (s for s, _ in sort):
            sort.append((name, descending))
    if collection.key not in (s for s, _ in sort):
        sort.append((collection.key, False))  # ties broken by the id

    fields = None
    if "fields" in params:
        fields = tuple(dict.fromkeys(f for f in params["fields"].split(",") if f))
        unknown = [f for f in fields if f not in collection.fields]
        if unknown or not fields:
            problems.append(
                (
                    "fields",
                    f"unknown field(s) {', '.join(unknown)}; known: {', '.join(collection.fields)}",
                )
            )

    filters = {name: tuple(params.getall(name)) for name in collection.filters if name in params}
    q = params.get("q") or None
    query = Query(limit, tuple(sort), filters, fields, q, None)
    after = None
    if "cursor" in params:
        after = _read_cursor(params["cursor"], query, problems)
    if problems:
        raise invalid(problems, "the collection query is invalid")
    return Query(limit, tuple(sort), filters, fields, q, after)


def page(
    collection: Collection, query: Query, items: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """One page of `items` (every representation of the resource) as the query asks."""
    chosen = [i for i in items if _matches(i, query, collection)]

    def order(a: Mapping[str, Any], b: Mapping[str, Any]) -> int:
        return _compare(_key(a, query), _key(b, query), query)

    ordered = sorted(chosen, key=functools.cmp_to_key(order))
    if query.after is not None:
        after = query.after
        ordered = [i for i in ordered if _compare(_key(i, query), after, query) > 0]
    shown = ordered[: query.limit]
    more = len(ordered) > query.limit
    data = [{f: i.get(f) for f in query.fields} if query.fields else dict(i) for i in shown]
    cursor = _cursor(_key(shown[-1], query), query) if more and shown else None
    return {"data": data, "pagination": {"nextCursor": cursor, "hasMore": more}}


def _matches(item: Mapping[str, Any], query: Query, collection: Collection) -> bool:
    for name, wanted in query.filters.items():
        if not any(_equals(item.get(name), text) for text in wanted):
            return False
    if query.q:
        needle = query.q.casefold()
        return any(needle in str(item.get(f) or "").casefold() for f in collection.search)
    return True


def _equals(value: Any, text: str) -> bool:
    if isinstance(value, bool):
        return text == ("true" if value else "false")
    if isinstance(value, list):
        return any(_equals(v, text) for v in value)
    if value is None:
        return text == "null"
    return str(value) == text


def _key(item: Mapping[str, Any], query: Query) -> tuple[Any, ...]:
    return tuple(item.get(name) for name, _ in query.sort)


def _rank(value: Any) -> tuple[Any, ...]:
    """Nulls first; then by value (one type per field)."""
    return (0,) if value is None else (1, value)


def _compare(a: Sequence[Any], b: Sequence[Any], query: Query) -> int:
    for (x, y), (_, descending) in zip(zip(a, b, strict=True), query.sort, strict=True):
        rx, ry = _rank(x), _rank(y)
        try:
            if rx == ry:
                continue
            less = rx < ry
        except TypeError:  # a cursor whose value has another type than the field's
            less = str(rx) < str(ry)
        return (1 if less else -1) if descending else (-1 if less else 1)
    return 0


def _cursor(key: tuple[Any, ...], query: Query) -> str:
    raw = orjson.dumps(
        {
            "v": _CURSOR_VERSION,
            "s": [[n, d] for n, d in query.sort],
            "k": list(key),
            "h": query.fingerprint,
        }
    )
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _read_cursor(
    text: str, query: Query, problems: list[tuple[str, str]]
) -> tuple[Any, ...] | None:
    try:
        value = orjson.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (binascii.Error, ValueError):
        problems.append(("cursor", "not a cursor this API gave"))
        return None
    if (
        not isinstance(value, dict)
        or value.get("v") != _CURSOR_VERSION
        or not isinstance(value.get("k"), list)
        or len(value["k"]) != len(query.sort)
    ):
        problems.append(("cursor", "not a cursor this API gave"))
        return None
    if value.get("s") != [[n, d] for n, d in query.sort]:
        problems.append(("cursor", "made for another sort: give the sort it was made with"))
        return None
    if value.get("h") != query.fingerprint:
        problems.append(("cursor", "made for other filters or another search"))
        return None
    return tuple(value["k"])
