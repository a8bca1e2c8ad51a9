"""The receiver of the issuers' revocation events: subscription, SET verification, deny-set.

An issuer with `revocation_events` streams what it revokes as Server-Sent Events whose data
are Security Event Tokens (RFC 8417) signed with its JWKS keys (the authorization server's
events.py documents the event types). Each gateway process subscribes to each such issuer
(`RevocationStream`), verifies every SET, and keeps what they name in one `DenySet`:

- revoked tokens by `jti`, until the token has expired (its `exp` plus the issuer's leeway);
- subject and client cut-offs: every token of the subject (client) whose `iat` is before a
  time, until the last of them has expired.

The request path (pipeline.py, step 6) asks `DenySet.check(principal)` on every request,
verified-token cache hit or not: with no cut-off in force, one dictionary lookup. An entry
leaves the set when the tokens it names have expired; each issuer's entries are bounded by
`max_entries`, beyond which those expiring first are dropped, logged and counted.

The stream: GET with HTTP Basic, `Last-Event-ID` = the last event applied (so nothing is
missed across a reconnection; without it the issuer sends every unexpired entry first), read
until it ends or stays silent `idle_timeout`, then connected again with exponential backoff.
A comment line from the issuer means that everything committed so far has been sent: the
stream is then *synced*. Its lag is 0 while synced, else the time since it last was (or
since start). With `on_stream_down: fail`, an issuer whose lag passes `max_stream_lag` has
its tokens refused with 503 until the stream is synced again.

A SET that fails verification (signature, key, `typ`, issuer, shape) is ignored, counted and
logged, and does not move `Last-Event-ID`: only the signed `jti` of an applied event does.
One signed with a key not (yet) in the issuer's key set also ends the connection: the
stream resumes from the last applied event, so a later event cannot pass it by for good.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import heapq
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from portcullis.jose import (
    SIGNATURE_ALGORITHMS,
    NotAnObject,
    b64url_decode,
    compact_parts,
    is_low_s,
    json_object,
    verify_signature,
)

from ..core.clock import Now
from ..core.principal import Principal
from ..core.records import Issuer, KeySetTiming, RevocationEvents
from ..verifiers.jwks import FetchError, KeySet, discovery_urls, fetch_json, issuer_tls

log = logging.getLogger("portcullis.gateway.revocations")

TOKENS_REVOKED = "https://portcullis.dev/secevent/tokens-revoked"
SUBJECT_TOKENS_REVOKED = "https://portcullis.dev/secevent/subject-tokens-revoked"
CLIENT_TOKENS_REVOKED = "https://portcullis.dev/secevent/client-tokens-revoked"
# RFC 8417 §2.3 explicit typing; media types compare case-insensitively (RFC 8725 §3.11).
_SET_TYPES = frozenset({"secevent+jwt", "application/secevent+jwt"})

REVOKED = "token_revoked"
STREAM_DOWN = "revocations_unknown"

MAX_EVENT_BYTES = 4 * 1024 * 1024  # one SSE event; a grant's tokens, many thousands
MIN_BACKOFF = timedelta(milliseconds=200)
TICK = timedelta(milliseconds=250)  # expiry, cut-off state and lag are refreshed this often
CAP_LOG_INTERVAL = timedelta(minutes=1)
# Memory one revoked jti holds (its key, the issuer map, its place in the expiry heap), as
# measured with tracemalloc for 100,000 random 22-character jtis: 318 bytes.
DENY_ENTRY_BYTES = 330


class DenySet:
    """Revoked jtis and cut-offs of every issuer of one gateway process."""

    def __init__(self, now: Now = time.time) -> None:
        self._now = now  # the wall clock: the scale of exp and iat
        # jti -> {issuer: until}: a jti names a token of one issuer; the inner map is read
        # only on a hit.
        self._jtis: dict[str, dict[str, float]] = {}
        # (issuer, subject or client_id) -> (issued_before, until)
        self._subjects: dict[tuple[str, str], tuple[float, float]] = {}
        self._clients: dict[tuple[str, str], tuple[float, float]] = {}
        self._cutoffs = False  # any cut-off in force: checked only then
        self.failing: frozenset[str] = frozenset()  # issuers refused while their stream is down
        self._caps: dict[str, int] = {}
        self._entries: dict[str, int] = {}
        # Per issuer, (until, kind, key): what expires first is at the top.
        self._heaps: dict[str, list[tuple[float, str, str]]] = {}
        self.dropped: dict[str, int] = {}
        self._cap_logged: dict[str, float] = {}

    # ------------------------------------------------------------------ request path

    def check(self, principal: Principal) -> str | None:
        """Why the principal's token is refused (REVOKED, STREAM_DOWN), or None."""
        claims = principal.claims
        jti = claims.get("jti")
        if jti.__class__ is str:
            hit = self._jtis.get(jti)
            if hit is not None and principal.issuer in hit:
                return REVOKED
        if self._cutoffs and self._cut_off(principal, claims):
            return REVOKED
        if self.failing and principal.issuer in self.failing:
            return STREAM_DOWN
        return None

    def _cut_off(self, principal: Principal, claims: Mapping[str, Any]) -> bool:
        iat = claims.get("iat")
        # A token without a usable iat cannot show it came after a cut-off: it is covered.
        issued = iat if isinstance(iat, int | float) and not isinstance(iat, bool) else -math.inf
        issuer = principal.issuer
        cut = self._subjects.get((issuer, principal.subject))
        if cut is not None and issued < cut[0]:
            return True
        if principal.client_id is not None:
            cut = self._clients.get((issuer, principal.client_id))
            if cut is not None and issued < cut[0]:
                return True
        return False

    # ------------------------------------------------------------------ entries

    def limit(self, issuer: str, max_entries: int) -> None:
        self._caps[issuer] = max_entries

    def __len__(self) -> int:
        return sum(self._entries.values())

    def entries(self, issuer: str) -> int:
        return self._entries.get(issuer, 0)

    def revoke_token(self, issuer: str, jti: str, until: float) -> None:
        by_issuer = self._jtis.setdefault(jti, {})
        before = by_issuer.get(issuer)
        if before is not None and before >= until:
            return
        by_issuer[issuer] = until
        self._added(issuer, "jti", jti, until, new=before is None)

    def cut_off_subject(
        self, issuer: str, subject: str, issued_before: float, until: float
    ) -> None:
        self._cut(self._subjects, "sub", issuer, subject, issued_before, until)

    def cut_off_client(
        self, issuer: str, client_id: str, issued_before: float, until: float
    ) -> None:
        self._cut(self._clients, "client", issuer, client_id, issued_before, until)

    def _cut(
        self,
        table: dict[tuple[str, str], tuple[float, float]],
        kind: str,
        issuer: str,
        key: str,
        issued_before: float,
        until: float,
    ) -> None:
        before = table.get((issuer, key))
        if before is not None:
            issued_before, until = max(before[0], issued_before), max(before[1], until)
            if (issued_before, until) == before:
                return
        table[(issuer, key)] = (issued_before, until)
        self._cutoffs = True
        self._added(issuer, kind, key, until, new=before is None)

    def _added(self, issuer: str, kind: str, key: str, until: float, new: bool) -> None:
        heapq.heappush(self._heaps.setdefault(issuer, []), (until, kind, key))
        if new:
            self._entries[issuer] = self._entries.get(issuer, 0) + 1
        cap = self._caps.get(issuer)
        if cap is not None and self._entries[issuer] > cap:
            self._over_cap(issuer, cap)

    def _over_cap(self, issuer: str, cap: int) -> None:
        heap = self._heaps[issuer]
        while self._entries[issuer] > cap and heap:
            until, kind, key = heapq.heappop(heap)
            if self._remove(issuer, kind, key, until):
                self.dropped[issuer] = self.dropped.get(issuer, 0) + 1
        now = time.monotonic()
        if now - self._cap_logged.get(issuer, -math.inf) >= CAP_LOG_INTERVAL.total_seconds():
            self._cap_logged[issuer] = now
            log.warning(
                "revocation deny-set full: the entries expiring first are dropped",
                extra={"issuer": issuer, "max_entries": cap, "dropped": self.dropped[issuer]},
            )

    def _remove(self, issuer: str, kind: str, key: str, until: float) -> bool:
        """Remove the entry if `until` is still its time (a newer one was pushed again)."""
        if kind == "jti":
            by_issuer = self._jtis.get(key)
            if by_issuer is None or by_issuer.get(issuer) != until:
                return False
            del by_issuer[issuer]
            if not by_issuer:
                del self._jtis[key]
        else:
            table = self._subjects if kind == "sub" else self._clients
            entry = table.get((issuer, key))
            if entry is None or entry[1] != until:
                return False
            del table[(issuer, key)]
            self._cutoffs = bool(self._subjects or self._clients)
        self._entries[issuer] -= 1
        return True

    def prune(self) -> int:
        """Drop the entries whose tokens have all expired; how many."""
        now = self._now()
        removed = 0
        for issuer, heap in self._heaps.items():
            while heap and heap[0][0] <= now:
                until, kind, key = heapq.heappop(heap)
                removed += self._remove(issuer, kind, key, until)
        return removed

    def evicts(self, principal: Principal) -> bool:
        """Whether a cached principal is revoked (for caches to drop it)."""
        return self.check(principal) == REVOKED


