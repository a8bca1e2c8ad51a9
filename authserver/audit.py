"""Audit events: one format for everything an operator may have to account for later, who
signed in or failed to, what they consented to, which tokens were issued and revoked, and
what the admin API and the registration endpoint changed.

Each event is one JSON line on stderr, shaped like every line of the log stream
(portcullis.runtime's format): `time`, `level` (`info`; `warning` for the events that may
be an attack: throttled sign-ins, a refresh token or a code presented again), `logger`
(`portcullis.authserver.audit`) and `message` (the event's name again). They are written
whatever `log_level` says, and not through `logging`: its records cost ten times the line
itself, which the token endpoint, writing one per token, would feel. Lines go out at the
end of the event loop's turn they were written in (portcullis/jsonlines.py). The fields:

  event            what happened: one of `Event`'s values, `signin.failed` say
  actor            who did it: `user` (at the login form, or signed in), `client` (an
                   authenticated client), `admin` (a caller of the admin API) or `server`
                   (the server itself: a reused refresh token's family revoked)
  actor_client_id  for `admin`: the client of the caller's token
  actor_subject    for `admin`: the user of the caller's token, when it has one
  request_id       the request the event happened in (its X-Request-Id, accesslog.py)
and those of the event's own that are known: `client_id`, `subject`, `grant_id` (a grant,
which is also the id of its refresh family), `jti` (an access token's id), `kid`,
`grant_type`, `scope`, `reason`, `address` (the client address a sign-in came from),
`username_known` (a failed sign-in: whether the username names a user), `sessions` (how
many were ended), `revocation_event` (the id of the revocation event recorded) and
`factor` (the kind of second factor of a `factor.*` event: `passkey`; none for an
authenticator app's).

Never a secret, a password, a token, a code, a hash of any of them, or a username typed
into a failed sign-in (people type passwords there): tokens are named by their ids only.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any, Literal

from portcullis.jsonlines import JsonLines

from . import accesslog

LOGGER = "portcullis.authserver.audit"
LINES = JsonLines("stderr", 0.0)


class Event(enum.StrEnum):
    SIGNIN_SUCCEEDED = "signin.succeeded"
    SIGNIN_FAILED = "signin.failed"
    SIGNIN_THROTTLED = "signin.throttled"
    CONSENT_GIVEN = "consent.given"
    CONSENT_DENIED = "consent.denied"
    CONSENT_WITHDRAWN = "consent.withdrawn"
    TOKEN_ISSUED = "token.issued"  # noqa: S105 - an event name, not a secret
    TOKEN_REVOKED = "token.revoked"  # noqa: S105 - an access token revoked, by its jti
    GRANT_REVOKED = "grant.revoked"  # a grant: its refresh family and access tokens
    REFRESH_REUSED = "refresh.reused"  # a rotated refresh token again: its grant revoked
    CODE_REPLAYED = "code.replayed"  # a code (or device code) again: its grant revoked
    USER_CREATED = "user.created"
    USER_UPDATED = "user.updated"
    USER_DISABLED = "user.disabled"
    USER_PASSWORD_SET = "user.password_set"  # noqa: S105 - an event name
    USER_DELETED = "user.deleted"
    SESSIONS_ENDED = "sessions.ended"  # signed out by the user elsewhere (account page)
    USER_CUT_OFF = "user.cut_off"  # every token of the user revoked, sessions ended
    CLIENT_CREATED = "client.created"
    CLIENT_REGISTERED = "client.registered"  # by the client itself (RFC 7591)
    CLIENT_UPDATED = "client.updated"
    CLIENT_BLOCKED = "client.blocked"
    CLIENT_UNBLOCKED = "client.unblocked"
    CLIENT_SECRET_ROTATED = "client.secret_rotated"  # noqa: S105 - an event name
    CLIENT_DELETED = "client.deleted"
    CLIENT_CUT_OFF = "client.cut_off"  # every token of the client revoked
    KEY_PUBLISHED = "key.published"
    IDENTITY_LINKED = "identity.linked"  # an upstream provider's identity to an existing user
    FACTOR_ENROLLED = "factor.enrolled"  # an app confirmed by its first code; a passkey added
    FACTOR_REMOVED = "factor.removed"  # by the user (account page) or an admin
    RECOVERY_CODES_RENEWED = "factor.recovery_codes_renewed"  # the earlier ones void
    FACTOR_FAILED = "factor.failed"  # a wrong, replayed or out-of-window code
    FACTOR_THROTTLED = "factor.throttled"
    FACTOR_USED = "factor.used"  # a passkey signed a sign-in
    # A passkey's signature counter did not grow: its authenticator may have been cloned.
    FACTOR_SIGN_COUNT_REGRESSED = "factor.sign_count_regressed"
    RECOVERY_CODE_USED = "factor.recovery_code_used"


_WARNINGS = frozenset(
    {
        Event.SIGNIN_THROTTLED,
        Event.REFRESH_REUSED,
        Event.CODE_REPLAYED,
        Event.FACTOR_THROTTLED,
        Event.FACTOR_SIGN_COUNT_REGRESSED,
        Event.RECOVERY_CODE_USED,
        Event.IDENTITY_LINKED,
    }
)


@dataclass(frozen=True, slots=True)
class Actor:
    kind: Literal["user", "client", "admin", "server"]
    client_id: str | None = None  # for an admin: the client of the caller's token
    subject: str | None = None  # for an admin: the user of the caller's token


USER = Actor("user")
CLIENT = Actor("client")
SERVER = Actor("server")


def admin(client_id: str, subject: str | None) -> Actor:
    return Actor("admin", client_id, subject)


def record(
    event: Event,
    actor: Actor,
    *,
    client_id: str | None = None,
    subject: str | None = None,
    grant_id: str | None = None,
    jti: str | None = None,
    kid: str | None = None,
    grant_type: str | None = None,
    scope: str | None = None,
    reason: str | None = None,
    address: str | None = None,
    username_known: bool | None = None,
    sessions: int | None = None,
    revocation_event: int | None = None,
    factor: str | None = None,
) -> None:
    """Write one audit event. Every value is an id, a name or a count: nothing else is
    accepted, so no secret can be handed to it by mistake."""
    fields: dict[str, Any] = {
        "time": LINES.time_of(time.perf_counter()),
        "level": "warning" if event in _WARNINGS else "info",
        "logger": LOGGER,
        "message": event.value,
        "event": event.value,
        "actor": actor.kind,
        "request_id": accesslog.current_request_id(),
    }
    if actor.client_id is not None:
        fields["actor_client_id"] = actor.client_id
        fields["actor_subject"] = actor.subject
    for name, value in (
        ("client_id", client_id),
        ("subject", subject),
        ("grant_id", grant_id),
        ("jti", jti),
        ("kid", kid),
        ("grant_type", grant_type),
        ("scope", scope),
        ("reason", reason),
        ("address", address),
        ("username_known", username_known),
        ("sessions", sessions),
        ("revocation_event", revocation_event),
        ("factor", factor),
    ):
        if value is not None:
            fields[name] = value
    LINES.write(fields)
