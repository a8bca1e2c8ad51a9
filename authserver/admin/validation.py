"""Validation of admin API bodies with the configuration file's own rules.

A client or user sent to the admin API is checked by the very declarations that check the
configuration file (declarations.DeclaredClient and DeclaredUser, through portcullis.sections):
exact redirect URIs, https except on loopback, known grant types, PKCE for public clients,
secrets and keys as the authentication method needs them. The JSON body is handed to the
loader as if it were YAML, each value given a "line" of its own; the line of each problem
then names the value's JSON path (`redirectUris[0]`), and 422 lists every problem.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from portcullis import sections
from portcullis.yamlconf import ConfigError, LocatedList, LocatedMap

from .http import camel, invalid

T = TypeVar("T")
_FILE = "<request>"


class _Paths:
    """Hands out one line number per value and remembers its JSON path."""

    def __init__(self) -> None:
        self.by_line: dict[int, str] = {}

    def mark(self, path: str) -> int:
        line = len(self.by_line) + 1
        self.by_line[line] = path
        return line

    def located(self, value: Any, path: str) -> Any:
        if isinstance(value, Mapping):
            result = LocatedMap()
            result.line = self.mark(path)
            result.key_lines = {}
            for key, item in value.items():
                inner = f"{path}.{key}" if path else str(key)
                result.key_lines[str(key)] = self.mark(inner)
                result[str(key)] = self.located(item, inner)
            return result
        if isinstance(value, list):
            items = LocatedList()
            items.line = self.mark(path)
            items.item_lines = []
            for index, item in enumerate(value):
                inner = f"{path}[{index}]"
                items.item_lines.append(self.mark(inner))
                items.append(self.located(item, inner))
            return items
        return value


def build(cls: type[T], data: Mapping[str, Any], path_of: Callable[[str], str] = camel) -> T:
    """The section `cls` from `data` (its keys as the configuration file names them), or
    422 with one detail per problem at the JSON path of the request's value, the key `k`
    of the section written `path_of(k)`."""
    paths = _Paths()
    root = LocatedMap()
    root.line = paths.mark("")
    root.key_lines = {}
    for key, value in data.items():
        root.key_lines[key] = paths.mark(path_of(key))
        root[key] = paths.located(value, path_of(key))
    try:
        return sections.load(cls, root, _FILE)
    except ConfigError as exc:
        raise invalid(
            [(paths.by_line.get(p.line, ""), _issue(p.message, path_of)) for p in exc.problems]
        ) from None


_PREFIX = re.compile(r"^" + re.escape(sections.ROOT) + r"[^:]*:\s*")
# A key as the file names it; not the end of a URN or URL (`...:grant-type:device_code`).
_NAME = re.compile(r"(?<![:/\w-])[a-z]+(?:_[a-z]+)+\b")


def _issue(message: str, path_of: Callable[[str], str]) -> str:
    """A loader's message for the request: without the place (the detail's field says
    it), keys named as the API names them."""
    text = _PREFIX.sub("", message)
    return _NAME.sub(lambda m: _api_name(m.group(0), path_of), text)


# Values that look like keys but are not: grant types and methods keep their names.
_VALUES = {
    "authorization_code",
    "client_credentials",
    "refresh_token",
    "client_secret_basic",
    "client_secret_post",
    "private_key_jwt",
    "device_code",
}


def _api_name(name: str, path_of: Callable[[str], str]) -> str:
    return name if name in _VALUES else path_of(name)
