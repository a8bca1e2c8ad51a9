"""W3C Trace Context (https://www.w3.org/TR/trace-context/): the `traceparent` the upstream gets.

A valid incoming `traceparent` keeps its trace id and flags; the gateway is a hop of its
own, so the upstream is given a new parent id (the processing model: a participant that
passes the request on updates parent-id). An absent or invalid one starts a new trace, and
the client's `tracestate` is dropped with it: it describes a trace that is not continued.
A new trace is marked sampled, so that an upstream whose tracer follows its parent's
decision keeps recording as it did before the gateway was put in front of it.

Pure: no I/O beyond the operating system's random generator.
"""

from __future__ import annotations

import re

from portcullis.unique import UniqueBytes

# version "-" trace-id "-" parent-id "-" trace-flags, lower-case hex; a future
# version may append fields after a dash, version 00 may not.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE = "0" * 32
_ZERO_PARENT = "0" * 16
NEW_TRACE_FLAGS = "01"
# Trace and parent ids need to be unique, not secret (the request id is one of them too).
RANDOM = UniqueBytes()


def outgoing(incoming: str | None) -> tuple[str, str, bool]:
    """(trace id, traceparent for the upstream, whether a new trace was started)."""
    if incoming is not None:
        match = _TRACEPARENT.fullmatch(incoming.strip())
        if match is not None:
            version, trace_id, parent_id, flags, rest = match.groups()
            if (
                version != "ff"
                and not (version == "00" and rest)
                and trace_id != _ZERO_TRACE
                and parent_id != _ZERO_PARENT
            ):
                return trace_id, f"00-{trace_id}-{RANDOM.take(8).hex()}-{flags}", False
    random = RANDOM.take(24).hex()
    trace_id = random[:32]
    return trace_id, f"00-{trace_id}-{random[32:]}-{NEW_TRACE_FLAGS}", True
