// A DPoP client built on oauth4webapi, an independent OAuth library, run by
// tests/e2e/test_dpop.py against the authorization server (and the gateway).
//
// node client.mjs '<json>' where the JSON names:
//   issuer, client_id, client_secret (confidential), client_key (private_key_jwt: the
//   client's private EC P-256 JWK with its kid; the library's assertion, as it comes) or
//   neither (public),
//   key: the private EC P-256 JWK the proofs are signed with (the test knows its thumbprint),
//   mode: "client_credentials" | "code",
//   resource: a URL to GET with the token afterwards (the gateway), optional,
//   code: {callback, state, verifier, redirect_uri, nonce} for mode "code", and
//   refresh: true to refresh the tokens once afterwards.
// It prints one JSON object: what it got, or {error} with what the library threw.
import * as oauth from 'oauth4webapi';

const input = JSON.parse(process.argv[2]);
const insecure = { [oauth.allowInsecureRequests]: true }; // the servers listen on loopback http

async function importKeyPair(jwk) {
  const algorithm = { name: 'ECDSA', namedCurve: 'P-256' };
  const { d, ...pub } = jwk;
  const privateKey = await crypto.subtle.importKey('jwk', { ...pub, d }, algorithm, false, ['sign']);
  const publicKey = await crypto.subtle.importKey('jwk', pub, algorithm, true, ['verify']);
  return { privateKey, publicKey };
}

// RFC 9449 §8, §9: a server asking for a nonce is answered once more with it (the
// library keeps the nonce the answer carried). The retries are counted in the output.
const nonceRetries = [];
async function withNonceRetry(attempt, what) {
  try {
    return await attempt();
  } catch (err) {
    if (oauth.isDPoPNonceError(err)) {
      nonceRetries.push(what);
      return await attempt();
    }
    throw err;
  }
}

async function main() {
  const issuer = new URL(input.issuer);
  const as = await oauth.processDiscoveryResponse(
    issuer,
    await oauth.discoveryRequest(issuer, { algorithm: 'oidc', ...insecure }),
  );
  const client = { client_id: input.client_id };
  let auth = input.client_secret ? oauth.ClientSecretBasic(input.client_secret) : oauth.None();
  if (input.client_key) {
    const { privateKey } = await importKeyPair(input.client_key);
    auth = oauth.PrivateKeyJwt({ key: privateKey, kid: input.client_key.kid });
  }
  const DPoP = oauth.DPoP(client, await importKeyPair(input.key));
  const out = { jkt: await DPoP.calculateThumbprint() };

  let tokens;
  if (input.mode === 'client_credentials') {
    tokens = await withNonceRetry(async () =>
      oauth.processClientCredentialsResponse(
        as,
        client,
        await oauth.clientCredentialsGrantRequest(as, client, auth, new URLSearchParams(), {
          DPoP,
          ...insecure,
        }),
      ),
      'token',
    );
  } else {
    const c = input.code;
    const params = oauth.validateAuthResponse(as, client, new URL(c.callback), c.state);
    tokens = await withNonceRetry(async () =>
      oauth.processAuthorizationCodeResponse(
        as,
        client,
        await oauth.authorizationCodeGrantRequest(
          as,
          client,
          auth,
          params,
          c.redirect_uri,
          c.verifier,
          { DPoP, ...insecure },
        ),
        { expectedNonce: c.nonce, requireIdToken: true },
      ),
      'token',
    );
    const claims = oauth.getValidatedIdTokenClaims(tokens);
    const info = await withNonceRetry(async () =>
      oauth.processUserInfoResponse(
        as,
        client,
        claims.sub,
        await oauth.userInfoRequest(as, client, tokens.access_token, { DPoP, ...insecure }),
      ),
      'userinfo',
    );
    out.userinfo = info;
    if (input.refresh) {
      // RFC 9449 §5: a public client's refresh token needs a proof of the same key.
      const renewed = await withNonceRetry(async () =>
        oauth.processRefreshTokenResponse(
          as,
          client,
          await oauth.refreshTokenGrantRequest(as, client, auth, tokens.refresh_token, {
            DPoP,
            ...insecure,
          }),
        ),
        'refresh',
      );
      out.refreshed = { token_type: renewed.token_type, access_token: renewed.access_token };
      out.refresh_token = tokens.refresh_token;
    }
  }
  out.token_type = tokens.token_type;
  out.access_token = tokens.access_token;

  if (input.resource) {
    const response = await withNonceRetry(async () =>
      oauth.protectedResourceRequest(
        tokens.access_token,
        'GET',
        new URL(input.resource),
        new Headers(),
        null,
        { DPoP, ...insecure },
      ),
      'resource',
    );
    out.resource = { status: response.status, body: await response.text() };
  }
  out.nonce_retries = nonceRetries;
  return out;
}

main().then(
  (out) => console.log(JSON.stringify(out)),
  (err) => {
    console.log(JSON.stringify({ error: String(err), cause: err.cause ?? null }));
    process.exitCode = 1;
  },
);
