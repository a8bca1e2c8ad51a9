"""portcullis-authserver: run · check · migrate · keys rotate · keys list · hash-password."""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import logging.handlers
import os
import sys
import time
from dataclasses import asdict

from portcullis.version import version
from portcullis.yamlconf import ConfigError

from . import settings as settings_module
from . import users

CONFIG_VARIABLE = "PORTCULLIS_AUTHSERVER_CONFIG"  # the config file when --config is not given
CONFIG_HELP = f"the config file (default: ${CONFIG_VARIABLE})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="portcullis-authserver", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="serve the authorization server")
    run.add_argument("--config", help=CONFIG_HELP)
    run.add_argument(
        "--debug", action="store_true", help="print the traceback when the server cannot start"
    )
    check = commands.add_parser("check", help="validate a config file, print every problem")
    check.add_argument("--config", help=CONFIG_HELP)
    migrating = commands.add_parser(
        "migrate", help="apply the storage's pending schema migrations, then exit"
    )
    migrating.add_argument("--config", help=CONFIG_HELP)
    hashing = commands.add_parser("hash-password", help="print a password hash for the config")
    hashing.add_argument("--stdin", action="store_true", help="read the password from stdin")
    keys = commands.add_parser("keys", help="signing keys in the configured key directory")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    rotate = key_commands.add_parser(
        "rotate",
        help="publish a new key for each signing algorithm; it signs after publish_ahead",
    )
    rotate.add_argument("--config", help=CONFIG_HELP)
    rotate.add_argument(
        "--alg",
        action="append",
        choices=settings_module.SIGNING_ALGORITHMS,
        help="rotate only this algorithm's key (repeatable); default: every one in use",
    )
    listing = key_commands.add_parser("list", help="each key's kid, algorithm, state and dates")
    listing.add_argument("--config", help=CONFIG_HELP)
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    if args.command == "hash-password":
        if args.stdin:
            # Only the line ending goes: a password may end in spaces.
            password = sys.stdin.readline().removesuffix("\n").removesuffix("\r")
        else:
            password = getpass.getpass("Password: ")
            if getpass.getpass("Again: ") != password:
                print("the passwords differ", file=sys.stderr)
                return 1
        if not password:
            print("empty password", file=sys.stderr)
            return 1
        print(users.hash_password(password))
        return 0

    args.config = args.config or os.environ.get(CONFIG_VARIABLE)
    if not args.config:
        parser.error(f"--config FILE is required (or set {CONFIG_VARIABLE})")
    if args.command == "check":
        problems = settings_module.check(args.config)
        for found in problems:
            print(found, file=sys.stderr)
        if problems:
            return 1
        print(f"{args.config}: OK")
        return 0

    # What loading logs (a plain-text password's warning) is held back, so that the first
    # line a running server logs is the one with its version.
    held = logging.handlers.BufferingHandler(capacity=1000)
    logging.getLogger().addHandler(held)
    try:
        # The key commands work on the key directory alone: they need no secret, no
        # certificate and no database, which may live elsewhere than where they run.
        serving = args.command == "run"
        settings = settings_module.load(args.config, secrets=serving, storage=serving)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return 1
    finally:
        logging.getLogger().removeHandler(held)
    if args.command == "keys":
        _replay(held)
        return _keys(args, settings)
    if args.command == "migrate":
        return _migrate(settings)
    # The server's imports (aiohttp, uvloop) only when serving: the other commands start fast.
    from portcullis import runtime

    from .app import serve

    runtime.configure_logging(settings.log_level)
    log = logging.getLogger("portcullis.authserver")
    log.info("starting", extra={"version": version(), "config": args.config})
    _replay(held)
    return runtime.run_service(serve(settings), debug=args.debug)


def _replay(held: logging.handlers.BufferingHandler) -> None:
    for record in held.buffer:
        logging.getLogger(record.name).handle(record)


def _migrate(settings: settings_module.Settings) -> int:
    """Apply pending migrations under the backend's lock: safe while servers run or start."""
    import asyncio

    from portcullis import runtime

    from .app import migrate
    from .store.base import StoreUnavailable

    runtime.configure_logging(settings.log_level)
    try:
        asyncio.run(migrate(settings))
    except StoreUnavailable as exc:
        print(f"storage unavailable: {exc}", file=sys.stderr)
        return 1
    print("storage: every migration is applied")
    return 0


def _keys(args: argparse.Namespace, settings: settings_module.Settings) -> int:
    """Work on the key directory in place: a running server notices within a second."""
    from .keys import METADATA, KeyRing, RotationPolicy

    ring = KeyRing(settings.keys.dir, RotationPolicy.from_settings(settings))
    in_use = settings.signing_algs
    now = time.time()
    if args.keys_command == "rotate":
        wanted = list(dict.fromkeys(args.alg or in_use))
        unused = [alg for alg in wanted if alg not in in_use]
        if unused:
            print(
                f"the server does not sign with {', '.join(unused)} "
                f"(it signs with {', '.join(in_use)})",
                file=sys.stderr,
            )
            return 1
        ring.load(in_use)
        for rotation in ring.rotate(wanted, now):
            info = rotation.info
            what = "published now" if rotation.created else "already waiting"
            print(f"{info.kid}  {info.alg}  next: {what}; signs from {_when(info.activate_at)}")
        return 0
    if not (ring.dir / METADATA).exists():
        print(f"no keys in {ring.dir}: the server makes them when it first starts", file=sys.stderr)
        return 1
    ring.reload()
    infos = ring.view(now)
    if args.json:
        print(json.dumps([asdict(info) for info in infos], indent=2))
        return 0
    header = ("KID", "ALG", "STATE", "CREATED", "SIGNS FROM", "RETIRED", "REMOVED AFTER")
    rows = [header] + [
        (
            i.kid,
            i.alg,
            i.state,
            _when(i.created_at),
            _when(i.active_from),
            _when(i.retired_at),
            _when(i.remove_after),
        )
        for i in infos
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    return 0


def _when(moment: float | None) -> str:
    if moment is None:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(moment))


if __name__ == "__main__":
    sys.exit(main())
