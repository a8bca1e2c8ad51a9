"""Error responses of the gateway: RFC 6750 §3 challenges and the resource error body.

Messages are fixed texts chosen here: they never echo keys, claims or internals.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from aiohttp import web
from multidict import CIMultiDict

from portcullis.http import error_response

from ..core.principal import Principal

# RFC 6750 §3: error_description and scope values exclude `"` and `\`.
_UNSAFE = re.compile(r"[^\x20\x21\x23-\x5B\x5D-\x7E]")


def _quoted(value: str) -> str:
    return '"' + _UNSAFE.sub("", value) + '"'


@dataclass(frozen=True, slots=True)
class Offer:
    """The authentication schemes a route takes, each named by a challenge on a 401 (RFC
    9110 §11.6.1): Bearer (RFC 6750 §3) unless the route requires DPoP, and DPoP with the
    proof algorithms accepted (RFC 9449 §7.1 `algs`) when `dpop_algs` is set."""

    bearer: bool = True
    dpop_algs: str | None = None
    # RFC 9728 §5.1: where the route's protected resource metadata is, on every challenge:
    # its path, and the origin it is reached at (None: the request's own).
    metadata_path: str | None = None
    origin: str | None = None
    # RFC 6750 §3: the scopes the route needs, on a 401's challenges (a client asks for them).
    scope: str | None = None


BEARER_ONLY = Offer()
BEARER = "Bearer"
DPOP = "DPoP"


def _challenge(scheme: str, realm: str, params: dict[str, str]) -> str:
    parts = [f"realm={_quoted(realm)}"] + [f"{k}={_quoted(v)}" for k, v in params.items()]
    return f"{scheme} " + ", ".join(parts)


def _challenges(
    realm: str, offer: Offer, used: str, origin: str | None, status: int, **params: str
) -> CIMultiDict[str]:
    """One WWW-Authenticate field per scheme offered, Bearer first; the error's parameters
    go on the challenge of the scheme the client `used`, or on DPoP's when the route does
    not take what it used (RFC 9449 §7.2: a protected resource that takes both schemes
    answers with both challenges). Every challenge names the resource's metadata (RFC 9728
    §5.1), from `origin` when the route has none of its own, and a 401's the scopes the
    route needs (RFC 6750 §3), so that a client finds the authorization server and asks for
    enough from the first answer."""
    errors_on = used if used == DPOP or offer.bearer else DPOP
    common = {}
    if status == 401 and offer.scope and "scope" not in params:
        common["scope"] = offer.scope
    at = offer.origin or origin
    if offer.metadata_path is not None and at is not None:
        common["resource_metadata"] = at + offer.metadata_path
    headers: CIMultiDict[str] = CIMultiDict()
    if offer.bearer:
        bearer = {**params, **common} if errors_on == BEARER else dict(common)
        headers.add("WWW-Authenticate", _challenge(BEARER, realm, bearer))
    if offer.dpop_algs is not None:
        dpop = {**params, **common} if errors_on == DPOP else dict(common)
        dpop["algs"] = offer.dpop_algs
        headers.add("WWW-Authenticate", _challenge(DPOP, realm, dpop))
    return headers


@dataclass(frozen=True, slots=True)
class Challenge:
    """The WWW-Authenticate challenges of a refusal: one per scheme the route `offer`s, the
    error's parameters (`error`, `error_description`, `scope`; none when no credentials
    came) on the challenge of the scheme the client `used`."""

    offer: Offer
    used: str
    params: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a step of the request path refused, as data: the answer is built once, where the
    request ends (`render`), and monitor mode, which only records the refusal, builds none.

    `reason` is the short code the metrics and the access log count it by; `status`, `code`,
    `message` and `details` make the resource error body; `headers` are added to the answer
    (Retry-After, the RateLimit fields, DPoP-Nonce); `close` ends the connection after it
    (the body is refused unread). `principal`, for a refusal of a token valid for the route
    (insufficient scope), is who monitor mode forwards the request as."""

    reason: str
    status: int
    code: str
    message: str
    challenge: Challenge | None = None
    headers: tuple[tuple[str, str], ...] = ()
    details: tuple[tuple[str, str], ...] = ()
    close: bool = False
    principal: Principal | None = None