# ---------------------------------------------------------------------------- SETs


class RejectedEvent(Exception):
    """A SET that is not applied: why, for the log (never the token itself)."""


class UnknownKey(RejectedEvent):
    """A SET signed with a key the issuer's key set does not hold (yet): the stream reads it
    again later rather than passing it by."""


def _json_object(part: str) -> dict[str, Any]:
    """The JSON object the event's header or payload encodes."""
    try:
        return json_object(part)
    except NotAnObject as exc:
        raise RejectedEvent(exc.problem.removeprefix("is ")) from None


async def verify_set(token: str, issuer: Issuer, keys: KeySet) -> dict[str, Any]:
    """The claims of a SET signed by the issuer, else RejectedEvent. The checks a JWT access
    token gets where they apply (RFC 8417 §4.1: a SET is validated as a JWT), with `typ`
    required to be secevent+jwt (§2.3) so that no other JWT of the issuer passes as one."""
    parts = compact_parts(token)
    if parts is None:
        raise RejectedEvent("not a signed JWT")
    header_b64, payload_b64, signature_b64 = parts
    header = _json_object(header_b64)
    alg = header.get("alg")
    if not isinstance(alg, str) or alg not in issuer.algorithms or alg not in SIGNATURE_ALGORITHMS:
        raise RejectedEvent("signing algorithm not accepted")
    if "crit" in header:
        raise RejectedEvent("critical header parameters")
    typ = header.get("typ")
    if not isinstance(typ, str) or typ.lower() not in _SET_TYPES:
        raise RejectedEvent("typ is not secevent+jwt")
    kid = header.get("kid")
    if kid is not None and not isinstance(kid, str):
        raise RejectedEvent("kid is not a string")
    try:
        signature = b64url_decode(signature_b64)
    except binascii.Error:
        raise RejectedEvent("signature is not base64url") from None
    key = keys.find(kid, alg)
    if key is None and (not keys.loaded or not keys.knows(kid)):
        await keys.refetch_for_unknown_kid()
        key = keys.find(kid, alg)
    if key is None:
        raise UnknownKey("signed with an unknown key")
    signing_input = token[: len(header_b64) + 1 + len(payload_b64)].encode()
    # An ECDSA signature's other spelling (r, n - s) verifies too; this project's
    # authorization server, the one issuer of these events, signs the low-S one alone, and
    # the other is no signature of it (portcullis/jose.py).
    if not is_low_s(alg, signature) or not verify_signature(alg, key.key, signing_input, signature):
        raise RejectedEvent("signature invalid")
    claims = _json_object(payload_b64)
    if claims.get("iss") != issuer.issuer:
        raise RejectedEvent("issued by another issuer")
    if not isinstance(claims.get("events"), dict) or len(claims["events"]) != 1:
        raise RejectedEvent("events claim is not one event")
    jti = claims.get("jti")
    # ASCII digits only: str.isdigit() also takes digits int() cannot read ("²"), and the id
    # is resumed from as a number.
    if not isinstance(jti, str) or not (jti.isascii() and jti.isdigit()) or len(jti) > 19:
        raise RejectedEvent("jti is not an event id")
    if "exp" in claims or "sub" in claims:
        # RFC 8417 §2.2/§4.2: a SET carries neither; a JWT that does is something else.
        raise RejectedEvent("exp or sub at the top level")
    return claims


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RejectedEvent("a time is not a number")
    return float(value)


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 1024:
        raise RejectedEvent("an identifier is not a string")
    return value


