-- The authorization server's schema on PostgreSQL, as SQLite's migrations 001 to 004 left it.
--
-- Secrets are stored as SHA-256 digests (bytea, 32 long), times as seconds since the epoch
-- (double precision, as the protocol's floats), scopes as space-separated text. Every table
-- whose rows have a lifetime has an index on the column purge_expired deletes by. States
-- are text with a CHECK, so that a state the program does not know is refused on write.

-- Authorization codes: single use (RFC 6749 §4.1.2).
CREATE TABLE codes (
    code_hash       bytea PRIMARY KEY,
    client_id       text NOT NULL,
    subject         text NOT NULL,
    redirect_uri    text NOT NULL,
    scope           text NOT NULL,
    audience        text NOT NULL,
    nonce           text,
    code_challenge  text,
    auth_time       double precision NOT NULL,
    expires_at      double precision NOT NULL,
    created_at      double precision NOT NULL,
    state           text NOT NULL DEFAULT 'issued' CHECK (state IN ('issued', 'consumed')),
    consumed_at     double precision
);
CREATE INDEX codes_by_expiry ON codes (expires_at);

-- Grants: every redeemed code or device code starts one. Its revocation lives here, once,
-- for its refresh family and the access tokens recorded under it.
CREATE TABLE grants (
    grant_id    text PRIMARY KEY,
    client_id   text NOT NULL,
    subject     text NOT NULL,
    created_at  double precision NOT NULL,
    expires_at  double precision NOT NULL,
    revoked_at  double precision
);
CREATE INDEX grants_by_expiry ON grants (expires_at);

-- The refresh tokens of a grant (its family), each remembering its successor so that a
-- retry within the grace window is told apart from a replay.
CREATE TABLE refresh_tokens (
    token_hash        bytea PRIMARY KEY,
    family_id         text NOT NULL REFERENCES grants (grant_id) ON DELETE CASCADE,
    client_id         text NOT NULL,
    subject           text NOT NULL,
    scope             text NOT NULL,
    audience          text NOT NULL,
    auth_time         double precision NOT NULL,
    created_at        double precision NOT NULL,
    expires_at        double precision NOT NULL,
    state             text NOT NULL CHECK (state IN ('active', 'rotated', 'revoked')),
    rotated_at        double precision,
    successor_hash    bytea,
    successor_sealed  bytea
);
CREATE INDEX refresh_tokens_by_family ON refresh_tokens (family_id);
CREATE INDEX refresh_tokens_by_expiry ON refresh_tokens (expires_at);

-- Access tokens worth remembering: issued under a grant, or revoked one by one (those of
-- client_credentials have no grant). No foreign key: a token outlives its grant's purge
-- only until it expires, and a revocation may name a token never recorded.
CREATE TABLE access_tokens (
    jti         text PRIMARY KEY,
    grant_id    text,
    client_id   text,
    expires_at  double precision NOT NULL,
    revoked     boolean NOT NULL DEFAULT false
);
CREATE INDEX access_tokens_by_grant ON access_tokens (grant_id);
CREATE INDEX access_tokens_by_expiry ON access_tokens (expires_at);

-- Consent: one row per scope, so granting more is a union by construction.
CREATE TABLE consents (
    subject     text NOT NULL,
    client_id   text NOT NULL,
    scope       text NOT NULL,
    granted_at  double precision NOT NULL,
    PRIMARY KEY (subject, client_id, scope)
);

CREATE TABLE sessions (
    session_hash  bytea PRIMARY KEY,
    subject       text NOT NULL,
    auth_time     double precision NOT NULL,
    expires_at    double precision NOT NULL,
    csrf_secret   bytea NOT NULL
);
CREATE INDEX sessions_by_expiry ON sessions (expires_at);

-- Throttle counters (protocol/throttle.py): one row per key, whatever the number of
-- attempts it counts. Callers of a key are serialised by a transaction-scoped advisory
-- lock on the key, which exists before the row does.
CREATE TABLE failures (
    key           text PRIMARY KEY,
    window_start  double precision NOT NULL,
    count         integer NOT NULL CHECK (count >= 0),
    last_attempt  double precision NOT NULL,
    expires_at    double precision NOT NULL
);
CREATE INDEX failures_by_expiry ON failures (expires_at);

-- Client assertion ids seen (RFC 7523 §3), until the assertion expires.
CREATE TABLE assertion_jtis (
    client_id   text NOT NULL,
    jti         text NOT NULL,
    expires_at  double precision NOT NULL,
    PRIMARY KEY (client_id, jti)
);
CREATE INDEX assertion_jtis_by_expiry ON assertion_jtis (expires_at);

-- Device authorization (RFC 8628). A user code names one code at a time; an expired code
-- gives its user code up when a new one takes it.
CREATE TABLE device_codes (
    device_code_hash  bytea PRIMARY KEY,
    user_code         text NOT NULL UNIQUE,
    client_id         text NOT NULL,
    scope             text NOT NULL,
    audience          text NOT NULL,
    state             text NOT NULL
                      CHECK (state IN ('pending', 'approved', 'denied', 'redeemed')),
    subject           text,
    poll_interval     double precision NOT NULL,
    last_poll         double precision,
    expires_at        double precision NOT NULL,
    created_at        double precision NOT NULL,
    auth_time         double precision
);
CREATE INDEX device_codes_by_expiry ON device_codes (expires_at);
