"""Clients whose client_id is the https URL of their own metadata document
(draft-ietf-oauth-client-id-metadata-document), as MCP clients identify themselves.

`MetadataDocuments` is the server's client registry when such clients are enabled. For a
client_id, in order:
 1. one that does not say https:// is the store's (registry.StoredClients), as ever;
 2. it must be a document URL (protocol/client_ids.py), else it names no client;
 3. a client stored under it that is not a document's (configured, made through the admin
    API: the draft's pre-registered URLs) is that client; a document client the operator
    blocked is refused, and nothing is fetched for it;
 4. the document kept in memory while it is fresh;
 5. else the document is fetched (`DocumentFetcher`): the host policies; the host's
    addresses looked up by the server itself and every one checked (protocol/special_use.py)
    before any connection, unless the URL's origin is an allowed one; the connection made
    only to the addresses checked (its resolver knows no others), TLS verified for the
    URL's host; one GET, redirects never followed, at most `max_size` bytes, `timeout` for
    all of it; 200 the only success;
 6. the document checked (`client_of_document`): a JSON object whose `client_id` is the URL
    by simple string comparison (RFC 3986 §6.2.1); `redirect_uris` (matched exactly, the
    loopback any-port rule not given); no `client_secret`; `token_endpoint_auth_method`
    `none` (the default) or `private_key_jwt` with `jwks`, never a shared secret (draft
    §4.1); then what registration.py reads and offers, and every client's rules;
 7. the client stored (managed_by metadata_document: listed in the admin API, blockable),
    and kept in memory as long as its Cache-Control or Expires says, within
    [cache_min, cache_max]. A document whose keys or authentication method changed cuts
    off the tokens of the old one (draft §"Changes in Client Keys").
A refusal, at any step, is a `DocumentRefused`: counted (metrics.py), logged (host and
outcome, nothing of the document), nothing stored or kept, so the next request tries again.
The authorization endpoint shows it (`for_authorization`). The other endpoints (token,
revocation, ...) look clients up with `client`, which falls back to the client as last
stored when a known document cannot be fetched now (its server down or slow): a refresh
does not fail because of an outage of the client's web server. A document refused for what
it says, or for where it is, has no such fallback.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import math
import re
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import aiohttp
import orjson
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult
from multidict import CIMultiDictProxy

from .clock import Clock
from .events import Reason, Revocations
from .metrics import Metrics
from .protocol.client_ids import DocumentUrl, document_url, host_matches, names_document
from .protocol.special_use import special_use
from .registration import READ_METADATA, RegistrationError, declared_client, offered_scope
from .registry import Client, StoredClients, client_from_record, client_record, in_force
from .store.base import MANAGED_BY_METADATA_DOCUMENT, AlreadyExists, ClientRecord, Store

log = logging.getLogger("portcullis.authserver.metadata_documents")

GRANT_TYPES = frozenset({"authorization_code", "refresh_token"})
AUTH_METHODS = frozenset({"none", "private_key_jwt"})  # draft §4.1: no shared secret
# Fetch outcomes that say nothing about the document: a client stored before is used then.
TRANSIENT = frozenset({"dns_failed", "connect_failed", "timeout", "server_error"})
MAX_FETCHES = 8  # at once, over all URLs; more wait for one to end
_MAX_AGE = re.compile(r"(?:^|,)\s*max-age\s*=\s*\"?(\d+)\"?\s*(?:,|$)", re.IGNORECASE)


class DocumentRefused(Exception):
    """Why a document gives no client: `result` for the metrics and the log, `message` for
    the person on the error page."""

    def __init__(self, result: str, message: str) -> None:
        super().__init__(message)
        self.result = result
        self.message = message


# ---------------------------------------------------------------------------- fetching


@dataclass(frozen=True)
class FetchRules:
    """How documents are fetched, from the configuration."""

    timeout: timedelta
    max_size: int  # bytes
    hosts: tuple[tuple[str, bool], ...]  # (pattern, allowed), the first match decides
    allow_origins: frozenset[str]  # fetched even from special-use addresses
    tls: ssl.SSLContext

    def host_allowed(self, host: str) -> bool:
        for pattern, allowed in self.hosts:
            if host_matches(pattern, host):
                return allowed
        return True


@dataclass(frozen=True)
class Fetched:
    document: Any  # the parsed JSON
    fresh_for: float | None  # seconds, from Cache-Control or Expires; None when neither says


Lookup = Callable[[str, int], Awaitable[list[str]]]


async def system_lookup(host: str, port: int) -> list[str]:
    """The addresses of `host`, as the system's resolver gives them (a zone kept)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    found = []
    for family, _, _, _, sockaddr in infos:
        address = str(sockaddr[0])
        if family == socket.AF_INET6 and len(sockaddr) > 3 and sockaddr[3]:
            address += f"%{sockaddr[3]}"
        found.append(address)
    return list(dict.fromkeys(found))


