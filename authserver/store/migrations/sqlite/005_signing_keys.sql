-- The signing key ring kept in the database (keys.encryption_key without keys.dir): one
-- versioned set of keys, replaced under a compare-and-set on the version it was decided from.
CREATE TABLE signing_key_ring (
    id       INTEGER PRIMARY KEY CHECK (id = 1),
    version  INTEGER NOT NULL CHECK (version >= 0)
);
INSERT INTO signing_key_ring (id, version) VALUES (1, 0);

-- Private keys are sealed with AES-256-GCM under keys.encryption_key before they are
-- written (a random nonce per key, the kid as associated data).
CREATE TABLE signing_keys (
    kid                 TEXT PRIMARY KEY,
    alg                 TEXT NOT NULL,
    state               TEXT NOT NULL CHECK (state IN ('next', 'active', 'retired')),
    created_at          REAL NOT NULL,
    activate_at         REAL,
    retired_at          REAL,
    remove_after        REAL,
    sealed_private_key  BLOB NOT NULL
) WITHOUT ROWID;
-- At most one active key per algorithm, whatever a caller writes.
CREATE UNIQUE INDEX signing_keys_one_active ON signing_keys (alg) WHERE state = 'active';
