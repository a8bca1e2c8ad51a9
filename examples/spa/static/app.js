// The orders single-page app: a public OAuth client in plain JavaScript.
//
// Sign-in is the authorization code flow with PKCE (RFC 7636), the challenge made with
// WebCrypto (S256). `state` ties the provider's answer to a sign-in this tab started
// (RFC 6749 §10.12); `nonce` ties the ID token to it (OpenID Connect Core §3.1.2.1).
//
// Tokens live in this module's memory only, never in localStorage or sessionStorage, where
// any script running on the origin could read them later: a reload forgets them and signs
// in again (without a password while the authorization server's session lasts). Only a
// sign-in in progress keeps its verifier, state and nonce in sessionStorage, to survive the
// redirect; they are removed as soon as the answer comes back.
//
// The token and revocation endpoints are the authorization server's, on its own origin: it
// lets this page read their answers (CORS) because this page's origin is that of the
// client's registered redirect URI. A form-encoded POST needs no preflight.
//
// The API is called through the gateway, another origin: the browser first asks it with a
// CORS preflight whether this origin may send an Authorization header, and the gateway's
// `cors` policy says yes.

const FLOW_KEY = "orders-spa:sign-in";
const SIGN_OUT_KEY = "orders-spa:sign-out";
// Refresh a little before the expiry the token endpoint announced: the clocks of the
// browser and the gateway differ, and a request takes time to arrive.
const REFRESH_MARGIN_MS = 2000;

let settings = null;
let tokens = null; // {accessToken, refreshToken, idToken, claims, expiresAt (ms)}

const $ = (id) => document.getElementById(id);

class SignInError extends Error {}

class TokenError extends Error {
  constructor(status, body) {
    super(`${body.error || "error"}: ${body.error_description || `status ${status}`}`);
    this.status = status;
    this.error = body.error;
  }
}

// A redirect to the authorization server is under way: nothing else to do on this page.
class Redirecting extends Error {}

// ------------------------------------------------------------------ encoding and PKCE

function base64url(bytes) {
  let text = "";
  for (const byte of bytes) text += String.fromCharCode(byte);
  return btoa(text).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function randomToken(size = 32) {
  return base64url(crypto.getRandomValues(new Uint8Array(size)));
}

// RFC 7636 §4.2: BASE64URL(SHA256(ASCII(code_verifier))).
async function s256(verifier) {
  const digest = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(verifier));
  return base64url(new Uint8Array(digest));
}

function jwtClaims(jwt) {
  const payload = jwt.split(".")[1].replace(/-/g, "+").replace(/_/g, "/");
  const bytes = Uint8Array.from(atob(payload), (c) => c.charCodeAt(0));
  return JSON.parse(new TextDecoder().decode(bytes));
}

// ------------------------------------------------------------------ the token endpoint

async function tokenRequest(form) {
  const response = await fetch(settings.tokenEndpoint, {
    method: "POST",
    headers: { "Content-Type": "application/x-www-form-urlencoded" },
    body: new URLSearchParams({ ...form, client_id: settings.clientId }),
    credentials: "omit", // a public client: no cookie, nothing but the form
  });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new TokenError(response.status, body);
  return body;
}

function keep(answer, claims) {
  tokens = {
    accessToken: answer.access_token,
    // Refresh tokens rotate: each answer's replaces the one used.
    refreshToken: answer.refresh_token || null,
    idToken: answer.id_token || tokens?.idToken || null,
    claims: claims || tokens?.claims || {},
    expiresAt: Date.now() + (answer.expires_in || 0) * 1000,
  };
}

