-- Passkeys (WebAuthn Level 3): any number per user, each under its credential id, which is
-- unique across users (WebAuthn §7.1 step 26). public_key is the credential's COSE_Key
-- (RFC 9052 §7) as the authenticator sent it; sign_count the latest signature counter
-- (§6.1.1); transports space-separated; backup_eligible and backed_up the BE and BS flags
-- of its authenticator data (§6.1); user_handle the `user.id` it was created with (random,
-- one per user). Removing the user removes their passkeys.
CREATE TABLE passkeys (
    credential_id    BLOB PRIMARY KEY,
    subject          TEXT NOT NULL REFERENCES users (subject) ON DELETE CASCADE,
    user_handle      BLOB NOT NULL,
    public_key       BLOB NOT NULL,
    sign_count       INTEGER NOT NULL,
    transports       TEXT NOT NULL,
    backup_eligible  INTEGER NOT NULL,
    backed_up        INTEGER NOT NULL,
    name             TEXT NOT NULL,
    created_at       REAL NOT NULL,
    last_used_at     REAL
) WITHOUT ROWID;

CREATE INDEX passkeys_by_subject ON passkeys (subject);
