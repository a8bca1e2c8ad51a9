"""Optional dependencies: the driver a configured backend needs, installed by an extra of
the distribution (`portcullis[redis]`, `portcullis[postgres]`).

A backend's driver is imported only when the configuration names that backend, so a
missing one would show only when `run` opens it. `check` asks here first and reports it as
a problem of the setting that names the backend, with the extra that installs it.
"""

from __future__ import annotations

import importlib


def missing_driver(module: str, extra: str) -> str | None:
    """Why `module`, which `portcullis[extra]` installs, cannot be imported here; None
    when it can."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"needs {module}, which cannot be imported here ({exc}): install portcullis[{extra}]"
    return None
