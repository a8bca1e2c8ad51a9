// A company directory for the federation tests: panva's oidc-provider on a loopback port,
// with one confidential client (the Portcullis authorization server) and the accounts given.
//
//   DIRECTORY_CLIENT_SECRET=SECRET node directory.mjs --port PORT --redirect-uri URI \
//       --accounts '[{"sub": "...", "email": "...", "email_verified": true, ...}]'
//
// The person signing in is whoever the test names last with POST /_test/account {"sub": ...}:
// the interaction is finished at once (login and consent), so that a test can follow the
// redirects without a browser. As oidc-provider does by default, the ID token carries only
// `sub` and the protocol's claims: the profile and email are read from userinfo. It prints
// "listening" once it serves.

import { randomBytes } from 'node:crypto';
import { parseArgs } from 'node:util';
import Provider from 'oidc-provider';

const { values: args } = parseArgs({
  options: {
    port: { type: 'string' },
    'redirect-uri': { type: 'string' },
    accounts: { type: 'string' },
    'client-id': { type: 'string', default: 'portcullis' },
  },
});
for (const name of ['port', 'redirect-uri', 'accounts']) {
  if (!args[name]) {
    console.error(`directory.mjs: --${name} is required`);
    process.exit(2);
  }
}
const clientSecret = process.env.DIRECTORY_CLIENT_SECRET;
if (!clientSecret) {
  console.error('directory.mjs: set DIRECTORY_CLIENT_SECRET');
  process.exit(2);
}

const accounts = new Map(JSON.parse(args.accounts).map((account) => [account.sub, account]));
let current = null;

const issuer = `http://127.0.0.1:${args.port}`;
const provider = new Provider(issuer, {
  clients: [
    {
      client_id: args['client-id'],
      client_secret: clientSecret,
      token_endpoint_auth_method: 'client_secret_basic',
      grant_types: ['authorization_code'],
      response_types: ['code'],
      redirect_uris: [args['redirect-uri']],
    },
  ],
  claims: {
    openid: ['sub'],
    email: ['email', 'email_verified'],
    profile: ['name', 'preferred_username'],
  },
  cookies: { keys: [randomBytes(32).toString('base64url')] },
  features: { devInteractions: { enabled: false } },
  interactions: { url: (ctx, interaction) => `/interaction/${interaction.uid}` },
  pkce: { required: () => true },
  async findAccount(ctx, sub) {
    const account = accounts.get(sub);
    if (!account) return undefined;
    return { accountId: sub, async claims() { return { ...account } } };
  },
});

provider.use(async (ctx, next) => {
  if (ctx.method === 'POST' && ctx.path === '/_test/account') {
    const chunks = [];
    for await (const chunk of ctx.req) chunks.push(chunk);
    current = JSON.parse(Buffer.concat(chunks).toString()).sub;
    ctx.status = 204;
    return;
  }
  const found = ctx.path.match(/^\/interaction\/([^/]+)$/);
  if (!found) {
    await next();
    return;
  }
  const details = await provider.interactionDetails(ctx.req, ctx.res);
  if (!current || !accounts.has(current)) {
    ctx.status = 403;
    ctx.body = 'nobody is signing in';
    return;
  }
  const grant = new provider.Grant({ accountId: current, clientId: details.params.client_id });
  grant.addOIDCScope(details.params.scope);
  const grantId = await grant.save();
  const url = await provider.interactionResult(ctx.req, ctx.res, {
    login: { accountId: current },
    consent: { grantId },
  });
  ctx.redirect(url);
});

provider.listen(Number(args.port), '127.0.0.1', () => console.log('listening'));
