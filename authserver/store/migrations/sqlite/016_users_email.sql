-- Users by their `email` claim, its ASCII letters without case: a federated sign-in looks
-- up the account an address links to (users_with_email) without reading every user.
CREATE INDEX users_email ON users (lower(json_extract(claims, '$.email')));
