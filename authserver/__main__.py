"""portcullis-authserver: run · check · migrate · keys rotate · keys list · hash-password ·
clients · users (the last two through a running server's admin API)."""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import logging.handlers
import os
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeVar

from portcullis import cli
from portcullis.version import version
from portcullis.yamlconf import ConfigError

from . import settings as settings_module
from . import users

if TYPE_CHECKING:
    from .keys import KeyInfo, Rotation

T = TypeVar("T")
CONFIG_VARIABLE = "PORTCULLIS_AUTHSERVER_CONFIG"  # the config file when --config is not given
CONFIG_HELP = f"the config file (default: ${CONFIG_VARIABLE})"


def main(argv: list[str] | None = None) -> int:
    return cli.command(_main, argv)


def command_line() -> argparse.ArgumentParser:
    """The command line's parser (the docs' command reference is generated from it)."""
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
    migrating.add_argument(
        "--debug", action="store_true", help="print the traceback when the migration fails"
    )
    hashing = commands.add_parser("hash-password", help="print a password hash for the config")
    hashing.add_argument("--stdin", action="store_true", help="read the password from stdin")
    keys = commands.add_parser(
        "keys", help="signing keys, in the key directory or kept in the storage"
    )
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
    from .admin import cli as admin_cli

    admin_cli.add_commands(commands)
    return parser


def _main(argv: list[str] | None) -> int:
    from .admin import cli as admin_cli

    parser = command_line()
    args = parser.parse_args(argv)

    if args.command in ("clients", "users"):
        return admin_cli.run(args)
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
        problems, warnings = settings_module.check_with_warnings(args.config)
        # Warnings do not fail the check: the file is valid, and may be meant as written.
        for found in problems + warnings:
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
        if args.command == "keys" and args.keys_command == "rotate" and settings.keys.in_storage:
            # New keys are sealed with keys.encryption_key: read it (and every secret).
            settings = settings_module.load(args.config)
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
        return _migrate(settings, debug=args.debug)
    # The server's imports (aiohttp, uvloop) only when serving: the other commands start fast.
    from portcullis import runtime

    from .app import serve

    runtime.configure_logging(settings.log_level)
    log = logging.getLogger("portcullis.authserver")
    log.info("starting", extra={"version": version(), "config": args.config})
    _replay(held)
    for warning in settings_module.warnings(settings):
        log.warning(warning, extra={"event": "config_warning"})
    return runtime.run_service(serve(settings), debug=args.debug)


def _replay(held: logging.handlers.BufferingHandler) -> None:
    for record in held.buffer:
        logging.getLogger(record.name).handle(record)


def _migrate(settings: settings_module.Settings, *, debug: bool) -> int:
    """Apply pending migrations under the backend's lock: safe while servers run or start."""
    from portcullis import runtime

    from .app import migrate

    runtime.configure_logging(settings.log_level)
    if runtime.run_service(migrate(settings), debug=debug) != 0:
        return 1
    print("storage: every migration is applied")
    return 0


def _keys(args: argparse.Namespace, settings: settings_module.Settings) -> int:
    """Work on the key ring in place (the directory, or the storage): running servers
    publish a change within keys.reload_every."""
    import asyncio

    from .keys import KeyRing, SigningRing
    from .store.base import StoreUnavailable
    from .stored_keys import KeyDecryptionError

    def with_ring(work: Callable[[SigningRing], Coroutine[Any, Any, T]]) -> T:
        directory = settings.keys.dir
        if directory is not None:  # without the server's imports: the command starts fast
            return asyncio.run(work(KeyRing(directory, settings_module.rotation_policy(settings))))
        from .app import with_key_ring

        return asyncio.run(with_key_ring(settings, work))

    in_use = settings.signing_algs
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

        async def rotate(ring: SigningRing) -> list[Rotation]:
            await ring.start(in_use)
            return await ring.rotate_keys(wanted, time.time())

        try:
            rotations = with_ring(rotate)
        except (StoreUnavailable, KeyDecryptionError) as exc:
            print(f"cannot rotate the keys in the storage: {exc}", file=sys.stderr)
            return 1
        for rotation in rotations:
            info = rotation.info
            what = "published now" if rotation.created else "already waiting"
            print(f"{info.kid}  {info.alg}  next: {what}; signs from {_when(info.activate_at)}")
        return 0

    async def listing(ring: SigningRing) -> tuple[str, list[KeyInfo] | None]:
        return ring.where, await ring.listing(time.time())

    try:
        where, infos = with_ring(listing)
    except StoreUnavailable as exc:
        print(f"cannot read the keys in the storage: {exc}", file=sys.stderr)
        return 1
    if infos is None:
        print(f"no keys in {where}: the server makes them when it first starts", file=sys.stderr)
        return 1
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
