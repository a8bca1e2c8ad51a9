# The example orders API (examples/legacy_api) as an image: it stands for the service you
# cannot change. Built from the examples directory:
#
#   docker build -t portcullis-orders-api -f examples/compose/legacy-api.Dockerfile examples
#
# It knows nothing about OAuth and trusts the X-Auth-* headers, so it must only ever be
# reached through the gateway: run it listening on 127.0.0.1 beside the gateway (the
# Compose file and the Kubernetes Pod do).
FROM python:3.11-slim-bookworm
# The same aiohttp as the Portcullis image (constraints.txt).
RUN pip install --no-cache-dir aiohttp==3.14.5 \
 && useradd --system --uid 10001 --user-group --no-log-init --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin orders
COPY legacy_api /srv/examples/legacy_api
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /srv
USER 10001:10001
EXPOSE 8081
STOPSIGNAL SIGTERM
CMD ["python", "-m", "examples.legacy_api", "--host", "127.0.0.1", "--port", "8081"]