def apply_event(claims: Mapping[str, Any], issuer: Issuer, deny: DenySet) -> int:
    """Record what a verified SET names; the number of entries it named (0: an event type
    this gateway does not know, ignored as RFC 8417 §2.2 asks of receivers)."""
    ((uri, payload),) = claims["events"].items()
    if not isinstance(payload, dict):
        raise RejectedEvent("event payload is not an object")
    url = issuer.issuer
    leeway = issuer.leeway.total_seconds()  # a token is accepted until exp plus leeway
    if uri == TOKENS_REVOKED:
        tokens = payload.get("tokens")
        if not isinstance(tokens, list):
            raise RejectedEvent("tokens is not a list")
        named = [
            (_text(t.get("jti")), _number(t.get("exp"))) for t in tokens if isinstance(t, dict)
        ]
        if len(named) != len(tokens):
            raise RejectedEvent("a token is not an object")
        for jti, exp in named:
            deny.revoke_token(url, jti, exp + leeway)
        return len(named)
    if uri in (SUBJECT_TOKENS_REVOKED, CLIENT_TOKENS_REVOKED):
        subject = payload.get("subject")
        if not isinstance(subject, dict):
            raise RejectedEvent("subject is not an object")
        issued_before = _number(payload.get("issued_before"))
        until = _number(payload.get("exp")) + leeway
        if uri == SUBJECT_TOKENS_REVOKED:
            # RFC 9493 §3.2.5: iss_sub names the subject of one issuer: this one.
            if subject.get("format") != "iss_sub" or subject.get("iss") != url:
                raise RejectedEvent("subject is not an iss_sub of this issuer")
            deny.cut_off_subject(url, _text(subject.get("sub")), issued_before, until)
        else:
            if subject.get("format") != "opaque":
                raise RejectedEvent("client subject is not opaque")
            deny.cut_off_client(url, _text(subject.get("id")), issued_before, until)
        return 1
    return 0


