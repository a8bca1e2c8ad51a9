"""The two places where the public listener reaches inside aiohttp 3, kept here alone: an
aiohttp release that moves either breaks this module's test
(tests/gateway/test_aiohttp_private.py) by name, not the listener in some subtle way.

Public aiohttp has neither, for a low-level `web.Server` (no router or middleware between
the socket and the handler, which the public listener is for speed):
- a hook between the default fields a response's head gets (Date, Server, Content-Type) and
  its writing. `Application.on_response_prepare` is that hook for applications; aiohttp runs
  it from `BaseRequest._prepare_hook`, which `HeadSettlingRequest` overrides. The gateway
  needs it to take out the fields aiohttp adds to a relayed answer that its upstream did not
  send, and to set or remove the Server field of its own answers (`setdefault` in aiohttp
  puts its own name back in otherwise).
- a way for a request factory to tell a request the parser refused: aiohttp hands it the
  module constant `web_protocol.ERROR` (an HTTP/1.0 request), and the reason to the
  handler's `handle_error`. `http11_if_unparsable` answers such a request as HTTP/1.1.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.http import HttpVersion11, RawRequestMessage
from aiohttp.web_protocol import ERROR as _UNPARSABLE

# RFC 9110 §6.2: a server answers with the highest version it conforms to; the client's
# version of a request that could not be parsed is not known.
_UNPARSABLE_AS_11 = _UNPARSABLE._replace(version=HttpVersion11)


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