class _Checked(AbstractResolver):
    """The resolver of one fetch's connection: it gives the addresses that were checked,
    whatever it is asked, so the connection cannot go anywhere else (no second lookup)."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self._addresses = addresses

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        return [
            ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                proto=socket.IPPROTO_TCP,
                flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
            )
            for address in self._addresses
        ]

    async def close(self) -> None:
        return None


class DocumentFetcher:
    """Step 5 of the module docstring."""

    def __init__(self, rules: FetchRules, lookup: Lookup = system_lookup) -> None:
        self.rules = rules
        self.lookup = lookup

    async def fetch(self, target: DocumentUrl) -> Fetched:
        rules = self.rules
        try:
            async with asyncio.timeout(rules.timeout.total_seconds()):
                addresses = await self._addresses(target)
                return await self._get(target, addresses)
        except TimeoutError:
            raise DocumentRefused(
                "timeout",
                f"The application's description at {target.shown_host} did not arrive in "
                f"{rules.timeout.total_seconds():g} seconds.",
            ) from None

    async def _addresses(self, target: DocumentUrl) -> list[str]:
        """The addresses the fetch may connect to: the host's, each checked."""
        host = yarl.URL(target.url).raw_host or target.host
        if not self.rules.host_allowed(host):
            raise DocumentRefused(
                "host_denied", f"Applications from {target.shown_host} are not accepted here."
            )
        literal = special_use(host) != "not an IP address"
        try:
            addresses = [host] if literal else await self.lookup(host, target.port)
        except OSError:
            raise DocumentRefused(
                "dns_failed", f"The address of {target.shown_host} could not be found."
            ) from None
        if not addresses:
            raise DocumentRefused(
                "dns_failed", f"The address of {target.shown_host} could not be found."
            )
        if target.origin in self.rules.allow_origins:
            return addresses
        for address in addresses:
            why = special_use(address)
            if why is not None:
                log.warning(
                    "client metadata document refused: special-use address",
                    extra={"host": target.host, "address": address, "block": why},
                )
                raise DocumentRefused(
                    "address_refused",
                    f"The application's description is at {target.shown_host}, which is an "
                    "address this server does not fetch from (local or private networks).",
                )
        return addresses

    async def _get(self, target: DocumentUrl, addresses: list[str]) -> Fetched:
        rules = self.rules
        connector = aiohttp.TCPConnector(
            resolver=_Checked(addresses),
            ssl=rules.tls,
            use_dns_cache=False,
            force_close=True,
            limit=1,
        )
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
            try:
                async with session.get(
                    target.url,
                    allow_redirects=False,
                    headers={"Accept": "application/json", "Accept-Encoding": "identity"},
                ) as response:
                    body = await _bounded_body(response, rules.max_size, target)
                    return Fetched(_parsed(response, body, target), freshness(response.headers))
            except (aiohttp.ClientError, ssl.SSLError, OSError) as exc:
                log.info(
                    "client metadata document unreachable",
                    extra={"host": target.host, "reason": type(exc).__name__},
                )
                raise DocumentRefused(
                    "connect_failed",
                    f"The application's description at {target.shown_host} could not be "
                    "fetched (no secure connection could be made).",
                ) from None


async def _bounded_body(
    response: aiohttp.ClientResponse, max_size: int, target: DocumentUrl
) -> bytes:
    if 300 <= response.status < 400:
        # Draft §4: never follow a redirect; the document lives at its URL.
        raise DocumentRefused(
            "redirect",
            f"The application's description at {target.shown_host} redirects elsewhere; "
            "it must be served at its own address.",
        )
    if response.status != 200:
        result = "server_error" if response.status >= 500 else "status"
        raise DocumentRefused(
            result,
            f"The application's description at {target.shown_host} could not be read "
            f"(HTTP {response.status}).",
        )
    too_large = DocumentRefused(
        "too_large",
        f"The application's description at {target.shown_host} is larger than {max_size} bytes.",
    )
    if response.content_length is not None and response.content_length > max_size:
        raise too_large
    body = b""
    while not response.content.at_eof():
        body += await response.content.read(max_size + 1 - len(body))
        if len(body) > max_size:
            raise too_large
    return body


