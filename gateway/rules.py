"""Route rules: compiled once, matched on every request without scanning the whole table.

A path template is literal segments, `{name}` segments (exactly one non-empty segment) and an
optional trailing `**` (zero or more segments): `/orders/{id}`, `/admin/**`, `/**`.

Matching is first-match-wins in file order. The table is indexed by method and first path
segment, so a request only looks at the rules that could match it; rules whose first segment
is not a literal are merged into every bucket at start-up, keeping file order.

`find_conflicts` rejects at load time a rule that can never match because an earlier rule
takes every request it would match (including exact duplicates).

Pure: no aiohttp, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote

if TYPE_CHECKING:
    from .settings import IssuerSettings, RouteSettings

_PARAM = re.compile(r"^\{([A-Za-z_][A-Za-z0-9_]*)\}$")
# Characters a literal template segment may hold: RFC 3986 pchar without percent-encoding.
_LITERAL = re.compile(r"^[A-Za-z0-9\-._~!$&'()*+,;=:@]*$")


@dataclass(frozen=True)
class Pattern:
    """A compiled path template. `segments[i]` is a literal, or None for a `{param}`."""

    template: str
    segments: tuple[str | None, ...]
    params: tuple[str | None, ...]
    tail: bool  # ends with `**`

    @classmethod
    def parse(cls, template: str) -> Pattern:
        if not template.startswith("/"):
            raise ValueError(f"{template!r} must start with /")
        if "?" in template or "#" in template:
            raise ValueError(f"{template!r} must be a path only, without query or fragment")
        parts = template[1:].split("/")
        tail = parts[-1] == "**"
        if tail:
            parts.pop()
        segments: list[str | None] = []
        params: list[str | None] = []
        for i, part in enumerate(parts):
            m = _PARAM.match(part)
            if m:
                if m.group(1) in params:
                    raise ValueError(f"{template!r} uses {{{m.group(1)}}} twice")
                segments.append(None)
                params.append(m.group(1))
            elif part == "**":
                raise ValueError(f"{template!r}: ** may only be the last segment")
            elif "*" in part or "{" in part or "}" in part:
                raise ValueError(f"{template!r}: segment {part!r} is neither literal nor {{name}}")
            elif part in (".", ".."):
                raise ValueError(f"{template!r}: dot segments are not allowed")
            elif part == "" and i != len(parts) - 1:
                raise ValueError(f"{template!r}: empty segment (//)")
            elif not _LITERAL.match(part):
                raise ValueError(
                    f"{template!r}: segment {part!r} has characters a path cannot hold"
                )
            else:
                segments.append(part)
                params.append(None)
        if tail and segments and segments[-1] == "":
            raise ValueError(f"{template!r}: write /** rather than //**")
        if not tail and segments == [""]:
            segments = [""]  # "/" is the root: one empty segment
        return cls(template, tuple(segments), tuple(params), tail)

    def match(self, path: Sequence[str]) -> bool:
        n = len(self.segments)
        if len(path) != n and not (self.tail and len(path) >= n):
            return False
        for want, got in zip(self.segments, path, strict=False):
            if want is None:
                if not got:
                    return False
            elif want != got:
                return False
        return True

    def bind(self, path: Sequence[str]) -> dict[str, str]:
        """The `{name}` values of a path this pattern matches (for explain)."""
        return {name: seg for name, seg in zip(self.params, path, strict=False) if name}

    def covers(self, other: Pattern) -> bool:
        """True when every path `other` matches is matched by self too."""
        if len(other.segments) < len(self.segments):
            return False
        for mine, theirs in zip(self.segments, other.segments, strict=False):
            if mine is None:
                if theirs == "":
                    return False  # a {param} never matches an empty segment
            elif theirs is None or mine != theirs:
                return False
        if self.tail:
            return True
        return not other.tail and len(other.segments) == len(self.segments)


@dataclass(frozen=True)
class Rule:
    """A route ready for requests: its pattern, and the audiences accepted per issuer."""

    index: int
    settings: RouteSettings
    pattern: Pattern
    public: bool
    # issuer -> audiences a token from that issuer must name one of; issuers absent here
    # are not accepted on this route.
    audiences_by_issuer: Mapping[str, frozenset[str]]

    @property
    def name(self) -> str:
        return self.settings.name


# Paths made only of these characters need no decoding and hold nothing split_path refuses,
# except dot segments and `//`, which are looked for separately.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9\-._~!$&'()*+,;=:@/]*")


class BadPath(ValueError):
    """A request path that could be read two ways (dot segments, encoded slashes, ...)."""


def split_path(raw_path: str) -> list[str]:
    """Split and percent-decode a request path (no query) into segments.

    The path is forwarded byte for byte, so anything an upstream might normalise
    differently from us is refused rather than guessed at: dot segments (RFC 3986 §5.2.4),
    encoded `/` or `\\`, empty inner segments, control characters.
    """
    if not raw_path.startswith("/"):
        raise BadPath("the request target must be an absolute path")
    if _PLAIN_PATH.fullmatch(raw_path) and "/." not in raw_path and "//" not in raw_path:
        return raw_path[1:].split("/")  # nothing to decode and nothing to refuse
    parts = raw_path[1:].split("/")
    last = len(parts) - 1
    for i, part in enumerate(parts):
        if "%" in part:
            lowered = part.lower()
            if "%2f" in lowered or "%5c" in lowered:
                raise BadPath("encoded / or \\ in the path")
            try:
                part = unquote(part, errors="strict")
            except UnicodeDecodeError:
                raise BadPath("the path is not UTF-8 once percent-decoded") from None
            parts[i] = part
        # `..;x` is a dot segment to servers that strip path parameters (RFC 2396 §3.3).
        if part.partition(";")[0] in (".", ".."):
            raise BadPath("dot segments in the path")
        if not part and i != last:
            raise BadPath("empty segment in the path")
        if "\\" in part or any(ord(c) < 0x20 or ord(c) == 0x7F for c in part):
            raise BadPath("control characters or backslashes in the path")
    return parts


_ANY = ""  # bucket of rules for methods no rule names


class Router:
    """Rules indexed by method then first segment; `match` returns the first rule in file order."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = tuple(rules)
        methods = {m for r in rules if r.settings.methods for m in r.settings.methods}
        self._tables: dict[str, tuple[dict[str, tuple[Rule, ...]], tuple[Rule, ...]]] = {}
        for method in (*methods, _ANY):
            applicable = [
                r for r in rules if r.settings.methods is None or method in r.settings.methods
            ]
            wildcard = tuple(r for r in applicable if not _literal_first(r.pattern))
            firsts = {r.pattern.segments[0] for r in applicable if _literal_first(r.pattern)}
            buckets = {
                first: tuple(
                    r
                    for r in applicable
                    if not _literal_first(r.pattern) or r.pattern.segments[0] == first
                )
                for first in firsts
                if first is not None
            }
            self._tables[method] = (buckets, wildcard)

    def candidates(self, method: str, path: Sequence[str]) -> tuple[Rule, ...]:
        """The rules `match` tries for this request, in file order; no other rule could match."""
        buckets, wildcard = self._tables.get(method) or self._tables[_ANY]
        return buckets.get(path[0], wildcard) if path else wildcard

    def match(self, method: str, path: Sequence[str]) -> Rule | None:
        for rule in self.candidates(method, path):
            if rule.pattern.match(path):
                return rule
        return None


