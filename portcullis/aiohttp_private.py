"""The places where Portcullis reaches inside aiohttp 3, kept here alone: an aiohttp release
that moves one breaks this module's test (tests/test_aiohttp_private.py) by name, not a
listener in some subtle way.

Public aiohttp has none of these:
- a hook between the default fields a response's head gets (Date, Server, Content-Type) and
  its writing. `Application.on_response_prepare` is that hook for applications, but only
  for requests a route matched; aiohttp runs it from `BaseRequest._prepare_hook`, which
  `HeadSettlingRequest` overrides. The gateway needs it to take out the fields aiohttp adds
  to a relayed answer that its upstream did not send, and to set or remove the Server field
  of its own answers (`setdefault` in aiohttp puts its own name back in otherwise).
- a way for a request factory to tell a request the parser refused: aiohttp hands it the
  module constant `web_protocol.ERROR` (an HTTP/1.0 request), and the reason to the
  connection's `handle_error`. `http11_if_unparsable` answers such a request as HTTP/1.1.
- a way to answer those requests oneself. aiohttp answers them in HTTP/1.0, in text/plain
  that quotes the bytes it refused, under its own Server field, and logs each at level
  error with a traceback that quotes them too: a header line holding a token, an
  Authorization field with a stray control character, would be written to the log whole.
  A `RefusingConnection` answers them with a response of its server's making and logs one
  line with no byte of the request; `RefusingAppRunner` serves an Application on such
  connections.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.http import HttpVersion11, RawRequestMessage
from aiohttp.http_exceptions import BadHttpMethod
from aiohttp.web_protocol import ERROR as _UNPARSABLE

log = logging.getLogger("portcullis.http")

# RFC 9110 §6.2: a server answers with the highest version it conforms to; the client's
# version of a request that could not be parsed is not known.
_UNPARSABLE_AS_11 = _UNPARSABLE._replace(version=HttpVersion11)

# The answer to a request the parser refused, from the reason aiohttp gives (None: none).
Refuse = Callable[[BaseException | None], web.StreamResponse]
# The Server field of a listener's own answers, read at each answer ("": none).
ServerHeader = Callable[[], str]


def _no_server_header() -> str:
    return ""


def http11_if_unparsable(message: RawRequestMessage) -> RawRequestMessage:
    """The message a request factory was given, with version 1.1 when it stands for a
    request the parser refused."""
    return _UNPARSABLE_AS_11 if message is _UNPARSABLE else message


class HeadSettlingRequest(web.BaseRequest):
    """A request whose every answer passes through `settle(response)` after aiohttp has
    added its default fields and before the head is written."""

    def settle(self, response: web.StreamResponse) -> None:
        """The last changes to `response`'s head (subclasses say which)."""

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        self.settle(response)


class RefusingConnection(web.RequestHandler):
    """A connection whose requests the parser refused are answered with `refuse(reason)`,
    and logged once, at info, with the status and the reason's kind only. Failures of the
    server itself (500) stay aiohttp's, logged with their traceback."""

    __slots__ = ("_refuse",)  # as lean as aiohttp's own, one per connection

    def __init__(self, manager: web.Server, refuse: Refuse, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._refuse = refuse

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent on this connection")
        response = self._refuse(exc)
        # A method that is no method is mostly no HTTP at all (TLS to a plain port, a
        # scanner): aiohttp logs those at debug, so as not to fill the log with them.
        log.log(
            logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.INFO,
            "unparsable request refused",
            extra={"status": response.status, "reason": type(exc).__name__ if exc else "-"},
        )
        return response


class _RefusedRequest(HeadSettlingRequest):
    """The stand-in for a request the parser refused, on an Application's listener: no
    route matched it, so no `on_response_prepare` runs for its answer; the Server field
    aiohttp gives it is the listener's own here instead, or none."""

    ATTRS = HeadSettlingRequest.ATTRS | frozenset({"server_header"})
    server_header: ServerHeader = staticmethod(_no_server_header)

    def settle(self, response: web.StreamResponse) -> None:
        name = self.server_header()
        if name:
            response.headers["Server"] = name
        else:
            response.headers.popall("Server", None)


class _RefusingServer(web.Server):
    """The server aiohttp made for an Application, its connections `RefusingConnection`s."""

    refuse: Refuse

    def __call__(self) -> web.RequestHandler:
        return RefusingConnection(self, self.refuse, loop=self._loop, **self._kwargs)


class RefusingAppRunner(web.AppRunner):
    """An AppRunner whose connections answer the requests their parser refused with
    `refuse`, in HTTP/1.1, with `server_header()` as their Server field (none when it is
    empty)."""

    def __init__(
        self,
        app: web.Application,
        *,
        refuse: Refuse,
        server_header: ServerHeader = _no_server_header,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self._refuse = refuse
        self._server_header = server_header

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        if type(server) is not web.Server:
            # A subclass of aiohttp's own would lose what it overrides: refuse to start.
            raise RuntimeError(f"aiohttp made a {type(server).__name__}, not a web.Server")
        # aiohttp builds an Application's server itself (`Application._make_handler`), and
        # the server names the class of its connections. This one keeps every bit of its
        # state and makes RefusingConnections instead: a subclass with no state of its own
        # but `refuse`, so the class can be changed in place.
        server.__class__ = _RefusingServer
        cast(_RefusingServer, server).refuse = self._refuse
        app_requests = server.request_factory
        loop = asyncio.get_running_loop()
        server_header = self._server_header

        def request_factory(
            message: RawRequestMessage,
            payload: Any,
            protocol: web.RequestHandler,
            writer: Any,
            task: asyncio.Task[None],
        ) -> web.BaseRequest:
            if message is _UNPARSABLE:
                refused = _RefusedRequest(_UNPARSABLE_AS_11, payload, protocol, writer, task, loop)
                refused.server_header = server_header
                return refused
            return app_requests(message, payload, protocol, writer, task)

        # Read by each connection when it is made: set before the site accepts any.
        server.request_factory = request_factory
        return server
