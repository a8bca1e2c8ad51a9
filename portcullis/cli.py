"""What both command lines share, and nothing that slows their start (standard library only)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable


def command(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """A command line's `main`, for a reader that stops reading (`check | head -1`): a
    closed stdout ends the command quietly, with the shell's status for SIGPIPE, instead of
    a traceback (and another at exit, when the interpreter flushes the dead pipe)."""
    try:
        status = main(argv)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