# ---------------------------------------------------------------------------- the stream


@dataclass
class SseEvent:
    id: str | None = None
    event: str = "message"
    data: list[str] = field(default_factory=list)


class SseParser:
    """Server-Sent Events (HTML Living Standard §9.2.6): bytes in, events and comments out."""

    def __init__(self) -> None:
        # The unfinished last line, in the pieces it came in: joined once a line end arrives,
        # so that a line trickling in by small chunks is not copied again for each of them.
        self._pending: list[bytes] = []
        self._pending_size = 0
        self._event = SseEvent()
        self._size = 0

    def feed(self, chunk: bytes) -> Iterable[SseEvent | None]:
        """Each complete event, and None for each comment line. Linear in the bytes fed: each
        chunk is split into lines once, and only its unfinished tail is kept."""
        held_cr = bool(self._pending) and self._pending[-1].endswith(b"\r")
        if not held_cr and b"\n" not in chunk and b"\r" not in chunk:
            self._keep(chunk)
            return
        self._pending.append(chunk)
        lines = b"".join(self._pending).splitlines(keepends=True)  # only CR, LF and CRLF for bytes
        self._pending.clear()
        self._pending_size = 0
        # A line with no end is still coming; nor is one ending in CR at the very end of the
        # chunk: it may be the first half of a CRLF whose LF is in the next chunk.
        if lines and not lines[-1].endswith(b"\n"):
            self._keep(lines.pop())
        for raw in lines:
            cut = 2 if raw.endswith(b"\r\n") else 1
            line = raw[:-cut].decode("utf-8", "replace")
            if not line:
                event, self._event, self._size = self._event, SseEvent(), 0
                if event.data:
                    yield event
                continue
            if line.startswith(":"):
                yield None
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            # The whole line counts: a line with no value (`data`) still adds one to the event.
            self._size += len(line) + 1
            if self._size > MAX_EVENT_BYTES:
                raise ValueError("an event is too large")
            if name == "data":
                self._event.data.append(value)
            elif name == "id" and "\0" not in value:
                self._event.id = value
            elif name == "event":
                self._event.event = value

    def _keep(self, piece: bytes) -> None:
        self._pending.append(piece)
        self._pending_size += len(piece)
        if self._pending_size > MAX_EVENT_BYTES:
            raise ValueError("an event is too large")


