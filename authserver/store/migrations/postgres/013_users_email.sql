-- Users by their `email` claim: a federated sign-in looks up the account an address links
-- to (users_with_email) without reading every user. `email_key` is the claim with its ASCII
-- letters in lower case (store.base.email_key), NULL when the claim is no string; the store
-- writes it with every user, and here it is filled in for the users there are. Claims that
-- hold an escaped NUL, which jsonb cannot read, get none until the user is next saved (CASE
-- keeps the cast from being tried on them).
ALTER TABLE users ADD COLUMN email_key text;
UPDATE users SET email_key = CASE
    WHEN position('\u0000' in claims) > 0 THEN NULL
    WHEN jsonb_typeof((claims::jsonb) -> 'email') = 'string'
        THEN translate((claims::jsonb) ->> 'email', 'ABCDEFGHIJKLMNOPQRSTUVWXYZ',
                       'abcdefghijklmnopqrstuvwxyz')
END;
CREATE INDEX users_email_key ON users (email_key);
