"""The decision listener: the gateway's decisions served to front proxies that forward the
requests themselves (nginx `auth_request`, Traefik `forwardAuth`, Caddy `forward_auth`,
Envoy's HTTP `ext_authz`).

A front proxy asks about each request it received; the original request is read from
where that proxy's convention puts it, and only from there:

  /forward-auth          Traefik, Caddy: X-Forwarded-Method, X-Forwarded-Uri (required),
                         X-Forwarded-Proto, X-Forwarded-Host
  /auth-request          nginx, ingress-nginx: X-Original-Method with X-Original-URI (a path
                         and query) or X-Original-URL (absolute); both naming different
                         targets is refused, since either proxy passes the other one on
                         from the client
  /ext-authz/<target>    Envoy: the request's own method, its path after the prefix

A describing header missing, given twice or malformed is a 400: a request that cannot be
described is never judged as some other request. The headers of the other conventions are
ignored (a client can send `X-Original-URI` through Traefik, `X-Forwarded-Uri` through nginx).

Then the pipeline's steps 1 to 8 run on the described request, exactly as for the public
listener: match (with the same refusals of ambiguous paths), certificate, extract, verify,
the checks every request gets (DPoP, revocations), decide, limit (counted once per
decision). Step 7b, the call of a POST to an MCP server whose route has call rules, is judged
only when the question carries the original body (Envoy with `with_request_body`, whole);
a question without it is refused (403 mcp_calls_unjudged, in monitor mode too) rather than
allowed on the route's scopes alone. Step 9 is the answer: 200 with an empty body and
every identity header present, empty when the token has no value for it, so that a client's
forged copy cannot survive in a proxy that copies only the headers present in the answer; or
the refusal the proxy mode would give (status, challenge, error body).

Only callers in `trusted_callers` are answered: anyone else gets 403 before anything is
read, since an allow answer says which identity a token carries.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from multidict import CIMultiDictProxy

from portcullis.addresses import ClientAddresses, IPNetwork
from portcullis.http import error_response

from .core.exchange import Exchange
from .core.principal import Derived, Principal
from .core.records import IdentityHeaders
from .core.rules import HTTP_METHOD
from .forward import header_value, string_header_value
from .steps import errors
from .steps.errors import Refusal
from .steps.pipeline import Admitted, Pipeline

FORWARD_AUTH = "/forward-auth"
AUTH_REQUEST = "/auth-request"
EXT_AUTHZ = "/ext-authz"

# A request target in origin form (RFC 9112 §3.2.1) as a header carries it: visible ASCII.
_ORIGIN_FORM = re.compile(r"/[\x21-\x7E]*")
_HOST = re.compile(r"[A-Za-z0-9._-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


class BadDescription(Exception):
    """The front proxy's description of the original request is missing or malformed."""


@dataclass(frozen=True, slots=True)
class Original:
    """The request a front proxy asks about, as the client sent it."""

    method: str
    target: str  # path and query, never normalised: the rules judge it as the proxy would
    scheme: str | None = None
    host: str | None = None
    # Whether the question's body is the original's: Envoy's, when its filter has
    # `with_request_body` (no other proxy's question carries one).
    with_body: bool = False


def _one(headers: CIMultiDictProxy[str], name: str, *, required: bool = True) -> str | None:
    values = headers.getall(name, ())
    if len(values) > 1:
        raise BadDescription(f"{name} is given more than once")
    if not values:
        if required:
            raise BadDescription(f"{name} is missing")
        return None
    return values[0]


def _method(value: str | None, name: str) -> str:
    if value is None or not HTTP_METHOD.fullmatch(value):
        raise BadDescription(f"{name} is not an HTTP method")
    return value


def _target(value: str | None, name: str) -> str:
    if value is None or not _ORIGIN_FORM.fullmatch(value):
        raise BadDescription(f"{name} is not a path starting with /")
    return value


def _scheme(value: str | None, name: str) -> str | None:
    if value is not None and value.lower() not in ("http", "https"):
        raise BadDescription(f"{name} is neither http nor https")
    return value.lower() if value is not None else None


def _host(value: str | None, name: str) -> str | None:
    if value is not None and not _HOST.fullmatch(value):
        raise BadDescription(f"{name} is not a host[:port]")
    return value