class RevocationStream:
    """The subscription to one issuer's revocation events."""

    def __init__(
        self,
        issuer: Issuer,
        settings: RevocationEvents,
        jwks: KeySetTiming,
        deny: DenySet,
        session: aiohttp.ClientSession,
        monotonic: Now = time.monotonic,
        on_applied: Callable[[], None] = lambda: None,
    ) -> None:
        self.issuer = issuer
        self.settings = settings
        self.deny = deny
        self.keys = KeySet(issuer, jwks, session, monotonic, purpose="revocation events")
        self._session = session
        self._monotonic = monotonic
        self._tls = issuer_tls(issuer)
        self._on_applied = on_applied
        credentials = f"{settings.client_id}:{settings.client_secret}".encode()
        self._authorization = "Basic " + base64.b64encode(credentials).decode("ascii")
        deny.limit(issuer.issuer, settings.max_entries)
        self.last_event_id = 0
        self.connected = False
        self.synced = False
        self._synced_at = monotonic()  # lag counts from start until the first sync
        self.applied = 0
        self.rejected = 0
        self.connects = 0
        self.last_error: str | None = None
        self._runner: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return self.issuer.issuer

    def lag(self) -> float:
        """0 while synced, else the time since it last was (or since start)."""
        return 0.0 if self.synced else max(0.0, self._monotonic() - self._synced_at)

    def succeed(self, previous: RevocationStream) -> None:
        """Take over from the stream of the same issuer this one replaces (a reload changed
        its settings): not synced yet either, its lag goes on from where that one's was."""
        if not previous.synced:
            self._synced_at = min(self._synced_at, previous._synced_at)

    def failing(self) -> bool:
        return self.settings.on_stream_down == "fail" and (
            self.lag() > self.settings.max_stream_lag.total_seconds()
        )

    @property
    def running(self) -> bool:
        return self._runner is not None

    def start(self) -> None:
        if self._runner is None:
            self.keys.start()
            self._runner = asyncio.create_task(self._run(), name=f"revocation events {self.url}")

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
            self._runner = None
        await self.keys.close()

    async def _run(self) -> None:
        backoff = MIN_BACKOFF.total_seconds()
        while True:
            try:
                url = self.settings.url or await self._discover()
                if await self._follow(url):
                    backoff = MIN_BACKOFF.total_seconds()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.last_error = str(exc) or type(exc).__name__
            self._down()
            log.warning(
                "revocation events stream down; connecting again",
                extra={"issuer": self.url, "reason": self.last_error, "lag": round(self.lag(), 3)},
            )
            # Full jitter: many gateways cut off at once do not come back at once.
            await asyncio.sleep(random.uniform(backoff / 2, backoff))  # noqa: S311 - not security
            backoff = min(backoff * 2, self.settings.max_backoff.total_seconds())

    def _down(self) -> None:
        if self.synced:
            self._synced_at = self._monotonic()
        self.connected = self.synced = False

    async def _discover(self) -> str:
        timeout = self.keys.settings.fetch_timeout.total_seconds()
        problems = []
        for url in discovery_urls(self.url):
            try:
                document, _ = await fetch_json(self._session, url, timeout, self._tls)
            except FetchError as exc:
                problems.append(str(exc))
                continue
            if isinstance(document, dict) and document.get("issuer") == self.url:
                endpoint = document.get("revocation_events_endpoint")
                if not isinstance(endpoint, str):
                    problems.append(f"{url} has no revocation_events_endpoint")
                    continue
                scheme = urlsplit(endpoint).scheme
                # As for jwks_uri: https, unless the issuer itself is plain http (loopback)
                # or allow_http says the network is trusted.
                plain_ok = self.issuer.allow_http or urlsplit(self.url).scheme == "http"
                if scheme == "https" or (scheme == "http" and plain_ok):
                    return endpoint
                problems.append(f"{url} gives a revocation_events_endpoint that is not https")
            else:
                problems.append(f"{url} names another issuer")
        raise FetchError("discovery failed: " + "; ".join(problems))

    async def _follow(self, url: str) -> bool:
        """One connection, read until it ends; whether it got as far as being synced."""
        headers = {"Authorization": self._authorization, "Accept": "text/event-stream"}
        if self.last_event_id:
            headers["Last-Event-ID"] = str(self.last_event_id)
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.keys.settings.fetch_timeout.total_seconds(),
            sock_read=self.settings.idle_timeout.total_seconds(),
        )
        was_synced = False
        async with self._session.get(
            url, headers=headers, timeout=timeout, allow_redirects=False, ssl=self._tls
        ) as response:
            if response.status != 200:
                raise FetchError(f"{url} answered {response.status}")
            if response.content_type != "text/event-stream":
                raise FetchError(f"{url} did not answer text/event-stream")
            self.connected = True
            self.connects += 1
            parser = SseParser()
            async for chunk in response.content.iter_any():
                for item in parser.feed(chunk):
                    if item is None:
                        if not self.synced:
                            log.info(
                                "revocation events stream synced",
                                extra={"issuer": self.url, "last_event_id": self.last_event_id},
                            )
                        self.synced = was_synced = True
                    else:
                        await self._event(item)
            self.last_error = "the stream ended"
        return was_synced

    async def _event(self, item: SseEvent) -> None:
        try:
            claims = await verify_set("\n".join(item.data), self.issuer, self.keys)
            if item.id is not None and item.id != claims["jti"]:
                raise RejectedEvent("the event id is not the SET's jti")
            apply_event(claims, self.issuer, self.deny)
        except RejectedEvent as exc:
            self.rejected += 1
            log.warning("revocation event rejected", extra={"issuer": self.url, "reason": str(exc)})
            if isinstance(exc, UnknownKey):
                # Its key may not be loaded yet (a fetch failed, a rotation not seen): the
                # next applied event would move Last-Event-ID past it for good. The stream
                # ends instead and resumes from the last applied event, unsynced meanwhile.
                raise FetchError("a revocation event is signed with an unknown key") from None
            return
        self.applied += 1
        self.last_event_id = max(self.last_event_id, int(claims["jti"]))
        self._on_applied()