def _parsed(response: aiohttp.ClientResponse, body: bytes, target: DocumentUrl) -> Any:
    # Draft §4.1: JSON, as application/json or a more specific application/*+json.
    media = response.content_type
    if media != "application/json" and not (
        media.startswith("application/") and media.endswith("+json")
    ):
        raise DocumentRefused(
            "not_json",
            f"The application's description at {target.shown_host} is not JSON ({media}).",
        )
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise DocumentRefused(
            "not_json", f"The application's description at {target.shown_host} is not JSON."
        ) from None


def freshness(headers: CIMultiDictProxy[str]) -> float | None:
    """How long a response may be kept, in seconds, as its Cache-Control (RFC 9111 §5.2.2:
    no-store and no-cache as none, else max-age) or else its Expires (against its Date, or
    the time now) says; None when neither says anything."""
    control = ",".join(headers.getall("Cache-Control", []))
    lowered = control.lower()
    if "no-store" in lowered or "no-cache" in lowered:
        return 0.0
    found = _MAX_AGE.search(control)
    if found:
        return float(found.group(1))
    expires = headers.get("Expires")
    if expires is not None:
        try:
            until = email.utils.parsedate_to_datetime(expires).timestamp()
            date = headers.get("Date")
            now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
        except (TypeError, ValueError, IndexError):
            return 0.0  # RFC 9111 §5.3: an invalid Expires is already expired
        return max(0.0, until - now)
    return None


# ---------------------------------------------------------------------------- checking


def client_of_document(
    target: DocumentUrl, document: Any, offered_scopes: frozenset[str], now: float
) -> ClientRecord:
    """Step 6 of the module docstring: the client a document describes, or DocumentRefused."""
    where = target.shown_host

    def invalid(problem: str) -> DocumentRefused:
        return DocumentRefused("invalid", f"The application's description at {where} {problem}")

    if not isinstance(document, dict):
        raise invalid("is not a JSON object.")
    if document.get("client_id") != target.url:
        # Simple string comparison: a document names the one URL it is served at.
        raise invalid("is for another client_id than its own address.")
    if "client_secret" in document or "client_secret_expires_at" in document:
        raise invalid("holds a client_secret, which a published document never may.")
    method = document.get("token_endpoint_auth_method", "none")
    if method not in AUTH_METHODS:
        raise invalid(
            "asks to authenticate with a shared secret; only none or private_key_jwt "
            "(with jwks) can be used without one."
        )
    if document.get("jwks_uri") is not None:
        raise invalid("names its keys by jwks_uri; this server takes them as jwks only.")
    redirects = document.get("redirect_uris")
    if not isinstance(redirects, list) or not redirects:
        raise invalid("has no redirect_uris.")
    grants = document.get("grant_types", ["authorization_code"])
    if not isinstance(grants, list) or not set(grants) <= GRANT_TYPES:
        raise invalid("asks for grant types other than authorization_code and refresh_token.")
    if document.get("response_types", ["code"]) != ["code"]:
        raise invalid('asks for response types other than ["code"].')
    name = document.get("client_name")
    if name is not None and not isinstance(name, str):
        raise invalid("has a client_name that is not text.")
    data = {k: document[k] for k in READ_METADATA if document.get(k) is not None}
    data["token_endpoint_auth_method"] = method
    try:
        data["scope"] = offered_scope(document.get("scope"), offered_scopes)
        # Read under a stand-in id: a URL may be longer than configured ids may be.
        declared = declared_client("metadata-document", data)
    except RegistrationError as exc:
        raise invalid(f"is not valid: {exc.description}") from None
    return replace(
        client_record(declared, MANAGED_BY_METADATA_DOCUMENT, now),
        client_id=target.url,
        secret_sha256=None,
    )


# ---------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class DocumentPolicy:
    offered_scopes: frozenset[str]
    cache_min: timedelta
    cache_max: timedelta

    def keep_for(self, fresh_for: float | None) -> float:
        """Seconds a fetched document is kept: what it said, within the bounds."""
        low, high = self.cache_min.total_seconds(), self.cache_max.total_seconds()
        return min(high, max(low, 0.0 if fresh_for is None else fresh_for))


