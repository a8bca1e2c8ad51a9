"""YAML configuration files turned into plain data that remembers where it came from.

Owns: loading a YAML file with the line of every mapping key and list item, `${VAR}`,
`${VAR:-default}` and `${file:PATH}` interpolation, duration (`30s`, `5m`) and rate (`100/s`)
parsing, and a small reader that converts a mapping into typed values while collecting
*every* problem as `FILE:LINE: message` instead of stopping at the first.

Secrets may come from files (the Docker and Kubernetes secrets convention): `${file:PATH}`
anywhere, or a `KEY_file` key beside a secret `KEY` (`Section.secret`). A command that needs
no secret reads the file with `Reader(file, secrets=False)`: secret values whose variable or
file is missing are then withheld instead of reported.

Knows nothing about OAuth, the gateway or the authserver.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

T = TypeVar("T")


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


class ConfigError(Exception):
    """Raised with every problem found in a configuration file."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = sorted(problems, key=lambda p: (p.file, p.line))
        super().__init__("\n".join(str(p) for p in self.problems))


class LocatedMap(dict[str, Any]):
    """A YAML mapping: `line` is where it starts, `key_lines[key]` where each key is.
    The top level of a file also lists its `Incomplete` values (see `load_text`)."""

    line: int
    key_lines: dict[str, int]
    incomplete: tuple[Incomplete, ...] = ()


class LocatedList(list[Any]):
    """A YAML sequence: `line` is where it starts, `item_lines[i]` where each item is."""

    line: int
    item_lines: list[int]


