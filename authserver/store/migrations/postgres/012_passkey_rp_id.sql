-- The relying party id (WebAuthn §5.1.2, the issuer's host) each passkey was created for: a
-- passkey signs only for that id, so one kept from before the issuer's host changed is no
-- factor any more. NULL for passkeys created before it was recorded, which are taken to be
-- for the id in force.
ALTER TABLE passkeys ADD COLUMN rp_id TEXT;