def forward_auth(headers: CIMultiDictProxy[str]) -> Original:
    """Traefik's and Caddy's convention."""
    return Original(
        _method(_one(headers, "X-Forwarded-Method"), "X-Forwarded-Method"),
        _target(_one(headers, "X-Forwarded-Uri"), "X-Forwarded-Uri"),
        _scheme(_one(headers, "X-Forwarded-Proto", required=False), "X-Forwarded-Proto"),
        _host(_one(headers, "X-Forwarded-Host", required=False), "X-Forwarded-Host"),
    )


def auth_request(headers: CIMultiDictProxy[str]) -> Original:
    """nginx's convention (X-Original-URI) and ingress-nginx's (X-Original-URL)."""
    method = _method(_one(headers, "X-Original-Method"), "X-Original-Method")
    uri = _one(headers, "X-Original-URI", required=False)
    url = _one(headers, "X-Original-URL", required=False)
    # The nginx examples clear X-Original-URL and ingress-nginx sets it; an empty one is
    # the cleared one (nginx drops a header whose value is empty, others may not).
    if url == "":
        url = None
    if uri is None and url is None:
        raise BadDescription("X-Original-URI or X-Original-URL is needed")
    scheme = host = None
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.netloc or parts.fragment:
            raise BadDescription("X-Original-URL is not an absolute http(s) URL")
        path = url[len(parts.scheme) + 3 + len(parts.netloc) :] or "/"
        from_url = _target(path, "X-Original-URL")
        scheme, host = parts.scheme.lower(), _host(parts.netloc, "X-Original-URL")
        if uri is not None and _target(uri, "X-Original-URI") != from_url:
            raise BadDescription("X-Original-URI and X-Original-URL name different targets")
        return Original(method, from_url, scheme, host)
    return Original(method, _target(uri, "X-Original-URI"))


def ext_authz(method: str, raw_path: str) -> Original:
    """Envoy's convention: the check request is the original one, its path behind the
    prefix `path_prefix` gives it."""
    return Original(
        _method(method, "the method"),
        _target(raw_path[len(EXT_AUTHZ) :], "the path"),
        with_body=True,
    )


def describe(request: web.BaseRequest) -> Original | None:
    """The original request by the convention of the endpoint asked; None for a path that is
    no endpoint."""
    raw = request.raw_path
    if raw.startswith(EXT_AUTHZ + "/"):
        return ext_authz(request.method, raw)
    path = raw.partition("?")[0]
    if path == FORWARD_AUTH:
        return forward_auth(request.headers)
    if path == AUTH_REQUEST:
        return auth_request(request.headers)
    return None


class Described:
    """The original request, as steps 1 to 8 read it: its method and target, with the headers
    the front proxy passed on (the client's Authorization above all); its scheme and host
    as the front proxy describes them, else those of the question (Envoy asks with the
    original Host). Its connection is the front proxy's: no client certificate is known
    here."""

    __slots__ = ("headers", "host", "method", "raw_path", "remote", "scheme")

    def __init__(self, original: Original, request: web.BaseRequest) -> None:
        self.method = original.method
        self.raw_path = original.target
        self.headers = request.headers
        self.remote = request.remote
        self.scheme = original.scheme or request.scheme
        self.host = original.host or request.host

    @property
    def transport(self) -> None:
        return None


