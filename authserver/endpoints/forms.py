"""Reading requests: url-encoded forms and queries, strictly (UTF-8, each parameter once),
and building redirect URIs with parameters."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from urllib.parse import parse_qsl, urlencode

from aiohttp import web

from ..protocol.errors import OAuthError, invalid_request

FORM = "application/x-www-form-urlencoded"
MAX_FORM_BYTES = 64 * 1024
MAX_FORM_FIELDS = 200

# The parameter names some endpoint reads. An error may name one of these; any other name
# came from the request alone, and error_description never quotes the request (RFC 6749
# §4.1.2.1 limits its characters, and the client may show it to its user).
KNOWN_PARAMETERS = frozenset(
    {
        "access_token",
        "acr_values",
        "client_assertion",
        "client_assertion_type",
        "client_id",
        "client_secret",
        "code",
        "code_challenge",
        "code_challenge_method",
        "code_verifier",
        "confirm",
        "csrf_token",
        "decision",
        "device_code",
        "dpop_jkt",
        "grant_type",
        "id_token_hint",
        "login_checked",
        "login_hint",
        "max_age",
        "nonce",
        "password",
        "pending_proof",
        "pending_subject",
        "pending_until",
        "post_logout_redirect_uri",
        "prompt",
        "redirect_uri",
        "refresh_token",
        "request",
        "request_uri",
        "resource",
        "response_mode",
        "response_type",
        "scope",
        "state",
        "token",
        "token_type_hint",
        "user_code",
        "username",
    }
)


def given_more_than_once(names: Iterable[str]) -> OAuthError:
    """invalid_request for repeated parameters (RFC 6749 §3.1), naming only known ones."""
    unique = set(names)
    parts = sorted(unique & KNOWN_PARAMETERS)
    if unique - KNOWN_PARAMETERS:
        parts.append("another parameter" if parts else "a parameter")
    verb = "is" if len(parts) == 1 else "are"
    return invalid_request(f"{' and '.join(parts)} {verb} given more than once")


def single_valued(items: Iterable[tuple[str, object]], where: str) -> dict[str, str]:
    """Pairs from `form_items` or `query_items` as a dict; a parameter given twice is invalid
    (RFC 6749 §3.1, §3.2)."""
    result: dict[str, str] = {}
    empty = False
    for key, value in items:
        if key in result:
            raise given_more_than_once([key])
        if not isinstance(value, str):
            raise invalid_request(f"{where} parameters must be text")
        result[key] = value
        empty = empty or not value
    # Empty values count as absent (RFC 6749 §3.1).
    return {k: v for k, v in result.items() if v != ""} if empty else result


async def form_items(request: web.Request) -> list[tuple[str, object]]:
    """The (name, value) pairs of a url-encoded POST body, repeats kept; other content types
    are refused."""
    if request.content_type != FORM:
        raise invalid_request(f"the request body must be {FORM}")
    if request.content_length is not None and request.content_length > MAX_FORM_BYTES:
        raise invalid_request("the request body is too large")
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise invalid_request("the request body is not a valid form") from None
    return body_items(body)


def body_items(body: bytes) -> list[tuple[str, object]]:
    """The (name, value) pairs of a url-encoded body that has been read whole."""
    if len(body) > MAX_FORM_BYTES:
        raise invalid_request("the request body is too large")
    try:
        # parse_qsl is what request.post() does for this content type, without building a
        # multidict and a multipart reader on every token request.
        return _pairs(body.decode("utf-8"))
    except ValueError:
        raise invalid_request("the request body is not a valid form") from None


def query_items(request: web.Request) -> list[tuple[str, object]]:
    """The (name, value) pairs of the query string, repeats kept, decoded as strictly as a
    form body. `request.query` would turn bytes that are not UTF-8 into U+FFFD, and so hand
    the client back a `state` other than the one it sent; such a query is refused."""
    _, _, query = request.raw_path.partition("?")
    try:
        if not query.isascii():  # a request target is ASCII (RFC 3986 §2)
            raise ValueError(query)
        return _pairs(query)
    except ValueError:
        raise invalid_request("the query is not valid UTF-8 form encoding") from None


def _pairs(text: str) -> list[tuple[str, object]]:
    """Url-encoded pairs; a percent-escape that is not UTF-8 raises ValueError."""
    if "%" in text or "+" in text:
        return list(
            parse_qsl(text, keep_blank_values=True, max_num_fields=MAX_FORM_FIELDS, errors="strict")
        )
    # Nothing to decode (a token request's usual form): the pairs parse_qsl would give,
    # without its per-field unquoting. Empty fields are skipped, a field without `=` has an
    # empty value, and too many fields are refused, as there.
    fields = text.split("&") if text else []
    if len(fields) > MAX_FORM_FIELDS:
        raise ValueError("Max number of fields exceeded")
    pairs: list[tuple[str, object]] = []
    for field in fields:
        if field:
            name, _, value = field.partition("=")
            pairs.append((name, value))
    return pairs


async def read_form(request: web.Request) -> dict[str, str]:
    """The url-encoded body of a POST; other content types are refused."""
    return single_valued(await form_items(request), "form")


def with_query(uri: str, params: Mapping[str, str | None]) -> str:
    """Append parameters to a URI that may already have a query (RFC 6749 §3.1)."""
    query = urlencode({k: v for k, v in params.items() if v is not None})
    separator = "&" if "?" in uri else "?"
    return uri + separator + query if query else uri
