-- Grants: every redeemed code or device code starts one, created in the same transaction
-- as the code's consumption and the tokens it issues. Its revocation lives on it, once,
-- for its refresh family and the access tokens recorded under it. This replaces the
-- refresh families and the separate list of revoked grant ids, which existed so that a
-- grant revoked before its family was written would still count as revoked.
CREATE TABLE grants (
    grant_id    TEXT PRIMARY KEY,
    client_id   TEXT NOT NULL,
    subject     TEXT NOT NULL,
    created_at  REAL NOT NULL,
    expires_at  REAL NOT NULL,
    revoked_at  REAL
) WITHOUT ROWID;
CREATE INDEX grants_by_expiry ON grants (expires_at);

INSERT INTO grants (grant_id, client_id, subject, created_at, expires_at, revoked_at)
SELECT f.family_id, f.client_id, f.subject, f.created_at, f.expires_at,
       coalesce(f.revoked_at,
                (SELECT r.revoked_at FROM grant_revocations r WHERE r.grant_id = f.family_id))
FROM refresh_families f;

-- Grants that issued access tokens but no refresh token: known only from those tokens.
-- Their subject was not recorded; nothing reads it back for them.
INSERT INTO grants (grant_id, client_id, subject, created_at, expires_at, revoked_at)
SELECT a.grant_id, coalesce(max(a.client_id), ''), '', min(a.expires_at), max(a.expires_at),
       (SELECT r.revoked_at FROM grant_revocations r WHERE r.grant_id = a.grant_id)
FROM access_tokens a
WHERE a.grant_id IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM grants g WHERE g.grant_id = a.grant_id)
GROUP BY a.grant_id;

-- Refresh tokens now belong to a grant and remember their successor, so that a retry
-- within the grace window is told apart from a replay after the successor was used.
CREATE TABLE refresh_tokens_next (
    token_hash        BLOB PRIMARY KEY,
    family_id         TEXT NOT NULL REFERENCES grants (grant_id) ON DELETE CASCADE,
    client_id         TEXT NOT NULL,
    subject           TEXT NOT NULL,
    scope             TEXT NOT NULL,
    audience          TEXT NOT NULL,
    auth_time         REAL NOT NULL,
    created_at        REAL NOT NULL,
    expires_at        REAL NOT NULL,
    state             TEXT NOT NULL CHECK (state IN ('active', 'rotated', 'revoked')),
    rotated_at        REAL,
    successor_hash    BLOB,
    successor_sealed  BLOB
) WITHOUT ROWID;
INSERT INTO refresh_tokens_next (token_hash, family_id, client_id, subject, scope, audience,
    auth_time, created_at, expires_at, state, rotated_at, successor_sealed)
SELECT token_hash, family_id, client_id, subject, scope, audience, auth_time, created_at,
       expires_at, state, rotated_at, successor_sealed
FROM refresh_tokens;
DROP TABLE refresh_tokens;
ALTER TABLE refresh_tokens_next RENAME TO refresh_tokens;
CREATE INDEX refresh_tokens_by_family ON refresh_tokens (family_id);
CREATE INDEX refresh_tokens_by_expiry ON refresh_tokens (expires_at);

DROP TABLE refresh_families;
DROP TABLE grant_revocations;