_VAR = re.compile(r"\$\$|\$\{file:([^}]+)\}|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class Unresolved(str):
    """A `${...}` reference that could not be expanded, as written (`NAME` or `file:PATH`);
    `problem` says why."""

    problem: str

    def __new__(cls, reference: str, problem: str) -> Unresolved:
        self = super().__new__(cls, reference)
        self.problem = problem
        return self


def read_secret_file(path: str) -> str:
    """The text of a file holding one value (a secret), without its trailing line break:
    `echo secret > file` and editors add one that is no part of the value. Raises
    ValueError with the reason it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    return text.removesuffix("\n").removesuffix("\r")


def interpolate(text: str, env: Mapping[str, str]) -> tuple[str, list[Unresolved]]:
    """Expand `${VAR}`, `${VAR:-default}` and `${file:PATH}`; `$$` is a literal `$`.

    Returns the expanded text and what could not be expanded: the names of variables that
    are unset with no default, and `file:PATH` for files that cannot be read (each an
    `Unresolved` that says why). A variable set to the empty string counts as unset for
    `:-`, as in the shell.
    """
    missing: list[Unresolved] = []

    def expand(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        path = m.group(1)
        if path is not None:
            try:
                return read_secret_file(path)
            except ValueError as exc:
                missing.append(Unresolved(f"file:{path}", f"cannot read {path}: {exc}"))
                return ""
        name, default = m.group(2), m.group(3)
        value = env.get(name)
        if value:
            return value
        if default is not None:
            return default
        if value is None:
            advice = f"use ${{{name}:-default}}"
            missing.append(Unresolved(name, f"environment variable {name} is not set ({advice})"))
        return ""

    return _VAR.sub(expand, text), missing


class Incomplete(str):
    """A configuration value in which a reference could not be expanded: it reads as the
    text that could be expanded, and carries the problems to report (or, for a secret a
    command does not need, to excuse)."""

    problems: tuple[Problem, ...]

    def __new__(cls, text: str, problems: tuple[Problem, ...]) -> Incomplete:
        self = super().__new__(cls, text)
        self.problems = problems
        return self


class Withheld(str):
    """A secret left unread because the command needs none (`keys list`); never used."""


WITHHELD = Withheld("(withheld)")


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """SafeLoader whose mappings and lists carry line numbers (1-based)."""

    def __init__(self, stream: str, file: str, env: Mapping[str, str]) -> None:
        super().__init__(stream)
        self.file = file
        self.env = env
        self.problems: list[Problem] = []
        self._explicitly_tagged: set[Node] = set()
        self._interpolated: dict[Node, Any] = {}
        self.incomplete: list[Incomplete] = []

    def _problem(self, node: Node, message: str) -> None:
        self.problems.append(Problem(self.file, node.start_mark.line + 1, message))

    def compose_scalar_node(self, anchor: Any) -> ScalarNode:
        # The node does not remember whether its tag was written (`!!str ${PORT}`) or
        # resolved from the text, and only a resolved tag may change after interpolation.
        event = self.peek_event()  # type: ignore[no-untyped-call]
        node = super().compose_scalar_node(anchor)
        if event.tag not in (None, "!"):
            self._explicitly_tagged.add(node)
        return node

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        if (
            isinstance(node, ScalarNode)
            and "$" in node.value
            and node.tag != "tag:yaml.org,2002:binary"
        ):
            # An alias reaches the same node again: expand (and report) it only once.
            if node in self._interpolated:
                return self._interpolated[node]
            value, missing = interpolate(node.value, self.env)
            if missing:
                # Kept as text whatever its tag: no value can be made of what is missing.
                line = node.start_mark.line + 1
                incomplete = Incomplete(
                    value,
                    tuple(Problem(self.file, line, m.problem) for m in missing),
                )
                self.incomplete.append(incomplete)
                self._interpolated[node] = incomplete
                return incomplete
            # A plain (unquoted) scalar gets its type from the expanded text, so `port: ${PORT}`
            # is still an integer; a quoted or explicitly tagged one keeps its type.
            tag = (
                self.resolve(ScalarNode, value, (True, False))  # type: ignore[no-untyped-call]
                if node.style is None and node not in self._explicitly_tagged
                else node.tag
            )
            expanded = ScalarNode(tag, value, node.start_mark, node.end_mark, node.style)
            result = super().construct_object(expanded, deep)
            self._interpolated[node] = result
            return result
        return super().construct_object(node, deep)

    def construct_located_map(self, node: MappingNode) -> LocatedMap:
        result = LocatedMap()
        result.line = node.start_mark.line + 1
        result.key_lines = {}
        written = sum(1 for key_node, _ in node.value if key_node.tag != _MERGE_TAG)
        self.flatten_mapping(node)
        # flatten_mapping puts the pairs taken in by `<<: *anchor` first, in an order where
        # the later one wins; keys written in this mapping come last and override them, as
        # YAML's merge key intends. Only a key written twice in this mapping is a mistake.
        merged = len(node.value) - written
        written_here: set[str] = set()
        for position, (key_node, value_node) in enumerate(node.value):
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                self._problem(key_node, f"keys must be strings, not {key!r}")
                continue
            if position >= merged:
                if key in written_here:
                    self._problem(
                        key_node, f"duplicate key {key!r} (first on line {result.key_lines[key]})"
                    )
                    continue
                written_here.add(key)
            result.key_lines[key] = key_node.start_mark.line + 1
            result[key] = self.construct_object(value_node, deep=True)
        return result

    def construct_located_list(self, node: SequenceNode) -> LocatedList:
        result = LocatedList(self.construct_object(child, deep=True) for child in node.value)
        result.line = node.start_mark.line + 1
        result.item_lines = [child.start_mark.line + 1 for child in node.value]
        return result


_Loader.add_constructor("tag:yaml.org,2002:map", _Loader.construct_located_map)
_Loader.add_constructor("tag:yaml.org,2002:seq", _Loader.construct_located_list)


def load_text(
    text: str, file: str, env: Mapping[str, str] | None = None, *, keep_incomplete: bool = False
) -> LocatedMap:
    """Parse YAML text whose top level must be a mapping; raise ConfigError on any problem.

    With `keep_incomplete`, values whose variable or file is missing are no problem here:
    they are `Incomplete` values, also listed in the result's `incomplete`, for a `Reader`
    to report (or excuse, for secrets a command does not need).
    """
    loader = _Loader(text, file, os.environ if env is None else env)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise ConfigError(
            [Problem(file, line, f"YAML syntax: {exc.problem or exc.context}")]
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem(file, 1, f"YAML: {exc}")]) from None
    finally:
        loader.dispose()
    problems = list(loader.problems)
    if not keep_incomplete:
        problems += [p for value in loader.incomplete for p in value.problems]
    if problems:
        raise ConfigError(problems)
    if not isinstance(data, LocatedMap):
        raise ConfigError([Problem(file, 1, "the file must hold a mapping of settings")])
    data.incomplete = tuple(loader.incomplete)
    return data


def load_file(
    path: str, env: Mapping[str, str] | None = None, *, keep_incomplete: bool = False
) -> LocatedMap:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError([Problem(path, 0, f"cannot read: {exc.strerror}")]) from None
    except UnicodeDecodeError:
        raise ConfigError([Problem(path, 0, "not UTF-8 text")]) from None
    return load_text(text, path, env, keep_incomplete=keep_incomplete)


# ---------------------------------------------------------------------------- value parsers
# Each takes the raw YAML value and returns the typed value or raises ValueError(message).

# ASCII only: `\d` would otherwise take any script's digits, and a value that reads as a
# number to Python but not to the editor's JSON Schema (or a reader) is a trap.
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$", re.ASCII)
_UNIT = {
    "ms": timedelta(milliseconds=1),
    "s": timedelta(seconds=1),
    "m": timedelta(minutes=1),
    "h": timedelta(hours=1),
    "d": timedelta(days=1),
}


def duration(value: Any) -> timedelta:
    """`30s`, `5m`, `1.5h`, `250ms`, `14d`; a bare 0 is accepted. Other numbers are ambiguous."""
    if value == 0 and not isinstance(value, bool):
        return timedelta(0)
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            try:
                return float(m.group(1)) * _UNIT[m.group(2)]
            except OverflowError:
                raise ValueError(f"{value!r} is longer than any duration can be") from None
    raise ValueError(f"{value!r} is not a duration (write it like 30s, 5m, 250ms, 2h or 14d)")


def duration_text(value: timedelta) -> str:
    """A duration as it would be written: the largest unit that gives a whole number."""
    millis = value / timedelta(milliseconds=1)
    for unit in ("d", "h", "m", "s"):
        count = value / _UNIT[unit]
        if count == int(count) and count != 0:
            return f"{int(count)}{unit}"
    return f"{millis:g}ms" if millis else "0s"


@dataclass(frozen=True)
class Rate:
    """`count` events per `per`."""

    count: float
    per: timedelta

    @property
    def per_second(self) -> float:
        return self.count / self.per.total_seconds()

    def __str__(self) -> str:
        return f"{self.count:g}/{self.per.total_seconds():g}s"


_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)?\s*(ms|s|m|h|d)\s*$", re.ASCII)


def rate(value: Any) -> Rate:
    """`100/s`, `10/m`, `5000/h`, `3/10s`."""
    if isinstance(value, str):
        m = _RATE.match(value)
        if m:
            count = float(m.group(1))
            try:
                per = float(m.group(2) or 1) * _UNIT[m.group(3)]
            except OverflowError:
                raise ValueError(f"{value!r} has a period longer than any can be") from None
            if 0 < count < math.inf and per > timedelta(0):
                return Rate(count, per)
    raise ValueError(f"{value!r} is not a rate (write it like 100/s, 10/m or 3/10s)")


def string(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError(f"expected a string, got {_kind(value)}")


def non_empty_string(value: Any) -> str:
    text = string(value)
    if not text.strip():
        raise ValueError("must not be empty")
    return text


def secret(value: Any) -> str:
    """A password or key: a non-empty string whose value never appears in a message."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be a non-empty string (quote it; the value is not shown)")
    return value


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"expected true or false, got {_kind(value)}")


