# syntax=docker/dockerfile:1
#
# Portcullis: one image, both programs.
#
#   docker build -t portcullis .
#   docker run --rm -p 8080:8080 -v "$PWD/gateway.yaml:/etc/portcullis/gateway.yaml:ro" portcullis
#   docker run --rm -p 9000:9000 -v "$PWD/authserver.yaml:/etc/portcullis/authserver.yaml:ro" \
#       -v portcullis-data:/var/lib/portcullis -e PORTCULLIS_HEALTH_URL=http://127.0.0.1:9902/readyz \
#       portcullis portcullis-authserver run --config /etc/portcullis/authserver.yaml
#
# Configuration is read from /etc/portcullis (mount it read-only); the authorization
# server's database and keys live in /var/lib/portcullis (a volume). Secrets come from the
# environment at run time (${VAR} in the config files): none is in the image.

# ---------------------------------------------------------------- builder
# Wheels for the exact set of pinned dependencies, and for Portcullis itself.
FROM python:3.11-slim-bookworm AS builder
WORKDIR /src
# The dependencies first, alone: this layer is rebuilt only when constraints.txt changes.
# --no-deps: only what the file pins is built, so a dependency missing from it fails the
# install below instead of slipping in unpinned.
COPY constraints.txt ./
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels --requirement constraints.txt
COPY pyproject.toml README.md ./
COPY portcullis ./portcullis
COPY gateway ./gateway
COPY authserver ./authserver
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && cp constraints.txt /wheels/

# ---------------------------------------------------------------- runtime
# The wheels are mounted for one RUN, never copied: no layer keeps them, and no compiler,
# build tool or pip is in the virtual environment the programs run from. Every optional
# backend the examples use is installed: redis (rate limits and caches shared by gateways,
# compose.scaled.yaml) and postgres (authorization server replicas, compose.replicated.yaml).
FROM python:3.11-slim-bookworm
# pyproject.toml's version, given by `make image` and `make release`'s build command.
ARG VERSION=unknown
LABEL org.opencontainers.image.title="Portcullis" \
      org.opencontainers.image.description="OAuth 2.1 / OpenID Connect gateway and authorization server" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -m venv --without-pip /opt/portcullis \
 && pip --python /opt/portcullis/bin/python install --no-cache-dir --no-index \
        --find-links /wheels --constraint /wheels/constraints.txt 'portcullis[redis,postgres]' \
 && useradd --system --uid 10001 --user-group --no-log-init --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin portcullis \
 && mkdir -p /etc/portcullis /var/lib/portcullis \
 && chown 10001:10001 /var/lib/portcullis \
 && chmod 0700 /var/lib/portcullis

ENV PATH=/opt/portcullis/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PORTCULLIS_HEALTH_URL=http://127.0.0.1:9901/readyz

WORKDIR /var/lib/portcullis
VOLUME ["/var/lib/portcullis"]
# 8080 the gateway's listener, 9901 its admin listener (keep it private), 9000 the
# authorization server.
EXPOSE 8080 9901 9000
USER 10001:10001

# Healthy when PORTCULLIS_HEALTH_URL answers 2xx: by default the gateway's /readyz (keys
# loaded, not draining); the authorization server's container sets it to the /readyz of
# its own admin listener (http://127.0.0.1:9902/readyz by default).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['PORTCULLIS_HEALTH_URL'], timeout=2)"]

# SIGTERM starts the drain: stop accepting, let in-flight requests finish within the
# gateway's shutdown_grace, exit. Give `docker stop -t` (Compose stop_grace_period,
# Kubernetes terminationGracePeriodSeconds) more than that grace.
STOPSIGNAL SIGTERM
CMD ["portcullis-gateway", "run", "--config", "/etc/portcullis/gateway.yaml"]
