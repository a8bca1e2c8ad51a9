"""Versioned migrations as files: migrations/<backend>/NNN_name.sql, applied in order of NNN.

Each backend applies them its own way (store/sqlite.py, store/postgres.py) and records what
it applied in its schema_migrations table; reading the files is common to both.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources.abc import Traversable


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def load_migrations(directory: Traversable) -> list[Migration]:
    """The files NNN_name.sql of a directory, in the numeric order of NNN."""
    found: dict[int, Migration] = {}
    for entry in directory.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        prefix, sep, _ = entry.name.partition("_")
        if not (sep and prefix.isdigit()):
            raise ValueError(f"migration {entry.name!r} is not named NNN_name.sql")
        version = int(prefix)
        if version in found:
            raise ValueError(
                f"migrations {found[version].name!r} and {entry.name!r} share version {version}"
            )
        found[version] = Migration(version, entry.name, entry.read_text(encoding="utf-8"))
    return [found[version] for version in sorted(found)]


def unknown_versions(applied: set[int], migrations: list[Migration]) -> list[int]:
    """Versions a database has applied that none of `migrations` is: a newer program wrote it."""
    return sorted(applied - {migration.version for migration in migrations})
