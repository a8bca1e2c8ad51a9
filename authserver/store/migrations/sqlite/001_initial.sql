-- The authorization server's first schema.
--
-- Secrets are stored as SHA-256 digests (BLOB), times as seconds since the epoch (REAL),
-- scopes as space-separated TEXT. Every table whose rows have a lifetime has an index on
-- the column purge_expired deletes by.

-- Authorization codes: single use (RFC 6749 §4.1.2).
CREATE TABLE codes (
    code_hash       BLOB PRIMARY KEY,
    client_id       TEXT NOT NULL,
    subject         TEXT NOT NULL,
    redirect_uri    TEXT NOT NULL,
    scope           TEXT NOT NULL,
    audience        TEXT NOT NULL,
    nonce           TEXT,
    code_challenge  TEXT,
    auth_time       REAL NOT NULL,
    expires_at      REAL NOT NULL,
    created_at      REAL NOT NULL,
    state           TEXT NOT NULL DEFAULT 'issued' CHECK (state IN ('issued', 'consumed')),
    consumed_at     REAL
) WITHOUT ROWID;
CREATE INDEX codes_by_expiry ON codes (expires_at);

-- A refresh-token family: every token rotated from one grant. Its absolute lifetime and its
-- revocation live here, once, rather than on each token.
CREATE TABLE refresh_families (
    family_id   TEXT PRIMARY KEY,
    client_id   TEXT NOT NULL,
    subject     TEXT NOT NULL,
    created_at  REAL NOT NULL,
    expires_at  REAL NOT NULL,
    revoked_at  REAL
) WITHOUT ROWID;
CREATE INDEX refresh_families_by_expiry ON refresh_families (expires_at);

CREATE TABLE refresh_tokens (
    token_hash        BLOB PRIMARY KEY,
    family_id         TEXT NOT NULL REFERENCES refresh_families (family_id) ON DELETE CASCADE,
    client_id         TEXT NOT NULL,
    subject           TEXT NOT NULL,
    scope             TEXT NOT NULL,
    audience          TEXT NOT NULL,
    auth_time         REAL NOT NULL,
    created_at        REAL NOT NULL,
    expires_at        REAL NOT NULL,
    state             TEXT NOT NULL CHECK (state IN ('active', 'rotated', 'revoked')),
    rotated_at        REAL,
    successor_sealed  BLOB
) WITHOUT ROWID;
CREATE INDEX refresh_tokens_by_family ON refresh_tokens (family_id);
CREATE INDEX refresh_tokens_by_expiry ON refresh_tokens (expires_at);

-- Revoked grants (a refresh family id or an id derived from a code). Kept apart from the
-- families so that a grant revoked before its family exists, or after its family was
-- purged, still makes the access tokens recorded under it inactive.
CREATE TABLE grant_revocations (
    grant_id    TEXT PRIMARY KEY,
    revoked_at  REAL NOT NULL
) WITHOUT ROWID;

-- Access tokens worth remembering: issued under a grant, or revoked one by one.
CREATE TABLE access_tokens (
    jti         TEXT PRIMARY KEY,
    grant_id    TEXT,
    client_id   TEXT,
    expires_at  REAL NOT NULL,
    revoked     INTEGER NOT NULL DEFAULT 0 CHECK (revoked IN (0, 1))
) WITHOUT ROWID;
CREATE INDEX access_tokens_by_grant ON access_tokens (grant_id);
CREATE INDEX access_tokens_by_expiry ON access_tokens (expires_at);

-- Consent: one row per scope, so granting more is a union by construction.
CREATE TABLE consents (
    subject     TEXT NOT NULL,
    client_id   TEXT NOT NULL,
    scope       TEXT NOT NULL,
    granted_at  REAL NOT NULL,
    PRIMARY KEY (subject, client_id, scope)
) WITHOUT ROWID;

CREATE TABLE sessions (
    session_hash  BLOB PRIMARY KEY,
    subject       TEXT NOT NULL,
    auth_time     REAL NOT NULL,
    expires_at    REAL NOT NULL,
    csrf_secret   BLOB NOT NULL
) WITHOUT ROWID;
CREATE INDEX sessions_by_expiry ON sessions (expires_at);

-- Failure counters in fixed windows: one row per key, whatever the number of failures.
CREATE TABLE failures (
    key           TEXT PRIMARY KEY,
    window_start  REAL NOT NULL,
    count         INTEGER NOT NULL,
    expires_at    REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX failures_by_expiry ON failures (expires_at);

-- Client assertion ids seen (RFC 7523 §3), until the assertion expires.
CREATE TABLE assertion_jtis (
    client_id   TEXT NOT NULL,
    jti         TEXT NOT NULL,
    expires_at  REAL NOT NULL,
    PRIMARY KEY (client_id, jti)
) WITHOUT ROWID;
CREATE INDEX assertion_jtis_by_expiry ON assertion_jtis (expires_at);

-- Device authorization (RFC 8628).
CREATE TABLE device_codes (
    device_code_hash  BLOB PRIMARY KEY,
    user_code         TEXT NOT NULL UNIQUE,
    client_id         TEXT NOT NULL,
    scope             TEXT NOT NULL,
    audience          TEXT NOT NULL,
    state             TEXT NOT NULL
                      CHECK (state IN ('pending', 'approved', 'denied', 'redeemed')),
    subject           TEXT,
    interval          REAL NOT NULL,
    last_poll         REAL,
    expires_at        REAL NOT NULL,
    created_at        REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX device_codes_by_expiry ON device_codes (expires_at);
