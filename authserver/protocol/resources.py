"""Protected resources (RFC 8707): the audience a request names with `resource`, and the
scopes a token for a resource registered with this server may carry.

A request names its audience with `resource` (at /authorize, /device_authorization and
/token), or gets the server's default audience without one. Allowed are the resources the
client lists among its own (`resources` of a client) and those registered with the server
(`resources` of the configuration): any client may ask for a registered one, which is how a
client that registered itself (RFC 7591, or a Client ID Metadata Document) gets a token for
an MCP server. Anything else is `invalid_target` (RFC 8707 §2).

The scope rule, for a token whose audience is a registered resource: each scope is one the
resource accepts (its `scopes`) or one of OpenID Connect's (`openid`, `profile`, `email`,
`address`, `phone`, `offline_access`), which are about the user's identity at this server
and the refresh token, not about the resource; any other is `invalid_scope`. Why: RFC 8707
§2 gives a request naming a resource the access rights of "the requested scope at the
requested resource", and the token is audience-restricted to it. A scope that resource does
not accept grants nothing there, and one another resource defines may mean something else
at this one (two servers are free to both name a scope `write`): issued anyway, it would
show the user a permission on the consent page that the token cannot or should not carry.
So the server refuses it, rather than narrowing in silence what the user is asked for.

Pure: standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .errors import ErrorCode, OAuthError, invalid_scope
from .scopes import STANDARD_SCOPES

# Scopes about the user's identity at this server (the ID token, userinfo) and refresh
# tokens (OIDC Core §5.4, §11): a token for any resource may carry them.
IDENTITY_SCOPES = frozenset(STANDARD_SCOPES)


@dataclass(frozen=True)
class ProtectedResource:
    """A resource registered with the server: its RFC 8707 identifier (the `aud` of tokens
    for it), what the consent page calls it, and the scopes it accepts."""

    uri: str
    name: str
    scopes: frozenset[str]

    def accepts(self, scope: str) -> bool:
        return scope in self.scopes or scope in IDENTITY_SCOPES


@dataclass(frozen=True)
class Target:
    """What a request is for: the audience of its tokens, and the registered resource that
    audience is, if it is one."""

    audience: str
    resource: ProtectedResource | None = None


class Audiences:
    """The server's default audience and its registered resources, built once per
    configuration."""

    def __init__(self, default: str, registered: Iterable[ProtectedResource] = ()) -> None:
        self.default = default
        self._registered: Mapping[str, ProtectedResource] = {r.uri: r for r in registered}

    def registered(self, audience: str) -> ProtectedResource | None:
        return self._registered.get(audience)

    def shown(self, audience: str) -> ProtectedResource | None:
        """What the consent page names as the resource of a request for `audience`: the
        registered resource, or one of a client's own by its URI; None for the default."""
        if audience == self.default:
            return None
        return self._registered.get(audience) or ProtectedResource(audience, audience, frozenset())

    def target(self, resource: str | None, client_resources: Iterable[str]) -> Target:
        """RFC 8707 §2: `resource` names the audience, and must be one of the client's own
        or a registered one (exact string comparison, as the `aud` will carry it)."""
        audience = self.default if resource is None else resource
        if resource is not None and not self.may_use(resource, client_resources):
            raise OAuthError(ErrorCode.INVALID_TARGET, "resource is not one this client may use")
        return Target(audience, self._registered.get(audience))

    def may_use(self, audience: str, client_resources: Iterable[str]) -> bool:
        """Whether a client listing `client_resources` may get tokens for `audience`."""
        return (
            audience == self.default
            or audience in self._registered
            or audience in set(client_resources)
        )


def check_scopes(target: Target, scopes: Iterable[str]) -> None:
    """The scope rule of the module docstring: invalid_scope for a scope the registered
    resource does not accept."""
    resource = target.resource
    if resource is not None and not all(resource.accepts(s) for s in scopes):
        # Not named: error_description never quotes what the request sent.
        raise invalid_scope("a requested scope is not one the requested resource accepts")


def within(target: Target, scopes: Iterable[str]) -> tuple[str, ...]:
    """`scopes` as far as the target accepts them: a client's default scopes (RFC 6749 §3.3,
    a request without `scope`) for a registered resource, or a grant's after the resource's
    scopes changed."""
    resource = target.resource
    return tuple(s for s in scopes if resource is None or resource.accepts(s))
