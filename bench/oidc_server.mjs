// The reference token endpoint for the bench: panva's oidc-provider with one
// client_credentials client and JWT access tokens (RFC 9068) for one resource server.
//
//   BENCH_CLIENT_SECRET=SECRET node bench/oidc_server.mjs --modules DIR --port PORT \
//       --alg ES256|RS256 [--client-id bench] [--scope bench:read] [--audience bench-api] \
//       [--lifetime 300]
//
// DIR is the npm prefix oidc-provider was installed into (DIR/node_modules/oidc-provider).
// The client's secret comes from the environment, so that it does not show in `ps`.
// The signing keys (one P-256 key for ES256, one 2048-bit RSA key for RS256, as the Portcullis
// authserver has) are generated at start and published at /jwks. Every token request names
// no resource, so `defaultResource` picks the one resource server, whose `getResourceServerInfo`
// asks for a JWT signed with --alg, the audience and the scope. Such tokens are not stored:
// like the Portcullis authserver's client_credentials tokens, they stand on their signature.

import { generateKeyPairSync, randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';

const { values: args } = parseArgs({
  options: {
    modules: { type: 'string' },
    port: { type: 'string' },
    alg: { type: 'string', default: 'ES256' },
    'client-id': { type: 'string', default: 'bench' },
    scope: { type: 'string', default: 'bench:read' },
    audience: { type: 'string', default: 'bench-api' },
    lifetime: { type: 'string', default: '300' },
  },
});
for (const name of ['modules', 'port']) {
  if (!args[name]) {
    console.error(`oidc_server.mjs: --${name} is required`);
    process.exit(2);
  }
}
const clientSecret = process.env.BENCH_CLIENT_SECRET;
if (!clientSecret) {
  console.error('oidc_server.mjs: set BENCH_CLIENT_SECRET');
  process.exit(2);
}
if (!['ES256', 'RS256'].includes(args.alg)) {
  console.error('oidc_server.mjs: --alg must be ES256 or RS256');
  process.exit(2);
}

const entry = join(args.modules, 'node_modules', 'oidc-provider', 'lib', 'index.js');
const { default: Provider, errors } = await import(pathToFileURL(entry).href);

function signingKey(alg, kid) {
  const { privateKey } = alg === 'ES256'
    ? generateKeyPairSync('ec', { namedCurve: 'P-256' })
    : generateKeyPairSync('rsa', { modulusLength: 2048 });
  return { ...privateKey.export({ format: 'jwk' }), kid, alg, use: 'sig' };
}

const port = Number(args.port);
const issuer = `http://127.0.0.1:${port}`;
const resource = 'urn:portcullis-bench:resource';
const lifetime = Number(args.lifetime); // seconds, as the authserver's 5m

const provider = new Provider(issuer, {
  clients: [
    {
      client_id: args['client-id'],
      client_secret: clientSecret,
      token_endpoint_auth_method: 'client_secret_basic',
      grant_types: ['client_credentials'],
      response_types: [],
      redirect_uris: [],
      scope: args.scope,
    },
  ],
  jwks: { keys: [signingKey('ES256', 'bench-es256'), signingKey('RS256', 'bench-rs256')] },
  scopes: args.scope.split(' '),
  cookies: { keys: [randomBytes(32).toString('base64url')] },
  ttl: { ClientCredentials: (ctx, token) => token.resourceServer?.accessTokenTTL ?? lifetime },
  features: {
    devInteractions: { enabled: false },
    clientCredentials: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: () => resource,
      useGrantedResource: () => true,
      getResourceServerInfo: (ctx, indicator) => {
        if (indicator !== resource) {
          throw new errors.InvalidTarget();
        }
        return {
          scope: args.scope,
          audience: args.audience,
          accessTokenTTL: lifetime,
          accessTokenFormat: 'jwt',
          jwt: { sign: { alg: args.alg } },
        };
      },
    },
  },
});

const server = provider.listen(port, '127.0.0.1', () => {
  console.log(`oidc-provider ${args.alg} listening on ${issuer}`);
});
// Nothing to flush: stop at once, open keep-alive connections included.
for (const signal of ['SIGTERM', 'SIGINT']) {
  process.on(signal, () => {
    server.closeAllConnections();
    process.exit(0);
  });
}
