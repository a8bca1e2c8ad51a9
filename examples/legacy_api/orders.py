"""Orders: the records, their validation, and collection queries. No HTTP here.

Representation: camelCase names, ids as strings, times as ISO 8601 UTC (`2025-01-03T09:00:00Z`),
money as integer cents. A caller only ever sees their own orders.

Lifecycle of an order's `status` (anything else is a 409 conflict):

    pending ─▶ paid ─▶ shipped ─▶ delivered
       │        │
       └────────┴─▶ cancelled

Only a pending order may change its contents, and only a pending or cancelled order may be
deleted.

Collection paging is keyset paging: the cursor holds the sort key of the last order sent
(and a fingerprint of the query it belongs to), so a page is found again without any memory
on the server, and orders created or deleted between pages never shift what comes next.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

STATUSES = ("pending", "paid", "shipped", "delivered", "cancelled")
NEXT_STATUSES: Mapping[str, frozenset[str]] = {
    "pending": frozenset({"pending", "paid", "cancelled"}),
    "paid": frozenset({"paid", "shipped", "cancelled"}),
    "shipped": frozenset({"shipped", "delivered"}),
    "delivered": frozenset({"delivered"}),
    "cancelled": frozenset({"cancelled"}),
}
DELETABLE = frozenset({"pending", "cancelled"})
CURRENCIES = ("EUR", "USD", "GBP")

FIELDS = (
    "id",
    "owner",
    "status",
    "item",
    "quantity",
    "totalCents",
    "currency",
    "createdAt",
    "updatedAt",
)
READ_ONLY = frozenset({"id", "owner", "createdAt", "updatedAt"})
CONTENT_FIELDS = ("item", "quantity", "totalCents", "currency")
SORTABLE = frozenset(FIELDS)
DEFAULT_SORT = "-createdAt"
DEFAULT_LIMIT = 20
MAX_LIMIT = 100
MAX_ITEM_LENGTH = 200
MAX_QUANTITY = 1000
MAX_TOTAL_CENTS = 100_000_000
QUERY_PARAMETERS = frozenset({"status", "sort", "fields", "q", "limit", "cursor"})


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


@dataclass(frozen=True)
class Order:
    id: str
    owner: str
    status: str
    item: str
    quantity: int
    total_cents: int
    currency: str
    created_at: datetime
    updated_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "owner": self.owner,
            "status": self.status,
            "item": self.item,
            "quantity": self.quantity,
            "totalCents": self.total_cents,
            "currency": self.currency,
            "createdAt": iso(self.created_at),
            "updatedAt": iso(self.updated_at),
        }


Detail = tuple[str, str]  # (field, issue)


class Invalid(Exception):
    """The input is well-formed but breaks a rule (422 validation_error)."""

    def __init__(self, details: Sequence[Detail]) -> None:
        super().__init__("; ".join(f"{f}: {i}" for f, i in details))
        self.details = list(details)


class BadQuery(Exception):
    """Query parameters that cannot be read (400)."""

    def __init__(self, details: Sequence[Detail]) -> None:
        super().__init__("; ".join(f"{f}: {i}" for f, i in details))
        self.details = list(details)


class Conflict(Exception):
    """The change does not fit the order's current state (409)."""

    def __init__(self, details: Sequence[Detail]) -> None:
        super().__init__("; ".join(f"{f}: {i}" for f, i in details))
        self.details = list(details)


class NotFound(Exception):
    pass


# ---------------------------------------------------------------------------- validation


def _check_item(value: Any) -> str | None:
    if not isinstance(value, str):
        return "must be a string"
    if not value.strip():
        return "must not be empty"
    if len(value) > MAX_ITEM_LENGTH:
        return f"must be at most {MAX_ITEM_LENGTH} characters"
    return None


