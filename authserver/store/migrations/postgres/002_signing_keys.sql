-- The signing key ring, shared by every replica: one versioned set of keys. A change
-- replaces the set under a compare-and-set on the version it was decided from, so two
-- replicas starting on an empty ring create one key per algorithm between them.
CREATE TABLE signing_key_ring (
    id       integer PRIMARY KEY CHECK (id = 1),
    version  bigint NOT NULL CHECK (version >= 0)
);
INSERT INTO signing_key_ring (id, version) VALUES (1, 0);

-- Private keys are sealed with AES-256-GCM under keys.encryption_key before they reach
-- the database (a random nonce per key, the kid as associated data).
CREATE TABLE signing_keys (
    kid                 text PRIMARY KEY,
    alg                 text NOT NULL,
    state               text NOT NULL CHECK (state IN ('next', 'active', 'retired')),
    created_at          double precision NOT NULL,
    activate_at         double precision,
    retired_at          double precision,
    remove_after        double precision,
    sealed_private_key  bytea NOT NULL
);
-- At most one active key per algorithm, whatever a caller writes.
CREATE UNIQUE INDEX signing_keys_one_active ON signing_keys (alg) WHERE state = 'active';
