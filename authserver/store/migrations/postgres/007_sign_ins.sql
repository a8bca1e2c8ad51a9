-- PostgreSQL: as SQLite's migration 010.
-- Sign-ins of known users, succeeded or failed, for their account page: when, from which
-- client address and to which client. Never a password or the username typed. Kept until
-- expires_at, and at most the latest few per user (the store trims at each insert).
CREATE TABLE sign_ins (
    id          bigserial PRIMARY KEY,
    subject     text NOT NULL,
    at          double precision NOT NULL,
    outcome     text NOT NULL CHECK (outcome IN ('succeeded', 'failed')),
    address     text NOT NULL,
    client_id   text,
    expires_at  double precision NOT NULL
);
CREATE INDEX sign_ins_by_subject ON sign_ins (subject, at);
CREATE INDEX sign_ins_by_expiry ON sign_ins (expires_at);
