-- Users by their `email` claim: a federated sign-in looks up the account an address links
-- to (users_with_email) without reading every user. `email_key` is the claim with its ASCII
-- letters in lower case (store.base.email_key), NULL when the claim is no string; the store
-- writes it with every user, and here it is filled in for the users there are (SQLite's
-- lower() folds ASCII letters alone unless it was built with ICU, which Python's is not).
ALTER TABLE users ADD COLUMN email_key TEXT;
UPDATE users SET email_key = lower(json_extract(claims, '$.email'))
    WHERE json_type(claims, '$.email') = 'text';
CREATE INDEX users_email_key ON users (email_key);