// The ID token comes straight from the issuer's token endpoint, which vouches for it
// (OpenID Connect Core §3.1.3.7, item 6); what is left is to check that it is about this
// sign-in, for this client.
function checkIdToken(idToken, nonce) {
  if (!idToken) throw new SignInError("The provider sent no ID token.");
  const claims = jwtClaims(idToken);
  const audience = Array.isArray(claims.aud) ? claims.aud : [claims.aud];
  if (claims.iss !== settings.issuer) throw new SignInError("The ID token is from another issuer.");
  if (!audience.includes(settings.clientId)) {
    throw new SignInError("The ID token is meant for another client.");
  }
  if (typeof claims.exp !== "number" || claims.exp * 1000 <= Date.now()) {
    throw new SignInError("The ID token has expired.");
  }
  if (claims.nonce !== nonce) {
    throw new SignInError("The ID token was not issued for this sign-in (nonce).");
  }
  return claims;
}

// ------------------------------------------------------------------ sign-in

async function signIn() {
  const flow = { state: randomToken(), nonce: randomToken(), verifier: randomToken(48) };
  sessionStorage.setItem(FLOW_KEY, JSON.stringify(flow));
  const query = new URLSearchParams({
    response_type: "code",
    client_id: settings.clientId,
    redirect_uri: settings.redirectUri,
    scope: settings.scope,
    state: flow.state,
    nonce: flow.nonce,
    code_challenge: await s256(flow.verifier),
    code_challenge_method: "S256",
  });
  location.assign(`${settings.authorizationEndpoint}?${query}`);
  throw new Redirecting();
}

async function finishSignIn(params) {
  const saved = sessionStorage.getItem(FLOW_KEY);
  sessionStorage.removeItem(FLOW_KEY);
  // The code leaves the address bar and the history.
  history.replaceState(null, "", "/");
  const flow = saved ? JSON.parse(saved) : null;
  if (!flow || params.get("state") !== flow.state) {
    throw new SignInError("This answer belongs to no sign-in started here (state).");
  }
  // RFC 9207 §2.4: the answer names the issuer that sent it.
  if (settings.issParameterSupported && params.get("iss") !== settings.issuer) {
    throw new SignInError("This answer comes from another issuer (iss).");
  }
  if (params.has("error")) {
    const description = params.get("error_description");
    throw new SignInError(`Sign-in refused: ${params.get("error")}${description ? ` (${description})` : ""}`);
  }
  const answer = await tokenRequest({
    grant_type: "authorization_code",
    code: params.get("code") || "",
    redirect_uri: settings.redirectUri,
    code_verifier: flow.verifier,
  });
  keep(answer, checkIdToken(answer.id_token, flow.nonce));
}

// A new access token from the refresh token, or, without one that works, a new sign-in.
async function refresh() {
  if (tokens.refreshToken) {
    try {
      const answer = await tokenRequest({
        grant_type: "refresh_token",
        refresh_token: tokens.refreshToken,
      });
      keep(answer, null);
      return;
    } catch (error) {
      // invalid_grant: the refresh token expired or was revoked. Anything else is a fault.
      if (!(error instanceof TokenError && error.error === "invalid_grant")) throw error;
    }
  }
  tokens = null;
  await signIn();
}

async function accessToken() {
  if (Date.now() >= tokens.expiresAt - REFRESH_MARGIN_MS) await refresh();
  return tokens.accessToken;
}

// ------------------------------------------------------------------ the API

async function callApi(path) {
  const send = async () =>
    fetch(settings.api + path, {
      headers: { Authorization: `Bearer ${await accessToken()}` },
      credentials: "omit", // the token is the only credential
    });
  let response = await send();
  // The gateway refused the token (revoked, or expired earlier than this tab thought):
  // one refresh and one retry. The gateway's CORS policy exposes WWW-Authenticate.
  const challenge = response.headers.get("WWW-Authenticate") || "";
  if (response.status === 401 && challenge.includes('error="invalid_token"')) {
    await refresh();
    response = await send();
  }
  return response;
}

