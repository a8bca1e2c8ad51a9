"""HTML pages: rendering with the security headers every page carries, error pages, and the
503 page shown while the server is temporarily unavailable."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jinja2
from aiohttp import web

from ..protocol.errors import TemporarilyUnavailable
from .errors import Handler, log_unavailable

SECURITY_HEADERS = {
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
    "Pragma": "no-cache",
}


def page_environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).resolve().parent.parent / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )


def _origin(uri: str) -> str | None:
    parts = urlsplit(uri)
    if parts.scheme in ("http", "https") and parts.netloc:
        return f"{parts.scheme}://{parts.netloc}"
    return None


class Pages:
    """The server's pages: templates, and the static files under `static_path`."""

    def __init__(self, environment: jinja2.Environment, static_path: str) -> None:
        self.environment = environment
        self.static_path = static_path

    def render(
        self,
        template: str,
        *,
        status: int = 200,
        form_targets: Iterable[str] = (),
        **context: Any,
    ) -> web.Response:
        """An HTML page with the security headers every page carries.

        `form_targets` are URIs a form on the page may end up redirecting to (the client's
        redirect URI after consent): browsers apply `form-action` to redirects too.
        """
        body = self.environment.get_template(template).render(
            static=self.static_path, title=context.pop("title", "Portcullis"), **context
        )
        sources = ["'self'", *dict.fromkeys(o for o in map(_origin, form_targets) if o)]
        # A page with a passkey form runs this server's one script (static/passkeys.js),
        # which starts the browser's ceremony; every other page runs none.
        scripts = "script-src 'self'; " if context.get("passkey") or context.get("passkeys") else ""
        csp = (
            f"default-src 'none'; {scripts}style-src 'self'; img-src 'self'; "
            f"form-action {' '.join(sources)}; frame-ancestors 'none'; base-uri 'none'"
        )
        return web.Response(
            text=body,
            status=status,
            content_type="text/html",
            charset="utf-8",
            headers={"Content-Security-Policy": csp, **SECURITY_HEADERS},
        )

    def error(self, status: int, heading: str, message: str, code: str = "") -> web.Response:
        return self.render(
            "error.html",
            status=status,
            title=heading,
            heading=heading,
            message=message,
            code=code,
        )

    def unavailable(self, exc: TemporarilyUnavailable) -> web.Response:
        response = self.error(
            503,
            "Please try again in a moment",
            "The service cannot handle this right now. Nothing was changed: go back and "
            "try again in a moment.",
            "temporarily_unavailable",
        )
        response.headers["Retry-After"] = str(exc.retry_after)
        return response

    def guard(self, handler: Handler) -> Handler:
        """`handler`, answering the 503 page while the server is temporarily unavailable."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except TemporarilyUnavailable as exc:
                log_unavailable(request.path, exc)
                return self.unavailable(exc)

        return guarded