class MetadataDocuments:
    """The client registry with metadata document clients (the module docstring's steps)."""

    def __init__(
        self,
        *,
        store: Store,
        stored: StoredClients,
        fetcher: DocumentFetcher,
        policy: DocumentPolicy,
        revocations: Revocations,
        metrics: Metrics,
        clock: Clock,
        keep: int = 1024,
    ) -> None:
        self.store = store
        self.stored = stored
        self.fetcher = fetcher
        self.policy = policy
        self.revocations = revocations
        self.metrics = metrics
        self.clock = clock
        self._keep = keep
        self._kept: OrderedDict[str, tuple[Client, float]] = OrderedDict()
        self._fetching: dict[str, asyncio.Task[Client]] = {}
        self._slots = asyncio.Semaphore(MAX_FETCHES)

    async def client(self, client_id: str) -> Client | None:
        """The client `client_id` names, for every endpoint but the authorization one."""
        if not names_document(client_id):
            return await self.stored.client(client_id)
        try:
            return await self._document_client(client_id, fallback=True)
        except DocumentRefused:
            return None

    async def for_authorization(self, client_id: str) -> Client | None:
        """As `client`, but a document refused now is said why (DocumentRefused), with no
        fallback: the user is about to consent to what the document says."""
        if not names_document(client_id):
            return await self.stored.client(client_id)
        return await self._document_client(client_id, fallback=False)

    async def _document_client(self, client_id: str, *, fallback: bool) -> Client | None:
        try:
            target = document_url(client_id)  # 2
        except ValueError as exc:
            raise DocumentRefused("invalid_url", f"The application's client_id: {exc}.") from None
        stored = await self.store.get_client(client_id)  # 3
        if stored is not None and stored.managed_by != MANAGED_BY_METADATA_DOCUMENT:
            return await self.stored.client(client_id)
        if stored is not None and stored.blocked:
            self._kept.pop(client_id, None)
            raise DocumentRefused(
                "blocked", f"Applications described at {client_id} are blocked on this server."
            )
        now = self.clock()
        kept = self._kept.get(client_id)  # 4
        if kept is not None and kept[1] > now:
            self._kept.move_to_end(client_id)
            return kept[0]
        try:
            return await self._fetch_once(target, stored)  # 5, 6, 7
        except DocumentRefused as refused:
            transient = fallback and refused.result in TRANSIENT
            if transient and stored is not None and in_force(stored, now):
                return client_from_record(stored)
            raise

    async def _fetch_once(self, target: DocumentUrl, stored: ClientRecord | None) -> Client:
        """One fetch per URL at a time: concurrent lookups share it."""
        running = self._fetching.get(target.url)
        if running is None:
            running = asyncio.ensure_future(self._fetch(target, stored))
            self._fetching[target.url] = running
            running.add_done_callback(lambda _: self._fetching.pop(target.url, None))
        return await asyncio.shield(running)

    async def _fetch(self, target: DocumentUrl, stored: ClientRecord | None) -> Client:
        async with self._slots:
            try:
                fetched = await self.fetcher.fetch(target)
                record = client_of_document(
                    target, fetched.document, self.policy.offered_scopes, self.clock()
                )
            except DocumentRefused as refused:
                self.metrics.metadata_document(refused.result)
                log.info(
                    "client metadata document refused",
                    extra={"host": target.host, "result": refused.result},
                )
                raise
        client = client_from_record(await self._remember(record, stored))
        keep_for = self.policy.keep_for(fetched.fresh_for)
        self.metrics.metadata_document("fetched")
        log.info(
            "client metadata document fetched",
            extra={"host": target.host, "kept_for": math.floor(keep_for)},
        )
        self._kept[target.url] = (client, self.clock() + keep_for)
        self._kept.move_to_end(target.url)
        if len(self._kept) > self._keep:
            self._kept.popitem(last=False)
        return client

    async def _remember(self, record: ClientRecord, stored: ClientRecord | None) -> ClientRecord:
        """Step 7: the client stored as the document describes it now. A document that
        changed its keys or authentication method cuts off what the old one obtained."""
        now = record.created_at
        for _ in range(3):
            if stored is None:
                try:
                    await self.store.save_client(record, None)
                    return record
                except AlreadyExists:  # another replica stored it first
                    stored = await self.store.get_client(record.client_id)
                    continue
            if stored.managed_by != MANAGED_BY_METADATA_DOCUMENT or stored.blocked:
                raise DocumentRefused(
                    "blocked", f"Applications described at {record.client_id} are blocked."
                )
            if stored.metadata == record.metadata:
                return stored
            rekeyed = any(
                stored.metadata.get(k) != record.metadata.get(k)
                for k in ("token_endpoint_auth_method", "jwks")
            )
            updated = replace(
                record,
                created_at=stored.created_at,
                tokens_valid_from=now if rekeyed else stored.tokens_valid_from,
                version=stored.version,
            )
            if await self.store.save_client(updated, stored.version):
                if rekeyed:
                    await self.revocations.cut_off_client(record.client_id, Reason.CLIENT_REKEYED)
                return replace(updated, version=stored.version + 1)
            stored = await self.store.get_client(record.client_id)
        raise DocumentRefused("conflict", "The application's description kept changing.")
