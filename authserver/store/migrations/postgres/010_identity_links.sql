-- Users who sign in through an upstream OpenID Connect provider: the provider's issuer and
-- its `sub` (together the identity, OIDC Core §5.7) name the local user they sign in as.
-- The local subject never follows the provider's claims; removing the user removes its links.
CREATE TABLE identity_links (
    issuer            text NOT NULL,
    provider_subject  text NOT NULL,
    subject           text NOT NULL REFERENCES users (subject) ON DELETE CASCADE,
    created_at        double precision NOT NULL,
    PRIMARY KEY (issuer, provider_subject)
);

CREATE INDEX identity_links_by_subject ON identity_links (subject);
