"""The access log: one JSON object a line for every request the public listener answers, and
the little each request's log lines share (its id, and its client once known).

Fields: time, level (`info`), logger (`portcullis.authserver.access`) and message
(`request`), so that a line reads like any other of the log stream it may share; then
request_id, client (its address: the socket peer, or the client a trusted proxy names),
method, path, route (the route's name, `unmatched` when none serves the path), status,
client_id, total_ms. Never a secret, a token, a code, a password or a header
value: the path is written without the values of its query, and with only those parameter
names that an endpoint of this server reads (`QUERY_NAMES`; any other name is written `*`,
since a name, too, is whatever the sender put there). So `/authorize?code_challenge=…&x=…`
is logged as `/authorize?code_challenge&*`.

The request id is the `X-Request-Id` the request came with when it is well-formed (a front
proxy's), else a fresh one; the answer carries it back in `X-Request-Id`, and the audit
events written while the request is served name it (audit.py). The client id is the
client the server knows the request is from: authenticated (token, introspection,
revocation, device authorization, revocation events), or registered and named by an
authorization request. An id that failed authentication is never written there.

That state lives in a context variable, set by the middleware for the time of one request
(app.py): lines written deep in the domain, an audit event of a refresh token reused, carry
it without every call passing the request down.

Lines are buffered and written every `flush_interval` (or sooner when many are waiting):
the request path only appends to a buffer.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta

from portcullis.jsonlines import JsonLines
from portcullis.unique import UniqueBytes

_MAX_PATH = 512  # characters of a path written; what is longer is cut, marked with "…"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
REQUEST_ID_HEADER = "X-Request-Id"
LOGGER = "portcullis.authserver.access"
RANDOM = UniqueBytes()

# Parameter names the server's endpoints read from a query: the authorization request's
# (RFC 6749 §4.1.1, OIDC Core §3.1.2.1, RFC 7636, RFC 8707, RFC 9396), the logout's (OIDC
# RP-Initiated Logout §2), the device and account pages', and the admin API's collection
# parameters.
QUERY_NAMES = frozenset(
    {
        "response_type",
        "client_id",
        "redirect_uri",
        "scope",
        "state",
        "nonce",
        "code_challenge",
        "code_challenge_method",
        "prompt",
        "max_age",
        "login_hint",
        "id_token_hint",
        "ui_locales",
        "claims_locales",
        "display",
        "acr_values",
        "response_mode",
        "resource",
        "request",
        "request_uri",
        "claims",
        "authorization_details",
        "dpop_jkt",
        "post_logout_redirect_uri",
        "logout_hint",
        "user_code",
        "done",
        "limit",
        "cursor",
        "sort",
        "fields",
        "q",
        "id",
        "clientId",
        "subject",
        "username",
        "email",
        "name",
        "roles",
        "disabled",
        "managedBy",
        "grantTypes",
        "tokenEndpointAuthMethod",
        "applicationType",
        "kid",
        "alg",
    }
)


@dataclass(slots=True)
class Exchange:
    """What the log lines of one request share."""

    request_id: str
    client_id: str | None = None


CURRENT: ContextVar[Exchange | None] = ContextVar("portcullis_authserver_exchange", default=None)


def request_id_of(given: str | None) -> str:
    """The request's id: the one it came with when well-formed, else a fresh one."""
    if given is not None and _REQUEST_ID.fullmatch(given):
        return given
    return RANDOM.take(16).hex()


def client_known(client_id: str) -> None:
    """The request being served is from `client_id` (authenticated, or a registered client
    an authorization request names)."""
    exchange = CURRENT.get()
    if exchange is not None:
        exchange.client_id = client_id


def current_request_id() -> str | None:
    exchange = CURRENT.get()
    return exchange.request_id if exchange is not None else None


def logged_path(raw_path: str) -> str:
    """The path as the access log writes it: the query's known names only, never a value."""
    path, mark, query = raw_path.partition("?")
    if len(path) > _MAX_PATH:
        path = path[:_MAX_PATH] + "…"
    if not mark:
        return path
    names = []
    for pair in query.split("&"):
        if pair:
            name = pair.partition("=")[0]
            names.append(name if name in QUERY_NAMES else "*")
    return path + "?" + "&".join(names) if names else path


@dataclass(frozen=True, slots=True)
class AccessLogOptions:
    output: str  # stderr, stdout or a file path (appended to)
    flush_interval: timedelta


class AccessLog:
    def __init__(self, options: AccessLogOptions) -> None:
        self.output = options.output
        self._lines = JsonLines(options.output, options.flush_interval.total_seconds())

    def record(
        self,
        exchange: Exchange,
        *,
        client: str,
        method: str,
        raw_path: str,
        route: str,
        status: int,
        started: float,
        finished: float,
    ) -> None:
        """One line for a request answered at `finished` (time.perf_counter)."""
        self._lines.write(
            {
                "time": self._lines.time_of(finished),
                "level": "info",
                "logger": LOGGER,
                "message": "request",
                "request_id": exchange.request_id,
                "client": client,
                "method": method,
                "path": logged_path(raw_path),
                "route": route,
                "status": status,
                "client_id": exchange.client_id,
                "total_ms": int((finished - started) * 1_000_000) / 1000,
            }
        )

    def flush(self) -> None:
        self._lines.flush()

    def close(self) -> None:
        self._lines.close()
