-- PostgreSQL: as SQLite's migration 009.
-- Clients that register themselves: by RFC 7591 dynamic registration (managed_by
-- 'dynamic', with the SHA-256 of the RFC 7592 registration access token) or by the Client
-- ID Metadata Document their client_id names ('metadata_document'). A client that
-- registered itself and has obtained no token yet is removed once unused_until is past;
-- blocked keeps a client and refuses it wherever it is named.
ALTER TABLE clients DROP CONSTRAINT clients_managed_by_check;
ALTER TABLE clients ADD CONSTRAINT clients_managed_by_check
    CHECK (managed_by IN ('config', 'api', 'dynamic', 'metadata_document'));
ALTER TABLE clients
    ADD COLUMN registration_token_sha256 bytea,
    ADD COLUMN unused_until double precision,
    ADD COLUMN blocked boolean NOT NULL DEFAULT false;

-- The purge finds the clients that never obtained a token.
CREATE INDEX clients_by_unused_until ON clients (unused_until) WHERE unused_until IS NOT NULL;
