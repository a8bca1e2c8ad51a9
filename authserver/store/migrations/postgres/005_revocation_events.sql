-- Revocation events: what was revoked, in the order it was committed, for the resource
-- servers that validate tokens themselves (authserver/events.py streams them). Each row is
-- written in the transaction of the revocation it reports, after that transaction took the
-- events' advisory lock (store/postgres.py), so ids are committed in increasing order and
-- a reader that saw id N never finds a smaller one committed later. Writing one notifies
-- the channel portcullis_revocation_events at commit (every replica LISTENs).
CREATE TABLE revocation_events (
    event_id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind           text NOT NULL CHECK (kind IN ('tokens', 'subject', 'client')),
    reason         text NOT NULL,
    -- kind 'tokens': a JSON array of [jti, exp]; the others: the subject or client_id and
    -- the time before which every token of theirs was issued.
    tokens         jsonb NOT NULL DEFAULT '[]',
    key            text,
    issued_before  double precision,
    created_at     double precision NOT NULL,
    expires_at     double precision NOT NULL  -- when every token the event names has expired
);
CREATE INDEX revocation_events_by_expiry ON revocation_events (expires_at);
-- Cut-offs revoke the grants of a subject or a client: found by these.
CREATE INDEX grants_by_subject ON grants (subject);
CREATE INDEX grants_by_client ON grants (client_id);
