"""OAuth error kinds (RFC 6749 §4.1.2.1, §5.2; RFC 6750 §3.1; RFC 8628 §3.5; RFC 9449 §5, §8;
OIDC Core §3.1.2.6).

An endpoint raises OAuthError; one place per endpoint renders it: JSON for the token,
introspection and revocation endpoints, a redirect back to the client for authorization
errors once the redirect URI is trusted, an HTML page before that.
"""

from __future__ import annotations

import re
from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_REQUEST = "invalid_request"
    INVALID_CLIENT = "invalid_client"
    INVALID_GRANT = "invalid_grant"
    UNAUTHORIZED_CLIENT = "unauthorized_client"
    UNSUPPORTED_GRANT_TYPE = "unsupported_grant_type"
    UNSUPPORTED_RESPONSE_TYPE = "unsupported_response_type"
    INVALID_SCOPE = "invalid_scope"
    INVALID_TARGET = "invalid_target"  # RFC 8707 §2
    ACCESS_DENIED = "access_denied"
    SERVER_ERROR = "server_error"
    TEMPORARILY_UNAVAILABLE = "temporarily_unavailable"
    LOGIN_REQUIRED = "login_required"
    CONSENT_REQUIRED = "consent_required"
    INTERACTION_REQUIRED = "interaction_required"
    REQUEST_NOT_SUPPORTED = "request_not_supported"
    REQUEST_URI_NOT_SUPPORTED = "request_uri_not_supported"
    AUTHORIZATION_PENDING = "authorization_pending"
    SLOW_DOWN = "slow_down"
    EXPIRED_TOKEN = "expired_token"  # noqa: S105 (an error code, not a secret)
    INVALID_TOKEN = "invalid_token"  # noqa: S105
    INSUFFICIENT_SCOPE = "insufficient_scope"
    UNSUPPORTED_TOKEN_TYPE = "unsupported_token_type"  # noqa: S105
    INVALID_DPOP_PROOF = "invalid_dpop_proof"  # RFC 9449 §5, §7.1
    USE_DPOP_NONCE = "use_dpop_nonce"  # RFC 9449 §8, §9


# RFC 6749 §5.2: 400 for everything but invalid_client (401 when the client tried to
# authenticate with the Authorization header). RFC 6750 §3.1 for resource errors.
_STATUS = {
    ErrorCode.INVALID_CLIENT: 401,
    ErrorCode.INVALID_TOKEN: 401,
    ErrorCode.INSUFFICIENT_SCOPE: 403,
    ErrorCode.SERVER_ERROR: 500,
    ErrorCode.TEMPORARILY_UNAVAILABLE: 503,
}


# RFC 6749 §4.1.2.1, §5.2: error_description holds %x20-21 / %x23-5B / %x5D-7E only. `<`
# and `>` are in that set but out of ours too: a client may put the text into a page as it
# is, and none of our texts needs them.
_NOT_IN_DESCRIPTION = re.compile(r"[^\x20\x21\x23-\x3B\x3D\x3F-\x5B\x5D-\x7E]")


def safe_description(text: str) -> str:
    """`text` with every character error_description may not hold replaced by `?`.

    Descriptions are the server's own fixed texts and never quote the request; this is the
    one place that makes sure no endpoint can send a quote, markup or non-ASCII to a client
    (in a redirect, a JSON body or a WWW-Authenticate quoted-string) whatever it was given.
    """
    return _NOT_IN_DESCRIPTION.sub("?", text)


class OAuthError(Exception):
    def __init__(self, code: ErrorCode, description: str, *, status: int | None = None) -> None:
        description = safe_description(description)
        super().__init__(f"{code.value}: {description}")
        self.code = code
        self.description = description
        self.status = status if status is not None else _STATUS.get(code, 400)

    def body(self) -> dict[str, str]:
        return {"error": self.code.value, "error_description": self.description}


def invalid_request(description: str) -> OAuthError:
    return OAuthError(ErrorCode.INVALID_REQUEST, description)


def invalid_grant(description: str) -> OAuthError:
    return OAuthError(ErrorCode.INVALID_GRANT, description)


def invalid_scope(description: str) -> OAuthError:
    return OAuthError(ErrorCode.INVALID_SCOPE, description)


def invalid_client(description: str) -> OAuthError:
    return OAuthError(ErrorCode.INVALID_CLIENT, description)


class TemporarilyUnavailable(Exception):
    """The server cannot answer now but will soon by itself: its store failed, or every
    password-hashing slot is taken. Endpoints answer 503 with Retry-After: JSON
    `temporarily_unavailable` (RFC 6749 §4.1.2.1 names the code) or an error page."""

    def __init__(self, reason: str, *, retry_after: int = 1) -> None:
        super().__init__(reason)
        self.retry_after = retry_after
