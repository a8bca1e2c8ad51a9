-- PostgreSQL: as SQLite's migration 006.
-- Clients and users live in the store: seeded from the configuration file (managed_by
-- 'config') or created through the admin API ('api'), and looked up on every request, so
-- that a change is in force at once in every process on the database.
CREATE TABLE clients (
    client_id          text PRIMARY KEY,
    metadata           text NOT NULL,  -- JSON: RFC 7591 metadata but the id and the secret
    secret_sha256      bytea,
    managed_by         text NOT NULL CHECK (managed_by IN ('config', 'api')),
    created_at         double precision NOT NULL,
    updated_at         double precision NOT NULL,
    tokens_valid_from  double precision NOT NULL,
    version            integer NOT NULL
);

CREATE TABLE users (
    subject        text PRIMARY KEY,
    username       text NOT NULL UNIQUE,
    password_hash  text NOT NULL,
    claims         text NOT NULL,  -- JSON: the OpenID Connect claims
    roles          text NOT NULL,  -- JSON: a list of strings
    disabled       boolean NOT NULL DEFAULT false,
    managed_by     text NOT NULL CHECK (managed_by IN ('config', 'api')),
    created_at     double precision NOT NULL,
    updated_at     double precision NOT NULL,
    version        integer NOT NULL
);

-- Ending a user's sessions (grants are found by client and subject through the indexes of
-- the revocation events' migration).
CREATE INDEX sessions_by_subject ON sessions (subject);
