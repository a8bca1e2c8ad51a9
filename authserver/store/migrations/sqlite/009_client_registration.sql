-- Clients that register themselves: by RFC 7591 dynamic registration (managed_by
-- 'dynamic', with the SHA-256 of the RFC 7592 registration access token) or by the Client
-- ID Metadata Document their client_id names ('metadata_document'). A client that
-- registered itself and has obtained no token yet is removed once unused_until is past;
-- blocked keeps a client and refuses it wherever it is named. SQLite changes a CHECK only
-- by rebuilding the table; nothing refers to it.
CREATE TABLE clients_registered (
    client_id                  TEXT PRIMARY KEY,
    metadata                   TEXT NOT NULL,
    secret_sha256              BLOB,
    managed_by                 TEXT NOT NULL
        CHECK (managed_by IN ('config', 'api', 'dynamic', 'metadata_document')),
    created_at                 REAL NOT NULL,
    updated_at                 REAL NOT NULL,
    tokens_valid_from          REAL NOT NULL,
    version                    INTEGER NOT NULL,
    registration_token_sha256  BLOB,
    unused_until               REAL,
    blocked                    INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;

INSERT INTO clients_registered (client_id, metadata, secret_sha256, managed_by, created_at,
    updated_at, tokens_valid_from, version)
SELECT client_id, metadata, secret_sha256, managed_by, created_at, updated_at,
    tokens_valid_from, version FROM clients;

DROP TABLE clients;
ALTER TABLE clients_registered RENAME TO clients;

-- The purge finds the clients that never obtained a token.
CREATE INDEX clients_by_unused_until ON clients (unused_until) WHERE unused_until IS NOT NULL;
