-- Second factors: a user's authenticator app (TOTP, RFC 6238) and their recovery codes,
-- and which methods each sign-in used (RFC 8176 `amr` values, space-separated; '' for
-- rows written before: those were password sign-ins).
--
-- The TOTP secret is sealed with AES-256-GCM before it is written (the encryption key of
-- second_factors, a random nonce, the subject as associated data): the store never sees
-- it in clear. confirmed_at is NULL while the enrolment waits for its confirming code;
-- last_step is the latest time step accepted, so that no code is accepted twice.
CREATE TABLE totp_factors (
    subject        TEXT PRIMARY KEY REFERENCES users (subject) ON DELETE CASCADE,
    sealed_secret  BLOB NOT NULL,
    created_at     REAL NOT NULL,
    confirmed_at   REAL,
    last_step      INTEGER
) WITHOUT ROWID;

-- SHA-256 digests of the recovery codes shown once at enrolment; used_at once used.
CREATE TABLE recovery_codes (
    subject      TEXT NOT NULL REFERENCES totp_factors (subject) ON DELETE CASCADE,
    code_sha256  BLOB NOT NULL,
    used_at      REAL,
    PRIMARY KEY (subject, code_sha256)
) WITHOUT ROWID;

ALTER TABLE sessions ADD COLUMN amr TEXT NOT NULL DEFAULT '';
ALTER TABLE codes ADD COLUMN amr TEXT NOT NULL DEFAULT '';
ALTER TABLE device_codes ADD COLUMN amr TEXT NOT NULL DEFAULT '';
ALTER TABLE refresh_tokens ADD COLUMN amr TEXT NOT NULL DEFAULT '';
