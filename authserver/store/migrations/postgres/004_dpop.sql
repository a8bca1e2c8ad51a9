-- DPoP (RFC 9449): the key an authorization code was bound to with dpop_jkt (§10), and the
-- key a refresh token is bound to (§5: the refresh tokens of public clients). Both hold the
-- key's JWK SHA-256 thumbprint (RFC 7638); NULL: not bound.
ALTER TABLE codes ADD COLUMN dpop_jkt text;
ALTER TABLE refresh_tokens ADD COLUMN dpop_jkt text;
