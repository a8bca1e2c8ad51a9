"""portcullis-authserver (not yet available in this release)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("portcullis-authserver is not part of this release yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