def render(
    refusal: Refusal,
    realm: str = "",
    extra: Iterable[tuple[str, str]] = (),
    origin: str | None = None,
) -> web.Response:
    """The answer a refusal gives: its challenges (in `realm`; `origin`: the request's
    scheme://host, where the route's resource metadata is when it names no origin of its
    own), its own headers, then `extra` (the CORS fields of the route)."""
    challenge = refusal.challenge
    headers = (
        _challenges(
            realm,
            challenge.offer,
            challenge.used,
            origin,
            refusal.status,
            **dict(challenge.params),
        )
        if challenge is not None
        else CIMultiDict()
    )
    headers.extend(refusal.headers)
    response = error_response(
        refusal.status, refusal.code, refusal.message, details=refusal.details, headers=headers
    )
    response.headers.extend(extra)
    if refusal.close:
        response.force_close()
    return response


def _token_error(
    reason: str,
    status: int,
    error: str,
    message: str,
    description: str,
    offer: Offer,
    used: str,
    **more: str,
) -> Refusal:
    """An RFC 6750 §3.1 / RFC 9449 §7.1 error: in the body and on the challenge."""
    params = (("error", error), ("error_description", description), *more.items())
    return Refusal(reason, status, error, message, Challenge(offer, used, params))


def unauthorized(offer: Offer = BEARER_ONLY) -> Refusal:
    """No credentials: the challenges carry no error (RFC 6750 §3.1)."""
    needs = (
        "a bearer access token in the Authorization header"
        if offer.bearer
        else "a DPoP-bound access token (Authorization: DPoP) and its proof (a DPoP header)"
    )
    return Refusal(
        "no_token", 401, "unauthorized", f"This API needs {needs}.", Challenge(offer, BEARER)
    )


def invalid_token(
    description: str,
    offer: Offer = BEARER_ONLY,
    used: str = BEARER,
    reason: str = "invalid_token",
) -> Refusal:
    return _token_error(
        reason,
        401,
        "invalid_token",
        f"The access token was refused: {description}.",
        description,
        offer,
        used,
    )


def invalid_dpop_proof(
    description: str, offer: Offer, reason: str = "invalid_dpop_proof"
) -> Refusal:
    """RFC 9449 §7.1: the DPoP proof that came with the token is not acceptable."""
    return _token_error(
        reason,
        401,
        "invalid_dpop_proof",
        f"The DPoP proof was refused: {description}.",
        description,
        offer,
        DPOP,
    )


def use_dpop_nonce(description: str, offer: Offer, nonce: str) -> Refusal:
    """RFC 9449 §9: the proof must carry the nonce given here in DPoP-Nonce."""
    refusal = _token_error(
        "dpop_nonce_required",
        401,
        "use_dpop_nonce",
        f"The DPoP proof was refused: {description}.",
        description,
        offer,
        DPOP,
    )
    return replace(refusal, headers=(("DPoP-Nonce", nonce),))


def invalid_request(description: str, offer: Offer = BEARER_ONLY, used: str = BEARER) -> Refusal:
    return _token_error(
        "malformed_authorization",
        400,
        "invalid_request",
        f"The request's credentials are malformed: {description}.",
        description,
        offer,
        used,
    )


def insufficient_scope(
    description: str,
    scope: str,
    offer: Offer = BEARER_ONLY,
    used: str = BEARER,
    principal: Principal | None = None,
) -> Refusal:
    refusal = _token_error(
        "insufficient_scope",
        403,
        "insufficient_scope",
        f"The access token lacks a scope this request needs: {description}.",
        description,
        offer,
        used,
        scope=scope,
    )
    return replace(refusal, details=(("scope", scope),), principal=principal)


def unavailable_refusal(reason: str, retry_after: int, message: str) -> Refusal:
    return Refusal(
        reason, 503, "unavailable", message, headers=(("Retry-After", str(retry_after)),)
    )


def replay_cache_unavailable() -> Refusal:
    """The replay cache cannot tell whether a DPoP proof is new: refused, never let through
    unchecked (RFC 9449 §11.1)."""
    return unavailable_refusal(
        "dpop_replay_cache_unavailable",
        1,
        "The gateway cannot check DPoP proofs right now; try again shortly.",
    )


def rate_limited(
    reason: str, retry_after: float, headers: Iterable[tuple[str, str]] = ()
) -> Refusal:
    """429 (RFC 6585 §4) with Retry-After in whole seconds, never 0 (RFC 9110 §10.2.3), and
    the rate-limit fields of the policy that refused."""
    seconds = max(1, math.ceil(retry_after))
    return Refusal(
        reason,
        429,
        "rate_limited",
        f"Too many requests; try again in {seconds} second{'s' if seconds != 1 else ''}.",
        headers=(("Retry-After", str(seconds)), *headers),
    )


