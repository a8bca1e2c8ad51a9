"""Send an exact number of the same request over a few keep-alive connections.

    keepalive_client.py --port N --path PATH --authorization VALUE --requests N --connections C
                        [--method POST --body FILE --header "Name: value" ...]

Each connection sends its share one request at a time, reads the whole answer and checks its
status is 200; the program fails on any other. For bench/instructions.sh, which counts the
instructions a server spends on exactly these requests (wrk runs for a time, not a count).
"""

from __future__ import annotations

import argparse
import asyncio


async def one_connection(port: int, request: bytes, count: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(count):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200 "):
                raise SystemExit(f"unexpected answer: {head[:120]!r}")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
    finally:
        writer.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", required=True)
    parser.add_argument("--authorization", default="", help="empty: none sent")
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--method", default="GET")
    parser.add_argument("--body", help="a file whose bytes are the request's body")
    parser.add_argument("--header", action="append", default=[], help="'Name: value'")
    args = parser.parse_args()
    body = b""
    if args.body is not None:
        with open(args.body, "rb") as file:
            body = file.read()
    head = [
        f"{args.method} {args.path} HTTP/1.1",
        f"Host: 127.0.0.1:{args.port}",
        *([f"Authorization: {args.authorization}"] if args.authorization else []),
        *args.header,
        *([f"Content-Length: {len(body)}"] if body or args.method == "POST" else []),
    ]
    request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
    share, extra = divmod(args.requests, args.connections)
    counts = [share + (i < extra) for i in range(args.connections)]
    await asyncio.gather(*(one_connection(args.port, request, n) for n in counts if n))


if __name__ == "__main__":
    asyncio.run(main())
