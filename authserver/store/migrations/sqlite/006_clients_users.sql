-- Clients and users live in the store: seeded from the configuration file (managed_by
-- 'config') or created through the admin API ('api'), and looked up on every request, so
-- that a change is in force at once in every process on the database.
CREATE TABLE clients (
    client_id          TEXT PRIMARY KEY,
    metadata           TEXT NOT NULL,  -- JSON: RFC 7591 metadata but the id and the secret
    secret_sha256      BLOB,
    managed_by         TEXT NOT NULL CHECK (managed_by IN ('config', 'api')),
    created_at         REAL NOT NULL,
    updated_at         REAL NOT NULL,
    tokens_valid_from  REAL NOT NULL,
    version            INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE users (
    subject        TEXT PRIMARY KEY,
    username       TEXT NOT NULL UNIQUE,
    password_hash  TEXT NOT NULL,
    claims         TEXT NOT NULL,  -- JSON: the OpenID Connect claims
    roles          TEXT NOT NULL,  -- JSON: a list of strings
    disabled       INTEGER NOT NULL DEFAULT 0,
    managed_by     TEXT NOT NULL CHECK (managed_by IN ('config', 'api')),
    created_at     REAL NOT NULL,
    updated_at     REAL NOT NULL,
    version        INTEGER NOT NULL
) WITHOUT ROWID;

-- Ending a user's sessions (grants are found by client and subject through the indexes of
-- the revocation events' migration).
CREATE INDEX sessions_by_subject ON sessions (subject);
