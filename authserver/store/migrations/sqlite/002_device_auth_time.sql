-- When the user who decided on a device code signed in: the auth_time of the tokens the
-- device gets (OpenID Connect Core §2), which may be long before the decision.
ALTER TABLE device_codes ADD COLUMN auth_time REAL;