class Revocations:
    """The deny-set of this process and the subscriptions that fill it, one per issuer with
    `revocation_events`; kept across reloads while an issuer's settings stay the same."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        now: Now = time.time,
        monotonic: Now = time.monotonic,
        on_applied: Callable[[], None] = lambda: None,
    ) -> None:
        self.deny = DenySet(now)
        self._session = session
        self._monotonic = monotonic
        self._on_applied = on_applied
        self.streams: dict[tuple[object, ...], RevocationStream] = {}
        self._retired: list[RevocationStream] = []
        self._ticker: asyncio.Task[None] | None = None

    def configure(self, issuers: Iterable[Issuer], jwks: KeySetTiming) -> list[RevocationStream]:
        """Streams for these issuers: those whose settings are unchanged kept, new ones made
        (and returned, not started); the others are closed by `retire`."""
        wanted: dict[tuple[object, ...], RevocationStream] = {}
        made = []
        current = {stream.url: stream for stream in self.streams.values()}
        for issuer in issuers:
            if issuer.revocation_events is None:
                continue
            # What a stream depends on: the same values keep it (and its position) on reload.
            identity = (
                issuer.issuer,
                issuer.revocation_events,
                issuer.algorithms,
                issuer.leeway,
                issuer.allow_http,
                issuer.ca_file,
                issuer.jwks_uri,
                jwks,
            )
            stream = self.streams.get(identity)
            if stream is None:
                stream = RevocationStream(
                    issuer,
                    issuer.revocation_events,
                    jwks,
                    self.deny,
                    self._session,
                    self._monotonic,
                    self._on_applied,
                )
                previous = current.get(issuer.issuer)
                if previous is not None:
                    stream.succeed(previous)
                made.append(stream)
            wanted[identity] = stream
        self._retired.extend(s for key, s in self.streams.items() if key not in wanted)
        self.streams = wanted
        return made

    @property
    def active(self) -> bool:
        return bool(self.streams)

    def start(self) -> None:
        for stream in self.streams.values():
            stream.start()
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick(), name="revocation deny-set")

    async def retire(self) -> None:
        retired, self._retired = self._retired, []
        for stream in retired:
            await stream.close()

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
        for stream in [*self.streams.values(), *self._retired]:
            await stream.close()

    def refresh(self) -> None:
        """Drop expired entries; recompute which issuers are refused for a stream down."""
        self.deny.prune()
        failing = frozenset(s.url for s in self.streams.values() if s.failing())
        if failing != self.deny.failing:
            for url in failing - self.deny.failing:
                log.error(
                    "revocation events stream down past max_stream_lag: refusing the issuer's"
                    " tokens with 503",
                    extra={"issuer": url},
                )
            self.deny.failing = failing

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK.total_seconds())
            try:
                self.refresh()
            except Exception:
                log.exception("revocation deny-set upkeep failed")

    def state(self) -> dict[str, dict[str, Any]]:
        """Per issuer: the stream's state and lag, for /readyz."""
        return {
            s.url: {
                "state": "synced" if s.synced else "connected" if s.connected else "down",
                "lag_seconds": round(s.lag(), 3),
                "last_event_id": s.last_event_id,
                "entries": self.deny.entries(s.url),
                **({"last_error": s.last_error} if not s.synced and s.last_error else {}),
            }
            for s in self.streams.values()
        }

    def not_ready(self) -> dict[str, str]:
        """Issuers refused for a stream down (on_stream_down: fail)."""
        return {
            f"{url} revocation events": "stream down longer than max_stream_lag"
            for url in self.deny.failing
        }
