"""python -m examples.legacy_api [--host 127.0.0.1] [--port 8081]"""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from .app import create_app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.legacy_api",
        description=(
            "Example orders API that trusts the X-Auth-* identity headers set by the "
            "gateway. It checks no tokens: keep it reachable only through the gateway."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8081, help="port to listen on (8081)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    def announce(_: str) -> None:
        print(f"legacy orders API on http://{args.host}:{args.port}", flush=True)

    web.run_app(create_app(), host=args.host, port=args.port, print=announce)
    return 0


if __name__ == "__main__":
    sys.exit(main())
