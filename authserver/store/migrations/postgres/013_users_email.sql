-- Users by their `email` claim, without case: a federated sign-in looks up the account an
-- address links to (users_with_email) without reading every user.
CREATE INDEX users_email ON users (lower((claims::jsonb) ->> 'email'));
