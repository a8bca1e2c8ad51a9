"""What the public listener refuses of a request's framing before any step runs. PURE.

The listener's parser (aiohttp's, strict) refuses what cannot be read one way only: both
Content-Length and Transfer-Encoding, two lengths, `chunked` twice or not last, a bad chunk
size. It still hands over two kinds of request whose framing the gateway will not pass on:

- A request line in a version other than HTTP/1.0 or HTTP/1.1: the HTTP/0.9 form (no
  version at all) and `HTTP/2.0` in an HTTP/1 request line. RFC 9112 §2.3 leaves a server
  free to refuse them, and the gateway speaks HTTP/1.1 to its upstream: passing either on as
  HTTP/1.1 would answer a request the client never made. 400 for a line without a version,
  505 for another version (RFC 9110 §15.6.6).
- Transfer codings other than `chunked` (RFC 9112 §7): the parser removes the chunked
  coding and leaves any coding before it (`gzip, chunked`) unremoved, so the bytes it hands
  on are still coded, and would go upstream as a plain body. RFC 9112 §6.1: a server that
  does not understand a transfer coding answers 501. And an HTTP/1.0 message with
  Transfer-Encoding is faulty framing whatever else it says (RFC 9112 §6.1): 400.

Each refusal closes the connection: where the next request would begin is not known.
"""

from __future__ import annotations

from collections.abc import Iterable

# The versions whose request line the listener serves.
SPOKEN = frozenset({(1, 0), (1, 1)})


def refusal(version: tuple[int, int], transfer_codings: Iterable[str]) -> tuple[int, str] | None:
    """The status and message refusing a request sent in `version` with these
    Transfer-Encoding field values, or None when its framing may go on."""
    if version not in SPOKEN:
        if version < (1, 0):
            return 400, "The request line has no HTTP version (HTTP/0.9 is not served)."
        return 505, "Only HTTP/1.0 and HTTP/1.1 request lines are served here."
    codings = [c.strip().lower() for value in transfer_codings for c in value.split(",")]
    if not codings:
        return None
    if version == (1, 0):
        return 400, "An HTTP/1.0 request may not carry Transfer-Encoding."
    if codings != ["chunked"]:
        return 501, "No transfer coding but chunked is accepted."
    return None