def integer(minimum: int | None = None, maximum: int | None = None) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {_kind(value)}")
        if minimum is not None and value < minimum:
            raise ValueError(f"must be at least {minimum}")
        if maximum is not None and value > maximum:
            raise ValueError(f"must be at most {maximum}")
        return value

    return parse


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|KB|MB|GB|k|K|M|G)?\s*$", re.ASCII)
_SIZE_UNIT = {
    None: 1,
    "B": 1,
    "k": 1024,
    "K": 1024,
    "KiB": 1024,
    "KB": 1000,
    "M": 1024**2,
    "MiB": 1024**2,
    "MB": 1000**2,
    "G": 1024**3,
    "GiB": 1024**3,
    "GB": 1000**3,
}


def size(value: Any) -> int:
    """A byte count: `1048576`, `64KiB`, `10MiB`, `1GiB` (K/M/G alone are binary too)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            number = float(m.group(1)) * _SIZE_UNIT[m.group(2)]
            if math.isfinite(number):
                return int(number)
    raise ValueError(f"{value!r} is not a size (write it like 8KiB, 10MiB or 1048576)")


def one_of(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value in choices:
            return str(value)
        raise ValueError(f"{value!r} is not one of {', '.join(choices)}")

    return parse


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, LocatedMap | dict):
        return "a mapping"
    if isinstance(value, LocatedList | list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


# ---------------------------------------------------------------------------- reader

_MISSING: Any = object()


class Reader:
    """Collects problems for one file while settings are being built.

    `incomplete` are the values whose variable or file was missing (from `load_text` with
    `keep_incomplete`): each is reported by `raise_if_any` unless it is a secret withheld
    because `secrets` is False (a command that needs no secret, like `keys list`).
    """

    def __init__(
        self, file: str, incomplete: Iterable[Incomplete] = (), *, secrets: bool = True
    ) -> None:
        self.file = file
        self.problems: list[Problem] = []
        self.secrets = secrets
        self._incomplete = {id(value): value for value in incomplete}

    def withhold(self, value: Incomplete) -> None:
        """A secret the command does not need: what is missing in it is no problem."""
        self._incomplete.pop(id(value), None)

    def problem(self, line: int, message: str) -> None:
        self.problems.append(Problem(self.file, line, message))

    def section(self, data: Any, where: str, line: int) -> Section | None:
        """View `data` as a mapping; report and return None when it is something else."""
        if isinstance(data, LocatedMap):
            return Section(self, data, where)
        self.problem(line, f"{where} must be a mapping, got {_kind(data)}")
        return None

    def items(self, data: Any, where: str, line: int) -> Iterator[tuple[int, int, Any]]:
        """(index, line, item) of a list; reports something that is not a list."""
        if data is None:
            return
        if not isinstance(data, LocatedList):
            self.problem(line, f"{where} must be a list, got {_kind(data)}")
            return
        for index, item in enumerate(data):
            yield index, data.item_lines[index], item

    def raise_if_any(self) -> None:
        problems = self.problems + [p for v in self._incomplete.values() for p in v.problems]
        if problems:
            raise ConfigError(problems)


class Section:
    """Typed access to one mapping; keys nobody asked for are reported by `finish()`."""

    def __init__(self, reader: Reader, data: LocatedMap, where: str) -> None:
        self.reader = reader
        self.data = data
        self.where = where
        self.line = data.line
        self._seen: set[str] = set()
        self._known: set[str] = set()  # keys asked about, read or not: named by finish()

    def line_of(self, key: str) -> int:
        return self.data.key_lines.get(key, self.data.line)

    def has(self, key: str) -> bool:
        self._known.add(key)
        return key in self.data

    def raw(self, key: str) -> Any:
        self._seen.add(key)
        return self.data.get(key)

    def get(self, key: str, parse: Callable[[Any], T], default: T = _MISSING) -> T:
        """The parsed value of `key`; `default` when absent (required when no default).

        A required key that is absent or invalid is reported and gives None, so the caller
        can go on collecting problems.
        """
        self._seen.add(key)
        if key not in self.data or (self.data[key] is None and default is not _MISSING):
            if default is _MISSING:
                self.reader.problem(self.line, f"{self.where}: {key} is required")
                return None  # type: ignore[return-value]
            return default
        if isinstance(self.data[key], Incomplete):
            # What is missing is reported; parsing what is left would only add confusion.
            return default if default is not _MISSING else None  # type: ignore[return-value]
        try:
            return parse(self.data[key])
        except ValueError as exc:
            self.reader.problem(self.line_of(key), f"{self.where}.{key}: {exc}")
            return default if default is not _MISSING else None  # type: ignore[return-value]

    def secret(self, key: str, parse: Callable[[Any], str] | None = None) -> str | None:
        """A secret given as `key` (the value, or `${VAR}` / `${file:PATH}` in it) or as
        `key_file` (a file holding it); None when neither is given.

        Without `reader.secrets`, a secret whose variable or file is missing, and any
        `key_file`, is `WITHHELD`: a command that uses no secret need not have them.
        """
        file_key = f"{key}_file"
        given = [k for k in (key, file_key) if self.has(k)]
        if not given:
            self._seen.update((key, file_key))
            return None
        if len(given) == 2:
            self._seen.update((key, file_key))
            self.reader.problem(
                self.line_of(file_key), f"{self.where}: give {key} or {file_key}, not both"
            )
            return None
        parse = parse or non_empty_string
        if given[0] == file_key:
            path = self.get(file_key, non_empty_string)
            if path is None:
                return None
            if not self.reader.secrets:
                return WITHHELD
            try:
                text = read_secret_file(path)
            except ValueError as exc:
                self.reader.problem(
                    self.line_of(file_key), f"{self.where}.{file_key}: cannot read {path}: {exc}"
                )
                return None
            try:
                return parse(text)
            except ValueError as exc:
                self.reader.problem(self.line_of(file_key), f"{self.where}.{file_key}: {exc}")
                return None
        raw = self.raw(key)
        if isinstance(raw, Incomplete) and not self.reader.secrets:
            self.reader.withhold(raw)
            return WITHHELD
        return self.get(key, parse)

    def subsection(self, key: str) -> Section | None:
        """An optional mapping under `key`: None when the key is absent (the caller's
        defaults apply) or, with a problem reported, when it is not a mapping."""
        if key not in self.data:
            self._seen.add(key)
            return None
        return self.reader.section(
            self.raw(key),
            f"{self.where}.{key}" if self.where != "config" else key,
            self.line_of(key),
        )

    def list_of(
        self, key: str, parse: Callable[[Any], T], default: tuple[T, ...] = ()
    ) -> tuple[T, ...]:
        """A list whose items are parsed one by one; a single scalar is not a list."""
        self._seen.add(key)
        raw = self.data.get(key)
        if raw is None:
            return default
        out: list[T] = []
        for index, line, item in self.reader.items(raw, f"{self.where}.{key}", self.line_of(key)):
            if isinstance(item, Incomplete):
                continue
            try:
                out.append(parse(item))
            except ValueError as exc:
                self.reader.problem(line, f"{self.where}.{key}[{index}]: {exc}")
        return tuple(out)

    def finish(self, hint: Mapping[str, str] | None = None) -> None:
        """Report every key that was not read: a typo should never be silently ignored."""
        for key in self.data:
            if key not in self._seen:
                extra = f" ({hint[key]})" if hint and key in hint else ""
                known = ", ".join(sorted(self._seen | self._known))
                self.reader.problem(
                    self.line_of(key),
                    f"{self.where}: unknown key {key!r}{extra}; known keys: {known}",
                )
