"""The access log: one JSON object a line for every request, written in batches.

Fields: time, request_id, trace_id, client, mode, method, path, route, status, decision,
reason, subject, client_id, upstream_ms, total_ms. The mode is `proxy` for the public
listener and `ext_authz` for a decision asked by a front proxy, whose method and path are
those of the request the front proxy described. The path is logged without its query unless
`include_query` is set (a query may carry anything a client put there). A bearer token, a
client secret or any header value is never written. The subject can be replaced by an HMAC
of it (`subject: hashed`, keyed by `subject_hash_key`, so that a list of guessed subjects
cannot be hashed and matched), or left out.

Lines are buffered and written every `flush_interval` (or sooner when many are waiting):
the request path only appends to a list.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from typing import Any

from portcullis.jsonlines import JsonLines

from ..core.exchange import Exchange
from ..core.records import AccessLogOptions

_SUBJECTS_REMEMBERED = 16_384


class AccessLog:
    def __init__(self, settings: AccessLogOptions) -> None:
        self.settings = settings
        self._include_query = settings.include_query
        self._subject = settings.subject
        self._key = settings.subject_hash_key.encode()
        # subject -> its digest, for the latest subjects (ordered: the oldest found at once)
        self._hashed: OrderedDict[str, str] = OrderedDict()
        self._lines = JsonLines(settings.output, settings.flush_interval.total_seconds())

    def record(self, exchange: Exchange, status: int, finished: float) -> None:
        """One line for an exchange that ended at `finished` (time.perf_counter)."""
        principal = exchange.principal
        subject = client_id = None
        if principal is not None:
            client_id = principal.client_id
            if self._subject == "plain":
                subject = principal.subject
            elif self._subject == "hashed":
                subject = self._hashed.get(principal.subject)
                if subject is None:
                    subject = self._hash(principal.subject)
        upstream = exchange.upstream_seconds
        entry: dict[str, Any] = {
            "time": self._lines.time_of(finished),
            "request_id": exchange.request_id,
            "trace_id": exchange.trace_id,
            "client": exchange.client,
            "mode": exchange.mode,
            "method": exchange.method,
            "path": exchange.path if self._include_query else exchange.path.partition("?")[0],
            "route": exchange.route,
            "status": status,
            "decision": exchange.decision,
            "reason": exchange.reason,
            "subject": subject,
            "client_id": client_id,
            "upstream_ms": int(upstream * 1_000_000) / 1000 if upstream is not None else None,
            "total_ms": int((finished - exchange.started) * 1_000_000) / 1000,
        }
        self._lines.write(entry)

    def _hash(self, subject: str) -> str:
        """The subject's keyed digest, remembered for the most recent subjects."""
        digest = hmac.new(self._key, subject.encode(), hashlib.sha256).hexdigest()[:32]
        if len(self._hashed) >= _SUBJECTS_REMEMBERED:
            self._hashed.popitem(last=False)  # the oldest
        self._hashed[subject] = digest
        return digest

    def flush(self) -> None:
        self._lines.flush()

    def close(self) -> None:
        self._lines.close()
