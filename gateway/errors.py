"""Error responses of the gateway: RFC 6750 §3 challenges and the resource error body.

Messages are fixed texts chosen here: they never echo keys, claims or internals.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict

from portcullis.http import error_response

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


BEARER_ONLY = Offer()
BEARER = "Bearer"
DPOP = "DPoP"


def _challenge(scheme: str, realm: str, params: dict[str, str]) -> str:
    parts = [f"realm={_quoted(realm)}"] + [f"{k}={_quoted(v)}" for k, v in params.items()]
    return f"{scheme} " + ", ".join(parts)


def _challenges(realm: str, offer: Offer, used: str, **params: str) -> CIMultiDict[str]:
    """One WWW-Authenticate field per scheme offered, Bearer first; the error's parameters
    go on the challenge of the scheme the client `used`, or on DPoP's when the route does
    not take what it used (RFC 9449 §7.2: a protected resource that takes both schemes
    answers with both challenges)."""
    errors_on = used if used == DPOP or offer.bearer else DPOP
    headers: CIMultiDict[str] = CIMultiDict()
    if offer.bearer:
        bearer = params if errors_on == BEARER else {}
        headers.add("WWW-Authenticate", _challenge(BEARER, realm, bearer))
    if offer.dpop_algs is not None:
        dpop = dict(params) if errors_on == DPOP else {}
        dpop["algs"] = offer.dpop_algs
        headers.add("WWW-Authenticate", _challenge(DPOP, realm, dpop))
    return headers


def unauthorized(realm: str, offer: Offer = BEARER_ONLY) -> web.Response:
    """No credentials: the challenges carry no error (RFC 6750 §3.1)."""
    needs = (
        "a bearer access token in the Authorization header"
        if offer.bearer
        else "a DPoP-bound access token (Authorization: DPoP) and its proof (a DPoP header)"
    )
    return error_response(
        401, "unauthorized", f"This API needs {needs}.", headers=_challenges(realm, offer, BEARER)
    )


def invalid_token(
    realm: str, description: str, offer: Offer = BEARER_ONLY, used: str = BEARER
) -> web.Response:
    return error_response(
        401,
        "invalid_token",
        f"The access token was refused: {description}.",
        headers=_challenges(
            realm, offer, used, error="invalid_token", error_description=description
        ),
    )


def invalid_dpop_proof(realm: str, description: str, offer: Offer) -> web.Response:
    """RFC 9449 §7.1: the DPoP proof that came with the token is not acceptable."""
    return error_response(
        401,
        "invalid_dpop_proof",
        f"The DPoP proof was refused: {description}.",
        headers=_challenges(
            realm, offer, DPOP, error="invalid_dpop_proof", error_description=description
        ),
    )


def use_dpop_nonce(realm: str, description: str, offer: Offer, nonce: str) -> web.Response:
    """RFC 9449 §9: the proof must carry the nonce given here in DPoP-Nonce."""
    headers = _challenges(realm, offer, DPOP, error="use_dpop_nonce", error_description=description)
    headers["DPoP-Nonce"] = nonce
    return error_response(
        401,
        "use_dpop_nonce",
        f"The DPoP proof was refused: {description}.",
        headers=headers,
    )


def invalid_request(
    realm: str, description: str, offer: Offer = BEARER_ONLY, used: str = BEARER
) -> web.Response:
    return error_response(
        400,
        "invalid_request",
        f"The request's credentials are malformed: {description}.",
        headers=_challenges(
            realm, offer, used, error="invalid_request", error_description=description
        ),
    )


def insufficient_scope(
    realm: str,
    description: str,
    scope: str,
    offer: Offer = BEARER_ONLY,
    used: str = BEARER,
) -> web.Response:
    return error_response(
        403,
        "insufficient_scope",
        f"The access token lacks a scope this request needs: {description}.",
        details=[("scope", scope)],
        headers=_challenges(
            realm,
            offer,
            used,
            error="insufficient_scope",
            error_description=description,
            scope=scope,
        ),
    )


def replay_cache_unavailable() -> web.Response:
    """The replay cache cannot tell whether a DPoP proof is new: refused, never let through
    unchecked (RFC 9449 §11.1)."""
    return unavailable(1, "The gateway cannot check DPoP proofs right now; try again shortly.")


def not_found() -> web.Response:
    return error_response(404, "not_found", "No route of this gateway serves this request.")


def bad_request(message: str) -> web.Response:
    return error_response(400, "bad_request", message)


def unparsable(status: int) -> web.Response:
    """A request the server could not read: 414 for a request line over the limit (RFC 9112
    §3), 431 for header fields over theirs (RFC 6585 §5), 400 for anything else. The body
    never echoes what was sent, and the connection closes: where the next request would
    begin is not known."""
    code, message = _UNPARSABLE.get(
        status, ("bad_request", "The request could not be parsed (see the limits of this API).")
    )
    response = error_response(status, code, message)
    response.force_close()
    return response


_UNPARSABLE = {
    414: ("uri_too_long", "The request line is longer than this API accepts."),
    431: (
        "header_fields_too_large",
        "The request's header fields are larger, or more, than this API accepts.",
    ),
}


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


def payload_too_large(limit: int) -> web.Response:
    """The body is refused unread: the connection closes, so the rest of it is not drained."""
    response = error_response(
        413, "payload_too_large", f"The request body is larger than {limit} bytes allowed here."
    )
    response.force_close()
    return response


def request_timeout() -> web.Response:
    """The connection closes (RFC 9110 §15.5.9): the rest of the body may never come.

    `force_close` both sends `Connection: close` and makes the server act on it; the header
    alone would leave the server waiting for the stalled body.
    """
    response = error_response(408, "request_timeout", "The request body did not arrive in time.")
    response.force_close()
    return response


def body_not_allowed(method: str) -> web.Response:
    """A body on GET or HEAD (RFC 9110 §9.3.1: no defined semantics; some servers would read
    it as a second request). It is refused unread, so the connection closes."""
    response = bad_request(f"A {method} request may not carry a body on this route.")
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
    return unavailable(1, "The upstream service is busy; try again shortly.")


def bad_gateway() -> web.Response:
    return error_response(502, "bad_gateway", "The upstream service could not be reached.")


def gateway_timeout() -> web.Response:
    return error_response(504, "gateway_timeout", "The upstream service did not answer in time.")


def unavailable(retry_after: int, message: str) -> web.Response:
    return error_response(503, "unavailable", message, headers={"Retry-After": str(retry_after)})


def too_many_requests(retry_after: float, headers: list[tuple[str, str]]) -> web.Response:
    """429 (RFC 6585 §4) with Retry-After in whole seconds, never 0 (RFC 9110 §10.2.3), and
    the rate-limit fields of the policy that refused."""
    seconds = max(1, math.ceil(retry_after))
    response = error_response(
        429,
        "rate_limited",
        f"Too many requests; try again in {seconds} second{'s' if seconds != 1 else ''}.",
        headers={"Retry-After": str(seconds)},
    )
    response.headers.extend(headers)
    return response


def rate_limit_unavailable() -> web.Response:
    return unavailable(1, "The gateway cannot check rate limits right now; try again shortly.")


def cors_refused(reason: str) -> web.Response:
    """A preflight the route's CORS policy does not allow: no CORS header, so the browser
    stops the actual request; the body says why for whoever reads it."""
    return error_response(
        403,
        "cors_refused",
        f"This cross-origin request is not allowed: {reason}.",
        headers={"Vary": "Origin"},
    )


def client_certificate_required() -> web.Response:
    """A route that requires a verified TLS client certificate, reached without one. No
    challenge: a bearer token would not help."""
    return error_response(
        403,
        "client_certificate_required",
        "This route needs a TLS client certificate the gateway has verified.",
    )
