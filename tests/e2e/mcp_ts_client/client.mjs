// The official MCP TypeScript SDK's client, as an MCP client app uses it: an
// OAuthClientProvider of its own (here in memory) on the Streamable HTTP transport, given
// the MCP server's URL and nothing else. Driven by tests/e2e/test_mcp_clients.py.
//
// Input: argv[2], JSON {url, redirect, clientName, calls: [{name, arguments}]}, and
// clientMetadataUrl when the client is named by the URL of its metadata document.
// The user's part goes over stdio: for each authorization the SDK asks for, this prints
// {"authorize": URL} and reads back one line, the query of the redirect that ended it
// (JSON), as an app's local callback page would receive it. Last line printed: {"done":
// true, results, exchanges, authorizations, clientInformation} — each call's result or
// error, every HTTP exchange the SDK made, the authorization URLs it built, its
// registration.
import { createInterface } from 'node:readline';
import { randomBytes } from 'node:crypto';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { UnauthorizedError } from '@modelcontextprotocol/sdk/client/auth.js';

const request = JSON.parse(process.argv[2]);
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
const print = (value) => process.stdout.write(JSON.stringify(value) + '\n');

const exchanges = [];
async function recordingFetch(input, init) {
  const response = await fetch(input, init);
  const url = new URL(input instanceof Request ? input.url : String(input));
  url.search = '';
  exchanges.push({
    method: init?.method ?? (input instanceof Request ? input.method : 'GET'),
    url: url.href,
    status: response.status,
    challenge: response.headers.get('www-authenticate') ?? '',
    // A form-encoded request's parameters (the SDK's OAuth requests).
    form: init?.body instanceof URLSearchParams ? Object.fromEntries(init.body) : {},
  });
  return response;
}

class MemoryProvider {
  constructor() {
    this.authorizations = [];
    this.pending = undefined; // the state of the authorization the user is at
  }
  get redirectUrl() { return request.redirect; }
  // Used as the client_id where the authorization server supports metadata documents.
  get clientMetadataUrl() { return request.clientMetadataUrl; }
  get clientMetadata() {
    // A public native app receiving the redirect on a loopback port.
    return {
      client_name: request.clientName,
      redirect_uris: [request.redirect],
      grant_types: ['authorization_code', 'refresh_token'],
      response_types: ['code'],
      token_endpoint_auth_method: 'none',
      application_type: 'native',
    };
  }
  state() { return randomBytes(16).toString('base64url'); }
  clientInformation() { return this.client; }
  saveClientInformation(info) { this.client = info; }
  tokens() { return this.saved; }
  saveTokens(tokens) { this.saved = tokens; }
  saveCodeVerifier(verifier) { this.verifier = verifier; }
  codeVerifier() { return this.verifier; }
  redirectToAuthorization(url) {
    this.authorizations.push(url.href);
    this.pending = url.searchParams.get('state');
    print({ authorize: url.href });
  }
  // The redirect the user's browser ended on; the code, once its state is checked.
  async callback() {
    const { value, done } = await lines.next();
    if (done) throw new Error('no redirect came back');
    const query = JSON.parse(value);
    if (query.state !== this.pending) throw new Error(`state mismatch: ${query.state}`);
    if (!query.code) throw new Error(`authorization refused: ${query.error}: ${query.error_description}`);
    return query.code;
  }
}

const provider = new MemoryProvider();
const url = new URL(request.url);
const newTransport = () =>
  new StreamableHTTPClientTransport(url, { authProvider: provider, fetch: recordingFetch });
const client = new Client({ name: request.clientName, version: '1.0.0' });

// What the SDK documents for an interactive app: an UnauthorizedError means the user was
// sent to authorize; once back, finishAuth(code) gets the tokens, and the app tries again.
let transport = newTransport();
try {
  await client.connect(transport);
} catch (error) {
  if (!(error instanceof UnauthorizedError)) throw error;
  await transport.finishAuth(await provider.callback());
  transport = newTransport();
  await client.connect(transport);
}

const results = [];
for (const call of request.calls) {
  try {
    let result;
    try {
      result = await client.callTool({ name: call.name, arguments: call.arguments ?? {} });
    } catch (error) {
      if (!(error instanceof UnauthorizedError)) throw error;
      await transport.finishAuth(await provider.callback());
      result = await client.callTool({ name: call.name, arguments: call.arguments ?? {} });
    }
    results.push({ name: call.name, result });
  } catch (error) {
    results.push({ name: call.name, error: `${error?.constructor?.name}: ${error?.message}` });
  }
}
await client.close();
print({
  done: true,
  results,
  exchanges,
  authorizations: provider.authorizations,
  clientInformation: provider.client ?? null,
});
process.exit(0);
