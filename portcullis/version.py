"""The version of the running code: the installed distribution's, from its metadata."""

from __future__ import annotations

import functools
from importlib import metadata

DISTRIBUTION = "portcullis"


@functools.cache
def version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        # A source tree run without being installed has no metadata to read.
        return "0+unknown"
