"""portcullis-authserver: run · check · hash-password."""

from __future__ import annotations

import argparse
import getpass
import sys

from portcullis import runtime
from portcullis.yamlconf import ConfigError

from . import settings as settings_module
from . import users


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="portcullis-authserver", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="serve the authorization server")
    run.add_argument("--config", required=True)
    check = commands.add_parser("check", help="validate a config file, print every problem")
    check.add_argument("--config", required=True)
    hashing = commands.add_parser("hash-password", help="print a password hash for the config")
    hashing.add_argument("--stdin", action="store_true", help="read the password from stdin")
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

    if args.command == "check":
        problems = settings_module.check(args.config)
        for found in problems:
            print(found, file=sys.stderr)
        if problems:
            return 1
        print(f"{args.config}: OK")
        return 0

    try:
        settings = settings_module.load(args.config)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return 1
    runtime.configure_logging(settings.log_level)
    from .app import serve

    runtime.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
