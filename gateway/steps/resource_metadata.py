"""Protected resource metadata (RFC 9728): how a client that met a 401 finds the issuers a
resource trusts, the scopes it knows, and how tokens are to be presented.

Every protected resource the routes define (records.Resource: one per origin and path, its
routes brought together by adapter.resources) has its document at the well-known path with
its own path after it (§3.1): `/.well-known/oauth-protected-resource/mcp` for `/mcp`. The
root form, `/.well-known/oauth-protected-resource`, is the document of the resource at the
root of the origin (routes such as `/**`), and of no other: a client that fetched it for a
resource at a path would find another `resource` in it and must refuse it (§3.3), so it
never describes a resource of several behind one gateway (and every challenge names the
right document anyway, in `resource_metadata`).

Documents are answered before any rule is matched, whatever `unmatched` says, to GET and
HEAD, with `Cache-Control` and a strong `ETag` (a matching `If-None-Match` gets 304), and
`Access-Control-Allow-Origin: *`: they hold nothing secret, and browser-based clients read
them across origins. A resource reached at the request's own origin (no public_url) has its
document made for that origin, from a Host that is a plain host[:port] only.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import orjson
from aiohttp import web

from ..core.records import Resource

WELL_KNOWN = "/.well-known/oauth-protected-resource"
_CACHE_CONTROL = "public, max-age=300"
# What a Host header may hold to be written into a URL (RFC 9110 §7.2), narrowed to names
# and addresses in real use.
_HOST = re.compile(r"(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
_MEMO_LIMIT = 64  # documents of request origins remembered; clients choose the Host


def request_origin(scheme: str, host: str | None) -> str | None:
    """scheme://host[:port] of a request, when its Host can stand in a URL."""
    if not host or _HOST.fullmatch(host) is None:
        return None
    return f"{scheme}://{host}"


class Documents:
    """The metadata documents of one configuration's resources."""

    def __init__(self, resources: Sequence[Resource], dpop_algorithms: Sequence[str]) -> None:
        self._dpop_algorithms = tuple(dpop_algorithms)
        # path -> the resources there: one of a known origin each, and at most one reached
        # at the request's own.
        self._by_path: dict[str, list[Resource]] = {}
        for resource in resources:
            self._by_path.setdefault(resource.metadata_path, []).append(resource)
        self._made: dict[tuple[str, str], tuple[bytes, str]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_path)

    @staticmethod
    def asks(path: str) -> bool:
        return path == WELL_KNOWN or path.startswith(WELL_KNOWN + "/")

    def answer(
        self, method: str, path: str, origin: str | None, if_none_match: str | None
    ) -> web.Response:
        """The answer to a request for `path` under the well-known prefix."""
        if method not in ("GET", "HEAD"):
            response = web.Response(status=405, headers={"Allow": "GET, HEAD"})
            return response
        resource = self._find(path, origin)
        resource_origin = (resource.origin or origin) if resource is not None else None
        if resource is None or resource_origin is None:
            return web.Response(
                status=404,
                body=orjson.dumps({"error": "not_found"}),
                content_type="application/json",
                headers={"Access-Control-Allow-Origin": "*"},
            )
        body, etag = self._document(resource, resource_origin)
        headers = {
            "Cache-Control": _CACHE_CONTROL,
            "ETag": etag,
            "Access-Control-Allow-Origin": "*",
        }
        if if_none_match is not None and _matches(if_none_match, etag):
            return web.Response(status=304, headers=headers)
        return web.Response(body=body, content_type="application/json", headers=headers)

    def _find(self, path: str, origin: str | None) -> Resource | None:
        found = self._by_path.get(path.rstrip("/") if path != WELL_KNOWN + "/" else WELL_KNOWN)
        if not found:
            return None
        for resource in found:
            if resource.origin is not None and resource.origin == origin:
                return resource
        for resource in found:
            if resource.origin is None:
                return resource
        return found[0]

    def _document(self, resource: Resource, origin: str) -> tuple[bytes, str]:
        key = (origin, resource.path)
        made = self._made.get(key)
        if made is None:
            document: dict[str, object] = {
                "resource": origin + resource.path,
                "authorization_servers": list(resource.issuers),
                "scopes_supported": list(resource.scopes),
                "bearer_methods_supported": ["header"],
                "dpop_signing_alg_values_supported": list(self._dpop_algorithms),
            }
            if resource.dpop_required:
                document["dpop_bound_access_tokens_required"] = True
            if resource.name is not None:
                document["resource_name"] = resource.name
            if resource.documentation is not None:
                document["resource_documentation"] = resource.documentation
            body = orjson.dumps(document)
            made = (body, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
            if resource.origin is not None or len(self._made) < _MEMO_LIMIT:
                self._made[key] = made
        return made


def _matches(if_none_match: str, etag: str) -> bool:
    """RFC 9110 §13.1.2: `*`, or the tag among those listed (weak comparison)."""
    tags = [t.strip() for t in if_none_match.split(",")]
    return "*" in tags or etag in tags or f"W/{etag}" in tags
