-- Throttles charge an attempt before the guess is checked (protocol/throttle.py): a counter
-- also keeps when its latest attempt came, from which a backoff measures its delay.
ALTER TABLE failures ADD COLUMN last_attempt REAL NOT NULL DEFAULT 0;
UPDATE failures SET last_attempt = window_start;