def _literal_first(pattern: Pattern) -> bool:
    return bool(pattern.segments) and pattern.segments[0] is not None


def compile_rules(routes: Iterable[RouteSettings], issuers: Sequence[IssuerSettings]) -> Router:
    compiled = []
    for index, route in enumerate(routes):
        allowed = route.issuers if route.issuers is not None else tuple(i.issuer for i in issuers)
        audiences = {
            i.issuer: frozenset((route.audience,) if route.audience else i.audiences)
            for i in issuers
            if i.issuer in allowed
        }
        compiled.append(
            Rule(
                index=index,
                settings=route,
                pattern=Pattern.parse(route.path),
                public=route.auth == "none",
                audiences_by_issuer=audiences,
            )
        )
    return Router(compiled)


@dataclass(frozen=True)
class Conflict:
    line: int
    message: str


def _methods_cover(outer: frozenset[str] | None, inner: frozenset[str] | None) -> bool:
    if outer is None:
        return True
    return inner is not None and inner <= outer


def find_conflicts(routes: Sequence[RouteSettings]) -> list[Conflict]:
    """Rules that can never match: an earlier rule takes all their methods and paths."""
    patterns = [Pattern.parse(r.path) for r in routes]
    conflicts: list[Conflict] = []
    for j, later in enumerate(routes):
        for i in range(j):
            earlier = routes[i]
            if not _methods_cover(earlier.methods, later.methods):
                continue
            if not patterns[i].covers(patterns[j]):
                continue
            same = patterns[i].covers(patterns[j]) and patterns[j].covers(patterns[i])
            what = "duplicates" if same and earlier.methods == later.methods else "is shadowed by"
            conflicts.append(
                Conflict(
                    later.line,
                    f"route {later.name!r} {what} route {earlier.name!r} (line {earlier.line}): "
                    "every request it matches is taken by that earlier rule, so it can never "
                    "apply; move it above or narrow the earlier rule",
                )
            )
            break
    return conflicts
