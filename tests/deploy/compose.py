"""The Compose example as Compose reads it: files merged in order, `${...}` interpolated.

Only what the example uses is implemented: mappings merge key by key, `ports`, `volumes`,
`cap_drop` and `security_opt` lists are joined, anything else in a later file replaces the
earlier value; interpolation knows `${VAR}`, `${VAR:-default}`, `${VAR-default}`,
`${VAR:?message}`, `${VAR?message}` and `$$`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.dockerfile import ROOT

COMPOSE_DIR = ROOT / "examples" / "compose"
BASE = "compose.yaml"
SCALED = "compose.scaled.yaml"
REPLICATED = "compose.replicated.yaml"
JOINED = ("ports", "volumes", "cap_drop", "security_opt")

_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


class Unset(Exception):
    """A `${VAR:?message}` whose variable is not set."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, argument = match.groups()
        value = env.get(name)
        missing = value is None or (operator is not None and operator.startswith(":") and not value)
        if operator in (":?", "?") and missing:
            raise Unset(f"{name}: {argument}")
        if operator in (":-", "-") and missing:
            return argument
        return value or ""

    return _VARIABLE.sub(replace, text)


def _resolve(value: Any, env: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return interpolate(value, env)
    if isinstance(value, list):
        return [_resolve(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _resolve(v, env) for k, v in value.items()}
    return value


def _merge(base: Any, override: Any, key: str = "") -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for k, v in override.items():
            merged[k] = _merge(base[k], v, k) if k in base else v
        return merged
    if key in JOINED and isinstance(base, list) and isinstance(override, list):
        return base + [v for v in override if v not in base]
    return override


def raw(*names: str) -> dict[str, Any]:
    """The files merged, before interpolation."""
    model: dict[str, Any] = {}
    for name in names:
        model = _merge(model, yaml.safe_load((COMPOSE_DIR / name).read_text()))
    return model


def load(*names: str, env: Mapping[str, str]) -> dict[str, Any]:
    """The files merged and interpolated with `env` (what the shell and .env provide)."""
    resolved: dict[str, Any] = _resolve(raw(*names), env)
    return resolved


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's `environment`, in either of Compose's two forms."""
    listed = service.get("environment") or {}
    if isinstance(listed, list):
        return dict(item.split("=", 1) for item in listed)
    return {k: "" if v is None else str(v) for k, v in listed.items()}


def mounts(service: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Target path → (source, options) of each short-syntax volume."""
    found = {}
    for entry in service.get("volumes") or []:
        source, target, *options = entry.split(":")
        found[target] = (source, options[0] if options else "rw")
    return found


def config_file(source: str) -> Path:
    """A bind-mount source, relative to the Compose file."""
    return (COMPOSE_DIR / source).resolve()
