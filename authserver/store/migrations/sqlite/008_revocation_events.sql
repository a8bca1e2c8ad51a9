-- Revocation events: what was revoked, in the order it was committed, for the resource
-- servers that validate tokens themselves (authserver/events.py streams them). Each row is
-- written in the transaction of the revocation it reports. AUTOINCREMENT: an id is never
-- handed out twice, even after the newest rows were purged, so a subscriber's last id stays
-- a position in the log; writers are serialised by the database's write lock, so ids are
-- committed in increasing order.
CREATE TABLE revocation_events (
    event_id       INTEGER PRIMARY KEY AUTOINCREMENT,
    kind           TEXT NOT NULL CHECK (kind IN ('tokens', 'subject', 'client')),
    reason         TEXT NOT NULL,
    -- kind 'tokens': a JSON array of [jti, exp]; the others: the subject or client_id and
    -- the time before which every token of theirs was issued.
    tokens         TEXT NOT NULL DEFAULT '[]',
    key            TEXT,
    issued_before  REAL,
    created_at     REAL NOT NULL,
    expires_at     REAL NOT NULL  -- when every token the event names has expired
);
CREATE INDEX revocation_events_by_expiry ON revocation_events (expires_at);
-- Cut-offs revoke the grants of a subject or a client: found by these.
CREATE INDEX grants_by_subject ON grants (subject);
CREATE INDEX grants_by_client ON grants (client_id);