def rate_limit_unknown(reason: str) -> Refusal:
    return unavailable_refusal(
        reason, 1, "The gateway cannot check rate limits right now; try again shortly."
    )


def refused(reason: str, status: int, code: str, message: str, *, close: bool = False) -> Refusal:
    """A refusal with no challenge (a path, a preflight, a body, a certificate)."""
    return Refusal(reason, status, code, message, close=close)


def not_found() -> web.Response:
    return error_response(404, "not_found", "No route of this gateway serves this request.")


def bad_request(message: str) -> web.Response:
    return error_response(400, "bad_request", message)


def unframeable(status: int, message: str) -> web.Response:
    """A request whose framing this gateway will not pass on (the request line's version,
    its transfer codings): refused unread, so the connection closes; where the next request
    would begin is not known."""
    code = _UNFRAMEABLE_CODES[status]
    response = error_response(status, code, message)
    response.force_close()
    return response


_UNFRAMEABLE_CODES = {
    400: "bad_request",
    501: "not_implemented",
    505: "http_version_not_supported",
}


def request_timeout() -> web.Response:
    """The connection closes (RFC 9110 §15.5.9): the rest of the body may never come.

    `force_close` both sends `Connection: close` and makes the server act on it; the header
    alone would leave the server waiting for the stalled body.
    """
    response = error_response(408, "request_timeout", "The request body did not arrive in time.")
    response.force_close()
    return response


def too_many_bodies() -> web.Response:
    """The client's address has as many bodies arriving as it may; this one is refused
    unread, so the connection closes."""
    response = error_response(
        429,
        "rate_limited",
        "Too many request bodies from this client are still arriving; try again shortly.",
        headers={"Retry-After": "1"},
    )
    response.force_close()
    return response


def upstream_busy() -> web.Response:
    """Every upstream connection stayed in use for `upstream.pool_timeout`."""
    return render(
        unavailable_refusal("upstream_busy", 1, "The upstream service is busy; try again shortly.")
    )


def bad_gateway() -> web.Response:
    return error_response(502, "bad_gateway", "The upstream service could not be reached.")


def gateway_timeout() -> web.Response:
    return error_response(504, "gateway_timeout", "The upstream service did not answer in time.")


def too_large(limit: int) -> Refusal:
    """The body is refused unread: the connection closes, so the rest of it is not drained."""
    return refused(
        "body_too_large",
        413,
        "payload_too_large",
        f"The request body is larger than {limit} bytes allowed here.",
        close=True,
    )


def payload_too_large(limit: int) -> web.Response:
    return render(too_large(limit))


def body_on_get(method: str) -> Refusal:
    """A body on GET or HEAD (RFC 9110 §9.3.1: no defined semantics; some servers would read
    it as a second request). It is refused unread, so the connection closes."""
    return refused(
        "body_on_get",
        400,
        "bad_request",
        f"A {method} request may not carry a body on this route.",
        close=True,
    )


def mcp_calls_unjudged() -> Refusal:
    """A POST to an MCP server whose route has call rules, asked about by a front proxy that
    did not pass its whole body: the call's scopes cannot be decided, and an allow on the
    route's scopes alone would let every call through. No challenge: no token would help.
    Refused in monitor mode too, as a message that cannot be judged is."""
    return refused(
        "mcp_calls_unjudged",
        403,
        "mcp_calls_unjudged",
        "The calls of this MCP server are decided from the request's body, which this "
        "authorization request does not carry whole: send its requests to the gateway's own "
        "listener, or have the front proxy pass the body (Envoy: with_request_body).",
    )


def cors_refused(reason: str) -> Refusal:
    """A preflight the route's CORS policy does not allow: no CORS header, so the browser
    stops the actual request; the body says why for whoever reads it."""
    return Refusal(
        "cors_refused",
        403,
        "cors_refused",
        f"This cross-origin request is not allowed: {reason}.",
        headers=(("Vary", "Origin"),),
    )


def client_certificate_required() -> Refusal:
    """A route that requires a verified TLS client certificate, reached without one. No
    challenge: a bearer token would not help."""
    return refused(
        "no_client_certificate",
        403,
        "client_certificate_required",
        "This route needs a TLS client certificate the gateway has verified.",
    )