async function listOrders() {
  const response = await callApi("/orders?limit=10");
  const body = await response.json().catch(() => null);
  $("api-status").textContent = `GET /orders through the gateway: ${response.status}`;
  if (!response.ok) {
    throw new Error(body?.error?.message || `The orders API answered ${response.status}.`);
  }
  const rows = body.data.map((order) => {
    const row = document.createElement("tr");
    const total = `${(order.totalCents / 100).toFixed(2)} ${order.currency}`;
    for (const [text, number] of [
      [order.id, false],
      [order.item, false],
      [String(order.quantity), true],
      [total, true],
      [order.status, false],
    ]) {
      const cell = document.createElement("td");
      cell.textContent = text; // never HTML: the data is not ours
      if (number) cell.className = "number";
      row.append(cell);
    }
    return row;
  });
  $("orders").querySelector("tbody").replaceChildren(...rows);
  $("orders").hidden = false;
}

// ------------------------------------------------------------------ sign-out

async function signOut() {
  const { refreshToken, idToken } = tokens;
  tokens = null;
  // RFC 7009: the refresh token (and its whole family) stops working now. Best effort: the
  // sign-out goes on whatever the answer.
  if (refreshToken && settings.revocationEndpoint) {
    await fetch(settings.revocationEndpoint, {
      method: "POST",
      headers: { "Content-Type": "application/x-www-form-urlencoded" },
      body: new URLSearchParams({
        token: refreshToken,
        token_type_hint: "refresh_token",
        client_id: settings.clientId,
      }),
      credentials: "omit",
    }).catch(() => undefined);
  }
  if (!settings.endSessionEndpoint || !idToken) {
    show("notice", "Signed out of this application.");
    render();
    return;
  }
  // RP-Initiated Logout 1.0: the provider ends its session too, then sends the browser back.
  const state = randomToken();
  sessionStorage.setItem(SIGN_OUT_KEY, state);
  const query = new URLSearchParams({
    id_token_hint: idToken,
    post_logout_redirect_uri: settings.postLogoutRedirectUri,
    client_id: settings.clientId,
    state,
  });
  location.assign(`${settings.endSessionEndpoint}?${query}`);
  throw new Redirecting();
}

function finishSignOut(params) {
  const expected = sessionStorage.getItem(SIGN_OUT_KEY);
  sessionStorage.removeItem(SIGN_OUT_KEY);
  history.replaceState(null, "", "/");
  if (expected && params.get("state") === expected) {
    show("notice", "You are signed out of this application and of the authorization server.");
  }
}

// ------------------------------------------------------------------ the page

function show(id, text) {
  $(id).textContent = text;
  $(id).hidden = !text;
}

function render() {
  $("signed-out").hidden = tokens !== null;
  $("signed-in").hidden = tokens === null;
  if (tokens === null) {
    $("orders").hidden = true;
    $("api-status").textContent = "";
    return;
  }
  $("user-name").textContent = tokens.claims.name || tokens.claims.sub;
  renderExpiry();
}

function renderExpiry() {
  if (tokens === null) return;
  const left = Math.round((tokens.expiresAt - Date.now()) / 1000);
  $("token-state").textContent =
    left > 0 ? `valid for ${left} s` : "expired; the next call gets a new one";
}

// Runs `action` from a button: errors are shown, a redirect under way is left alone.
function act(action) {
  return async (event) => {
    const button = event.currentTarget;
    button.disabled = true;
    show("error", "");
    show("notice", "");
    try {
      await action();
    } catch (error) {
      if (error instanceof Redirecting) return;
      show("error", error.message);
    } finally {
      button.disabled = false;
      render();
    }
  };
}

async function start() {
  const response = await fetch("/config.json");
  settings = await response.json();
  if (!response.ok) {
    show("error", `This app cannot reach the authorization server: ${settings.error_description}`);
    return;
  }
  $("sign-in").addEventListener("click", act(signIn));
  $("list-orders").addEventListener("click", act(listOrders));
  $("sign-out").addEventListener("click", act(signOut));
  const params = new URLSearchParams(location.search);
  try {
    if (location.pathname === "/callback") {
      await finishSignIn(params);
    } else if (params.has("state")) {
      finishSignOut(params);
    }
  } catch (error) {
    tokens = null;
    show("error", error.message);
  }
  render();
  setInterval(renderExpiry, 1000);
  document.body.dataset.ready = "true";
}

start();
