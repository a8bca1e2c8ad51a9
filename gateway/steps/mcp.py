"""The JSON-RPC call of an MCP request (Model Context Protocol, Streamable HTTP), and the
scopes a route's rules give it. PURE: bytes and headers in, a value or a refusal's reason out.

On a route that serves an MCP server, a POST carries one JSON-RPC message: a request
(`method` and `id`), a notification (`method`, no `id`) or a response to the server (`result`
or `error`). The gateway reads it within the body it buffers anyway, to decide the call:
- one message per POST: a JSON array (a batch, which MCP removed in its 2025-06-18
  revision) is refused, so no call can hide behind another the rules would judge instead;
- the `Mcp-Method` and `Mcp-Name` headers (MCP 2026-07-28), when a client sends them, must
  say what the body says: an upstream left unchanged may read either;
- the name a call acts on is `params.name` for tools/call and prompts/get and `params.uri`
  for resources/read, subscribe and unsubscribe (what `Mcp-Name` carries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import orjson
from multidict import CIMultiDictProxy

from ..core.records import McpCall, Scopes

# What each named method's params name.
NAMED = {
    "tools/call": "name",
    "prompts/get": "name",
    "resources/read": "uri",
    "resources/subscribe": "uri",
    "resources/unsubscribe": "uri",
}


@dataclass(frozen=True, slots=True)
class Call:
    """What a message asks of the server: its method (None for a response), and the name
    of what it acts on (None when the method names nothing)."""

    method: str | None
    name: str | None


class BadMessage(ValueError):
    """The body is not one JSON-RPC message the rules can judge (400)."""


def read_call(body: bytes, headers: CIMultiDictProxy[str]) -> Call:
    """The call `body` makes; BadMessage when it cannot be told, or the headers say
    another."""
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise BadMessage("the body is not JSON") from None
    if isinstance(message, list):
        raise BadMessage("a batch of JSON-RPC messages is not accepted: send one per request")
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        raise BadMessage("the body is not a JSON-RPC 2.0 message")
    method = message.get("method")
    if method is None:
        if "result" not in message and "error" not in message:
            raise BadMessage("the JSON-RPC message has neither a method nor a result")
        call = Call(None, None)
    elif not isinstance(method, str):
        raise BadMessage("the JSON-RPC method is not a string")
    else:
        call = Call(method, _name(method, message.get("params")))
    _agree(headers, "Mcp-Method", call.method)
    _agree(headers, "Mcp-Name", call.name)
    return call


def _name(method: str, params: object) -> str | None:
    member = NAMED.get(method)
    if member is None:
        return None
    value = params.get(member) if isinstance(params, dict) else None
    if not isinstance(value, str):
        raise BadMessage(f"{method} names no {member} in its params")
    return value


def _agree(headers: CIMultiDictProxy[str], field: str, body_value: str | None) -> None:
    values = headers.getall(field, ())
    if not values:
        return
    if len(values) > 1 or values[0] != body_value:
        raise BadMessage(f"the {field} header does not say what the body says")


def scopes_for(call: Call, rules: Sequence[McpCall]) -> Scopes | None:
    """The scopes the first rule matching `call` gives it; None when none matches (the
    route's own scopes are all it needs)."""
    if call.method is None:
        return None
    for rule in rules:
        if rule.method != call.method:
            continue
        if rule.pattern is None or (call.name is not None and rule.pattern.match(call.name)):
            return rule.scopes
    return None
