-- PostgreSQL: as SQLite's migration 010.
-- Second factors: a user's authenticator app (TOTP, RFC 6238) and their recovery codes,
-- and which methods each sign-in used (RFC 8176 `amr` values, space-separated; '' for
-- rows written before: those were password sign-ins).
--
-- The TOTP secret is sealed with AES-256-GCM before it reaches the database (the
-- encryption key of second_factors, a random nonce, the subject as associated data).
-- confirmed_at is NULL while the enrolment waits for its confirming code; last_step is
-- the latest time step accepted, so that no code is accepted twice.
CREATE TABLE totp_factors (
    subject        text PRIMARY KEY REFERENCES users (subject) ON DELETE CASCADE,
    sealed_secret  bytea NOT NULL,
    created_at     double precision NOT NULL,
    confirmed_at   double precision,
    last_step      bigint
);

-- SHA-256 digests of the recovery codes shown once at enrolment; used_at once used.
CREATE TABLE recovery_codes (
    subject      text NOT NULL REFERENCES totp_factors (subject) ON DELETE CASCADE,
    code_sha256  bytea NOT NULL,
    used_at      double precision,
    PRIMARY KEY (subject, code_sha256)
);

ALTER TABLE sessions ADD COLUMN amr text NOT NULL DEFAULT '';
ALTER TABLE codes ADD COLUMN amr text NOT NULL DEFAULT '';
ALTER TABLE device_codes ADD COLUMN amr text NOT NULL DEFAULT '';
ALTER TABLE refresh_tokens ADD COLUMN amr text NOT NULL DEFAULT '';
