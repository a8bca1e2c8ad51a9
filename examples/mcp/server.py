"""An MCP server with no authentication of its own, built with the official Python SDK.

It trusts the identity headers the gateway sets (X-Auth-Subject, X-Auth-Client-Id,
X-Auth-Scopes) the way examples/legacy_api does: the gateway in front checks every token and
removes any copy a client sent, and never passes the client's Authorization on. Reachable
only through the gateway, it needs nothing else; reachable directly, anyone could claim to
be anyone, which is why it listens on the loopback interface only.

Three tools: `whoami` (what the gateway said of the caller), `list_orders` (the caller's
orders) and `delete_order` (one of them, gone). The gateway's rules (examples/mcp/gateway.yaml)
let a token with mcp:tools call the first two, and only a token with mcp:admin besides call
`delete_order`; nothing here checks a scope.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from mcp.server.mcpserver import Context, MCPServer


@dataclass(frozen=True)
class Order:
    id: str
    item: str
    quantity: int


# Every caller starts with the same sample orders, kept per subject for as long as the
# process runs.
SAMPLE = (
    Order("1001", "Green tea 250 g", 2),
    Order("1002", "Teapot, cast iron", 1),
    Order("1003", "Tea cups, set of 4", 1),
)


class OrderBook:
    """Each subject's orders, in memory."""

    def __init__(self) -> None:
        self._orders: dict[str, dict[str, Order]] = {}

    def of(self, subject: str) -> dict[str, Order]:
        return self._orders.setdefault(subject, {o.id: o for o in SAMPLE})


def caller(headers: Mapping[str, str] | None) -> dict[str, object]:
    """Who the gateway says is calling: its identity headers, which it always sets; and
    whether a token came along, which behind the gateway it never does (an MCP server must
    not receive the client's token, lest it pass it on to another API)."""
    given = headers or {}
    return {
        "subject": given.get("x-auth-subject"),
        "clientId": given.get("x-auth-client-id"),
        "scopes": (given.get("x-auth-scopes") or "").split(),
        "tokenReceived": "authorization" in given,
    }


def subject_of(ctx: Context) -> str:
    subject = caller(ctx.headers)["subject"]
    if not isinstance(subject, str) or not subject:
        # Only a request that did not come through the gateway lacks it.
        raise ValueError("no X-Auth-Subject: reach this server through the gateway")
    return subject


def build_server(book: OrderBook | None = None) -> MCPServer:
    orders = book or OrderBook()
    server = MCPServer(
        "portcullis-example-orders",
        title="Example orders (behind the Portcullis gateway)",
        instructions="Orders of the signed-in user. delete_order needs the mcp:admin scope.",
    )

    @server.tool()
    def whoami(ctx: Context) -> dict[str, object]:
        """The caller as the gateway identified them: subject, client and scopes; and
        whether this server received the caller's token (never, behind the gateway)."""
        return caller(ctx.headers)

    @server.tool()
    def list_orders(ctx: Context) -> list[dict[str, object]]:
        """The caller's orders."""
        return [asdict(o) for o in orders.of(subject_of(ctx)).values()]

    @server.tool()
    def delete_order(order_id: str, ctx: Context) -> str:
        """Delete one of the caller's orders (the gateway lets only mcp:admin tokens call it)."""
        if orders.of(subject_of(ctx)).pop(order_id, None) is None:
            raise ValueError(f"no order {order_id}")
        return f"order {order_id} deleted"

    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.mcp",
        description=(
            "Example MCP server (Streamable HTTP at /mcp) that trusts the X-Auth-* identity "
            "headers set by the gateway. It checks no tokens: keep it reachable only through "
            "the gateway."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8091, help="port to listen on (8091)")
    args = parser.parse_args(argv)
    print(f"example MCP server on http://{args.host}:{args.port}/mcp", flush=True)
    build_server().run("streamable-http", host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