class Decider:
    """The decisions of one configuration: who may ask, and the answers' headers."""

    def __init__(self, trusted_callers: Sequence[IPNetwork], identity: IdentityHeaders) -> None:
        # The same test as trusted_proxies': an address inside one of the networks.
        self._callers = ClientAddresses(trusted_callers)
        self._identity = identity
        # Each principal's answer, for as long as a cache keeps the principal.
        self._answers: Derived[tuple[tuple[str, str], ...]] = Derived(_REMEMBERED)
        # Every identity header, empty: the answer when there is no principal.
        self._anonymous = tuple((name, "") for name in identity.names())

    def trusts(self, remote: str | None) -> bool:
        """Whether the caller's address is in trusted_callers."""
        return remote is not None and self._callers.is_trusted(remote)

    async def decide(
        self, pipeline: Pipeline[Any], request: web.BaseRequest, exchange: Exchange
    ) -> web.StreamResponse:
        """The answer to a front proxy's question."""
        if not self.trusts(request.remote):
            exchange.deny("untrusted_caller", False)
            return error_response(
                403, "untrusted_caller", "This address may not ask for decisions."
            )
        try:
            original = describe(request)
        except BadDescription as exc:
            exchange.deny("bad_description", False)
            return errors.bad_request(f"The original request is not described: {exc}.")
        if original is None:
            exchange.deny("no_endpoint", False)
            return error_response(404, "not_found", "No decision endpoint here.")
        exchange.method, exchange.path = original.method, original.target
        admitted = await pipeline.admit(Described(original, request), exchange)
        if isinstance(admitted, Admitted):
            if has_call_rules(admitted, original.method):
                return await self.judge_call(pipeline, request, exchange, original, admitted)
            return self.allow(admitted.principal, admitted.extra)
        if isinstance(admitted, Refusal):
            return pipeline.render(admitted, Described(original, request))
        # A CORS preflight the route's policy allows: the front proxy (or the upstream)
        # answers it.
        return self.allow(None, ())

    async def judge_call(
        self,
        pipeline: Pipeline[Any],
        request: web.BaseRequest,
        exchange: Exchange,
        original: Original,
        admitted: Admitted,
    ) -> web.StreamResponse:
        """Step 7b for a front proxy: the call of a POST to an MCP server whose route has
        call rules, judged from the body when the question carries all of it (Envoy with
        `with_request_body`, `x-envoy-auth-partial-body` not `true`), with the `Mcp-Method`
        and `Mcp-Name` the proxy passed on, exactly as the gateway's own listener judges it.
        Without the body, or with part of it, the call cannot be told: 403
        mcp_calls_unjudged, in monitor mode too, rather than an allow on the route's scopes
        alone."""
        plan, principal = admitted.plan, admitted.principal
        assert plan.mcp is not None
        described = Described(original, request)
        headers = request.headers
        if (
            not original.with_body
            or not request.body_exists
            or headers.get(PARTIAL_BODY, "").strip().lower() == "true"
        ):
            refusal = errors.mcp_calls_unjudged()
            exchange.deny(refusal.reason, False)
            return pipeline.render(refusal, described)
        read = await pipeline.forwarder.read_whole(request, plan.mcp.max_message_size)
        if isinstance(read, web.Response):
            exchange.deny("mcp_message_unread", False)
            return read
        refused = pipeline.decide_call(plan, headers, read, principal)
        if refused is None:
            return self.allow(principal, admitted.extra)
        # As on the public listener: monitor mode lets a call through that the rules refuse,
        # never one that cannot be read (400).
        let_through = plan.monitor and refused.status != 400
        exchange.deny(refused.reason, let_through)
        if let_through:
            return self.allow(principal, admitted.extra)
        return pipeline.render(refused, described)

    def allow(self, principal: Principal | None, extra: Sequence[tuple[str, str]]) -> web.Response:
        headers = self._anonymous if principal is None else self._headers(principal)
        response = web.Response(status=200, headers=list(headers))
        response.headers.extend(extra)
        return response

    def _headers(self, principal: Principal) -> tuple[tuple[str, str], ...]:
        """Every identity header of a principal, empty where it has no value; computed once
        per verified token."""
        known = self._answers.get(principal)
        if known is not None:
            return known
        headers = identity_answer(self._identity, principal)
        self._answers.put(principal, headers)
        return headers


_REMEMBERED = 16_384  # principals whose answers are remembered


# Set by Envoy on a question whose body it cut at `max_request_bytes`
# (`allow_partial_message`).
PARTIAL_BODY = "x-envoy-auth-partial-body"


def has_call_rules(admitted: Admitted, method: str) -> bool:
    """Whether the request is a POST to an MCP server whose route gives calls scopes of their
    own: its JSON-RPC call is in the body, which the decision must then read."""
    mcp = admitted.plan.mcp
    return mcp is not None and bool(mcp.calls) and method == "POST"


def identity_answer(ids: IdentityHeaders, principal: Principal) -> tuple[tuple[str, str], ...]:
    """Every identity header of an allow answer, in the order configured, empty where the
    principal has no value (spelled as the proxy mode spells them upstream)."""
    values = {
        ids.subject: string_header_value(principal.subject),
        ids.client_id: ""
        if principal.client_id is None
        else string_header_value(principal.client_id),
        # Scopes are RFC 6749 §3.3 scope tokens (the verifiers refuse others): no spaces.
        ids.scopes: " ".join(string_header_value(s) for s in sorted(principal.scopes)),
        ids.issuer: string_header_value(principal.issuer),
    }
    for header, claim in ids.claims.items():
        value = principal.claims.get(claim)
        values[header] = "" if value is None else header_value(value)
    return tuple((name, values.get(name, "")) for name in ids.names())
