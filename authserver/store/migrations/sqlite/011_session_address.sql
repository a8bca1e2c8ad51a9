-- The client address each login session signed in from, shown on the account page (empty
-- for anonymous sessions and for those that began before this migration).
ALTER TABLE sessions ADD COLUMN address TEXT NOT NULL DEFAULT '';
