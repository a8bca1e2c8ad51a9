-- Sign-ins of known users, succeeded or failed, for their account page: when, from which
-- client address and to which client. Never a password or the username typed. Kept until
-- expires_at, and at most the latest few per user (the store trims at each insert).
CREATE TABLE sign_ins (
    subject     TEXT NOT NULL,
    at          REAL NOT NULL,
    outcome     TEXT NOT NULL CHECK (outcome IN ('succeeded', 'failed')),
    address     TEXT NOT NULL,
    client_id   TEXT,
    expires_at  REAL NOT NULL
);
CREATE INDEX sign_ins_by_subject ON sign_ins (subject, at);
CREATE INDEX sign_ins_by_expiry ON sign_ins (expires_at);
