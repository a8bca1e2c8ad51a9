"""An MCP server that knows nothing of OAuth, behind the gateway and its authorization
server: `make mcp-demo` runs the three (README.md here says what happens between them).
Run the server alone with `python -m examples.mcp --port 8091`.
"""
