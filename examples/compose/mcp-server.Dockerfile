# The example MCP server (examples/mcp/server.py) as an image, unchanged: it stands for an
# MCP server you cannot change. Built from the examples directory:
#
#   docker build -t portcullis-mcp-server -f examples/compose/mcp-server.Dockerfile examples
#
# It checks no tokens and trusts the X-Auth-* headers, so it must only ever be reached
# through the gateway: run it listening on 127.0.0.1 beside the gateway (compose.mcp.yaml
# does).
FROM python:3.11-slim-bookworm
# The same MCP SDK as the example and its tests (the `mcp` extra in pyproject.toml).
RUN pip install --no-cache-dir mcp==2.3.0 \
 && useradd --system --uid 10001 --user-group --no-log-init --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin mcp
COPY mcp/__init__.py mcp/__main__.py mcp/server.py /srv/examples/mcp/
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /srv
USER 10001:10001
EXPOSE 8091
STOPSIGNAL SIGTERM
CMD ["python", "-m", "examples.mcp", "--host", "127.0.0.1", "--port", "8091"]