def _check_int(value: Any, low: int, high: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return "must be an integer"
    if not low <= value <= high:
        return f"must be between {low} and {high}"
    return None


def _check_currency(value: Any) -> str | None:
    if value not in CURRENCIES:
        return f"must be one of {', '.join(CURRENCIES)}"
    return None


def _check_status(value: Any) -> str | None:
    if value not in STATUSES:
        return f"must be one of {', '.join(STATUSES)}"
    return None


_CHECKS = {
    "item": _check_item,
    "quantity": lambda v: _check_int(v, 1, MAX_QUANTITY),
    "totalCents": lambda v: _check_int(v, 0, MAX_TOTAL_CENTS),
    "currency": _check_currency,
    "status": _check_status,
}


def validate(body: Any, current: Order | None) -> dict[str, Any]:
    """The writable fields of a create (`current` None) or a full replacement.

    A create may leave out `currency` (EUR) and `status` (which must then be pending); a
    replacement must give every writable field. Read-only fields may be sent back unchanged,
    which lets a client PUT what it got from a GET.
    """
    if not isinstance(body, dict):
        raise Invalid([("body", "must be a JSON object")])
    details: list[Detail] = []
    shown = current.to_json() if current is not None else None
    for name, value in body.items():
        if name in READ_ONLY:
            if shown is None:
                details.append((name, "is set by the server"))
            elif value != shown[name]:
                details.append((name, "is read-only"))
        elif name not in _CHECKS:
            details.append((name, "is not a field of an order"))
    values: dict[str, Any] = {}
    defaults = {"currency": "EUR", "status": "pending"} if current is None else {}
    for name, check in _CHECKS.items():
        if name not in body:
            if name in defaults:
                values[name] = defaults[name]
            else:
                details.append((name, "is required"))
            continue
        issue = check(body[name])
        if issue is not None:
            details.append((name, issue))
        else:
            values[name] = body[name].strip() if name == "item" else body[name]
    if current is None and values.get("status", "pending") != "pending":
        details.append(("status", "a new order is always pending"))
    if details:
        raise Invalid(details)
    return values


# ---------------------------------------------------------------------------- queries


@dataclass(frozen=True)
class Query:
    statuses: frozenset[str] | None
    text: str | None
    sort_field: str
    descending: bool
    fields: tuple[str, ...] | None
    limit: int
    after: tuple[Any, str] | None  # sort value and id of the last order already sent

    @property
    def sort(self) -> str:
        return ("-" if self.descending else "") + self.sort_field

    def fingerprint(self) -> str:
        """What a cursor must have been made for: the same filters and order."""
        basis = json.dumps([sorted(self.statuses or ()), self.text, self.sort])
        return hashlib.sha256(basis.encode()).hexdigest()[:16]


def _single(params: Mapping[str, Sequence[str]], name: str) -> str | None:
    values = params.get(name, ())
    if len(values) > 1:
        raise BadQuery([(name, "may be given once")])
    return values[0] if values else None


def parse_query(params: Mapping[str, Sequence[str]]) -> Query:
    """Read the collection parameters (each name to all its values); BadQuery lists problems."""
    problems: list[Detail] = []
    for name in params:
        if name not in QUERY_PARAMETERS:
            known = ", ".join(sorted(QUERY_PARAMETERS))
            problems.append((name, f"is not a parameter of this collection (known: {known})"))
    try:
        sort = _single(params, "sort") or DEFAULT_SORT
        fields_text = _single(params, "fields")
        text = _single(params, "q")
        limit_text = _single(params, "limit")
        cursor_text = _single(params, "cursor")
    except BadQuery as exc:
        raise BadQuery(problems + exc.details) from None

    statuses = None
    if "status" in params:
        # Repeated keys mean OR; a comma-separated list is read the same way.
        wanted = {s.strip() for v in params["status"] for s in v.split(",") if s.strip()}
        unknown = sorted(wanted - set(STATUSES))
        if unknown or not wanted:
            problems.append(("status", f"must be among {', '.join(STATUSES)}"))
        statuses = frozenset(wanted)

    descending = sort.startswith("-")
    sort_field = sort[1:] if descending else sort
    if sort_field not in SORTABLE:
        problems.append(("sort", f"can order by {', '.join(FIELDS)} (prefix - for descending)"))

    fields = None
    if fields_text is not None:
        fields = tuple(dict.fromkeys(f.strip() for f in fields_text.split(",") if f.strip()))
        unknown = [f for f in fields if f not in FIELDS]
        if unknown or not fields:
            problems.append(("fields", f"names fields among {', '.join(FIELDS)}"))

    limit = DEFAULT_LIMIT
    if limit_text is not None:
        if (
            not (limit_text.isascii() and limit_text.isdigit())
            or not 1 <= int(limit_text) <= MAX_LIMIT
        ):
            problems.append(("limit", f"must be an integer from 1 to {MAX_LIMIT}"))
        else:
            limit = int(limit_text)

    if text is not None:
        text = text.strip().casefold() or None

    if problems:
        raise BadQuery(problems)
    query = Query(statuses, text, sort_field, descending, fields, limit, None)
    if cursor_text is not None:
        query = replace(query, after=_read_cursor(cursor_text, query))
    return query


def make_cursor(query: Query, last: Mapping[str, Any]) -> str:
    position = {"q": query.fingerprint(), "k": [last[query.sort_field], last["id"]]}
    raw = json.dumps(position, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _read_cursor(text: str, query: Query) -> tuple[Any, str]:
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        position = json.loads(raw)
    except (binascii.Error, ValueError):
        raise BadQuery([("cursor", "is not a cursor this API gave out")]) from None
    key = position.get("k") if isinstance(position, dict) else None
    if (
        not isinstance(key, list)
        or len(key) != 2
        or not isinstance(key[1], str)
        or isinstance(key[0], bool)
        or not isinstance(key[0], str | int)
    ):
        raise BadQuery([("cursor", "is not a cursor this API gave out")])
    if position.get("q") != query.fingerprint():
        raise BadQuery([("cursor", "belongs to a request with other status, q or sort parameters")])
    return key[0], key[1]


@dataclass(frozen=True)
class Page:
    data: list[dict[str, Any]]
    next_cursor: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "data": self.data,
            "pagination": {"nextCursor": self.next_cursor, "hasMore": self.next_cursor is not None},
        }


def _matches(order: Mapping[str, Any], query: Query) -> bool:
    if query.statuses is not None and order["status"] not in query.statuses:
        return False
    if query.text is not None:
        haystack = f"{order['id']} {order['item']}".casefold()
        if query.text not in haystack:
            return False
    return True


def _select(order: Mapping[str, Any], fields: tuple[str, ...] | None) -> dict[str, Any]:
    if fields is None:
        return dict(order)
    # The id always comes along: without it a client cannot address what it was given.
    return {name: order[name] for name in FIELDS if name == "id" or name in fields}


def page(orders: Iterable[Order], query: Query) -> Page:
    shown = [o.to_json() for o in orders]
    chosen = [o for o in shown if _matches(o, query)]
    field = query.sort_field

    def key(order: Mapping[str, Any]) -> tuple[Any, str]:
        return order[field], order["id"]

    chosen.sort(key=key, reverse=query.descending)
    after = query.after
    if after is not None:
        try:
            if query.descending:
                chosen = [o for o in chosen if key(o) < after]
            else:
                chosen = [o for o in chosen if key(o) > after]
        except TypeError:  # a cursor value of the wrong type for this field
            raise BadQuery([("cursor", "is not a cursor this API gave out")]) from None
    batch = chosen[: query.limit]
    more = len(chosen) > query.limit
    next_cursor = make_cursor(query, batch[-1]) if more else None
    return Page([_select(o, query.fields) for o in batch], next_cursor)


def select_fields(order: Order, fields_text: str | None) -> dict[str, Any]:
    """One order's representation, limited to `fields` when given (BadQuery otherwise)."""
    if fields_text is None:
        return order.to_json()
    fields = tuple(f.strip() for f in fields_text.split(",") if f.strip())
    if not fields or any(f not in FIELDS for f in fields):
        raise BadQuery([("fields", f"names fields among {', '.join(FIELDS)}")])
    return _select(order.to_json(), fields)


# ---------------------------------------------------------------------------- the store


class OrderStore:
    """Orders in memory. Every method takes the owner: nobody reaches another's orders."""

    def __init__(self, orders: Iterable[Order] = ()) -> None:
        self._orders: dict[str, Order] = {o.id: o for o in orders}
        self._next = max((int(i[4:]) for i in self._orders if i[4:].isdigit()), default=0) + 1

    def list(self, owner: str) -> list[Order]:
        return [o for o in self._orders.values() if o.owner == owner]

    def get(self, owner: str, order_id: str) -> Order:
        order = self._orders.get(order_id)
        if order is None or order.owner != owner:
            raise NotFound(order_id)
        return order

    def create(self, owner: str, body: Any) -> Order:
        values = validate(body, None)
        moment = now()
        order = Order(
            id=f"ord_{self._next:04d}",
            owner=owner,
            status="pending",
            item=values["item"],
            quantity=values["quantity"],
            total_cents=values["totalCents"],
            currency=values["currency"],
            created_at=moment,
            updated_at=moment,
        )
        self._next += 1
        self._orders[order.id] = order
        return order

    def replace(self, owner: str, order_id: str, body: Any) -> Order:
        current = self.get(owner, order_id)
        values = validate(body, current)
        conflicts: list[Detail] = []
        if values["status"] not in NEXT_STATUSES[current.status]:
            conflicts.append(
                ("status", f"cannot change from {current.status} to {values['status']}")
            )
        if current.status != "pending":
            shown = current.to_json()
            for name in CONTENT_FIELDS:
                if values[name] != shown[name]:
                    conflicts.append((name, f"cannot change once the order is {current.status}"))
        if conflicts:
            raise Conflict(conflicts)
        updated = replace(
            current,
            status=values["status"],
            item=values["item"],
            quantity=values["quantity"],
            total_cents=values["totalCents"],
            currency=values["currency"],
            updated_at=max(now(), current.updated_at),
        )
        self._orders[order_id] = updated
        return updated

    def delete(self, owner: str, order_id: str) -> None:
        current = self.get(owner, order_id)
        if current.status not in DELETABLE:
            issue = f"a {current.status} order cannot be deleted, only a pending or cancelled one"
            raise Conflict([("status", issue)])
        del self._orders[order_id]


# ---------------------------------------------------------------------------- sample data

_CATALOGUE = (
    ("Espresso beans 1 kg", 2490),
    ("Ceramic mug", 1200),
    ("Pour-over kettle", 5900),
    ("Paper filters (100)", 650),
    ("Hand grinder", 8900),
    ("Green tea 250 g", 1450),
    ("Milk frother", 3400),
    ("Cold brew bottle", 2100),
)
_OWNERS = ("user-123", "alice", "user-123", "bob", "alice")
_STATUS_CYCLE = ("delivered", "shipped", "paid", "pending", "cancelled", "delivered", "paid")


def sample_orders(count: int = 30) -> list[Order]:
    """A fixed set of orders spread over a few owners (user-123, alice and bob)."""
    start = datetime(2025, 1, 3, 9, 0, tzinfo=UTC)
    result = []
    for n in range(count):
        item, price = _CATALOGUE[(n * 3) % len(_CATALOGUE)]
        quantity = 1 + (n * 7) % 4
        status = _STATUS_CYCLE[n % len(_STATUS_CYCLE)]
        created = start + n * timedelta(days=1, hours=7, minutes=13)
        updated = created if status == "pending" else created + timedelta(hours=5 + n % 30)
        result.append(
            Order(
                id=f"ord_{n + 1:04d}",
                owner=_OWNERS[n % len(_OWNERS)],
                status=status,
                item=item,
                quantity=quantity,
                total_cents=price * quantity,
                currency="EUR" if n % 4 else "GBP",
                created_at=created,
                updated_at=updated,
            )
        )
    return result
