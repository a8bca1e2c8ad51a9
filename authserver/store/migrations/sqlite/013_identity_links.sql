-- Users who sign in through an upstream OpenID Connect provider: the provider's issuer and
-- its `sub` (together the identity, OIDC Core §5.7) name the local user they sign in as.
-- The local subject never follows the provider's claims; removing the user removes its links.
CREATE TABLE identity_links (
    issuer            TEXT NOT NULL,
    provider_subject  TEXT NOT NULL,
    subject           TEXT NOT NULL REFERENCES users (subject) ON DELETE CASCADE,
    created_at        REAL NOT NULL,
    PRIMARY KEY (issuer, provider_subject)
) WITHOUT ROWID;

CREATE INDEX identity_links_by_subject ON identity_links (subject);
