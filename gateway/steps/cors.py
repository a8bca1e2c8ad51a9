"""CORS for browsers calling the API through the gateway (the Fetch standard's CORS protocol).

A route's policy (or the global one) is compiled once. The gateway answers preflights
(`OPTIONS` with `Origin` and `Access-Control-Request-Method`) itself, without a token: a
browser never sends credentials on a preflight. Actual requests from an allowed origin get
`Access-Control-Allow-Origin` (and credentials and exposed headers when configured) on
whatever the answer is, the gateway's own refusals included, so that a page can read a 401
or a 429. A disallowed origin gets no CORS header at all. Every answer of a route with a
policy carries `Vary: Origin`, because it depends on the Origin.

Pure: works on header values, not on a request object.
"""

from __future__ import annotations

from ..core.records import Cors

_PREFLIGHT_VARY = ("Vary", "Origin, Access-Control-Request-Method, Access-Control-Request-Headers")
_VARY = ("Vary", "Origin")


class CorsRefused(Exception):
    """A preflight the policy does not allow; the message says which part."""


class CorsPolicy:
    def __init__(self, settings: Cors) -> None:
        self.settings = settings
        self._any_origin = settings.allow_origins == ("*",)
        self._origins = frozenset(settings.allow_origins)
        self._credentials = settings.allow_credentials
        self._methods = frozenset(settings.allow_methods)
        self._methods_value = ", ".join(settings.allow_methods)
        self._any_header = "*" in settings.allow_headers
        self._headers = frozenset(h.lower() for h in settings.allow_headers if h != "*")
        self._headers_value = ", ".join(h for h in settings.allow_headers if h != "*")
        self._max_age = str(int(settings.max_age.total_seconds()))
        # With any origin and no credentials the answer is the same for every origin.
        self._star = self._any_origin and not self._credentials
        extra: list[tuple[str, str]] = []
        if self._credentials:
            extra.append(("Access-Control-Allow-Credentials", "true"))
        self._common = tuple(extra)
        self._expose = (
            (("Access-Control-Expose-Headers", ", ".join(settings.expose_headers)),)
            if settings.expose_headers
            else ()
        )
        self._star_answer = (("Access-Control-Allow-Origin", "*"), *self._expose, _VARY)

    def allows(self, origin: str) -> bool:
        return self._any_origin or origin in self._origins

    def actual(self, origin: str | None) -> tuple[tuple[str, str], ...]:
        """Headers for the answer to an actual (non-preflight) request."""
        if origin is None or not self.allows(origin):
            return (_VARY,)
        if self._star:
            return self._star_answer
        return (("Access-Control-Allow-Origin", origin), *self._common, *self._expose, _VARY)

    def preflight(
        self, origin: str, method: str, request_headers: str | None
    ) -> list[tuple[str, str]]:
        """Headers of a 204 answering an allowed preflight; CorsRefused otherwise."""
        if not self.allows(origin):
            raise CorsRefused("the origin is not allowed")
        if method not in self._methods:
            raise CorsRefused(f"the method {method} is not allowed")
        asked = [h.strip().lower() for h in (request_headers or "").split(",") if h.strip()]
        if not self._any_header:
            for name in asked:
                if name not in self._headers:
                    raise CorsRefused(f"the header {name} is not allowed")
        allowed_headers = ", ".join(asked) if self._any_header else self._headers_value
        headers = [
            ("Access-Control-Allow-Origin", "*" if self._star else origin),
            ("Access-Control-Allow-Methods", self._methods_value),
            ("Access-Control-Max-Age", self._max_age),
            *self._common,
            _PREFLIGHT_VARY,
        ]
        if allowed_headers:
            headers.insert(2, ("Access-Control-Allow-Headers", allowed_headers))
        return headers
