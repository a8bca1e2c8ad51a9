"""A client's web server publishing Client ID Metadata Documents over TLS on loopback, for
the tests of clients named by their document's URL: a test CA signs its certificate, and the
authorization server under test is given that CA (`ca_file`) and the site's origin
(`allow_origins`, the draft's loopback exception for development)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from tests.certificates import CertificateAuthority, server_context
from tests.support import start_site

TOOLS = "mcp:tools"
CALLBACK = "http://127.0.0.1:7777/callback"


@dataclass
class ClientSite:
    """The MCP client's web server: documents by path, what each answer carries, and how
    many requests each path got."""

    base: str
    ca_file: Path
    documents: dict[str, Any] = field(default_factory=dict)
    behaviours: dict[str, Callable[[web.Request], Any]] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    cache_control: str = "max-age=600"
    stalled: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, path: str = "/client.json") -> str:
        return self.base + path

    def publish(self, path: str = "/client.json", **changes: Any) -> str:
        """A valid document at `path` (with `changes`; a None value drops a member)."""
        url = self.url(path)
        document = {
            "client_id": url,
            "client_name": "Agent Smith",
            "client_uri": "https://agent.example",
            "redirect_uris": [CALLBACK],
            "grant_types": ["authorization_code", "refresh_token"],
            "response_types": ["code"],
            "token_endpoint_auth_method": "none",
            "scope": f"openid offline_access {TOOLS}",
        }
        document.update(changes)
        self.documents[path] = {k: v for k, v in document.items() if v is not None}
        return url

    def allowed(self) -> dict[str, Any]:
        """What the authorization server's `client_id_metadata_documents` needs to fetch
        from this site: its origin allowed, its CA trusted."""
        return {"allow_origins": [self.base], "ca_file": str(self.ca_file)}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.hits[path] = self.hits.get(path, 0) + 1
        behaviour = self.behaviours.get(path)
        if behaviour is not None:
            answer = behaviour(request)
            return await answer if asyncio.iscoroutine(answer) else answer
        if path not in self.documents:
            return web.Response(status=404)
        return web.json_response(
            self.documents[path], headers={"Cache-Control": self.cache_control}
        )


@contextlib.asynccontextmanager
async def client_site(directory: Path) -> AsyncIterator[ClientSite]:
    """A ClientSite on https://127.0.0.1:<free port>, its CA written under `directory`."""
    ca = CertificateAuthority()
    context = server_context(ca.server("agent"), directory, "agent")
    holder: list[ClientSite] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        return await holder[0].handle(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner, url = await start_site(app, ssl_context=context)
    holder.append(ClientSite(f"https://127.0.0.1:{urlsplit(url).port}", ca.write(directory)))
    try:
        yield holder[0]
    finally:
        holder[0].stalled.set()  # a behaviour waiting on it ends
        await runner.cleanup()
