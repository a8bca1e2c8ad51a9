-- wrk script: every request is the same client_credentials token request.
--
--   wrk ... -s bench/token_post.lua -H "Authorization: Basic BASE64(id:secret)" URL
--
-- POST with a url-encoded body; the client authenticates with client_secret_basic, given on
-- the command line so that this script holds no secret. wrk builds the request once from
-- these fields and sends it on every connection.

wrk.method = "POST"
wrk.body = "grant_type=client_credentials&scope=bench:read"
wrk.headers["Content-Type"] = "application/x-www-form-urlencoded"
