"""Route rules: compiled once, matched on every request without scanning the whole table.

A path template is literal segments, `{name}` segments (exactly one non-empty segment) and an
optional trailing `**` (zero or more segments): `/orders/{id}`, `/admin/**`, `/**`.

Matching is first-match-wins in file order. The table is indexed by method and first path
segment, so a request only looks at the rules that could match it; rules whose first segment
is not a literal are merged into every bucket at start-up, keeping file order.

A request path is read once (`Router.read`) into what rules match: split and percent-decoded,
with anything an upstream could read differently refused (`BadPath`). Two settings change the
reading, and they are paid for only when configured:
- `;` path parameters (RFC 3986 §3.3) are refused, unless some route allows them: then every
  request is matched on its path with the parameters removed, as Tomcat, Jetty and Spring
  serve it, and a request that had some is refused unless the rule it meets allows them.
- With case-insensitive matching, templates and paths are compared in lower case.
A rule naming GET also takes HEAD (RFC 9110 §9.3.2), as the frameworks behind it do.

Rules are made of plain routes: anything with the attributes of `RouteSpec` (the running
gateway's `records.Route`; `settings.RouteSettings` too, which reads this module to check
paths and the table at load). A `Rule` keeps the route it was made of, with its type, for
the steps after it.

`find_conflicts` rejects at load time a rule that can never match because an earlier rule
takes every request it would match (including exact duplicates); `find_case_variants` warns
where an upstream that ignores case would let a public rule take a protected rule's request.

Pure: no aiohttp, no I/O.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar
from urllib.parse import unquote

# An HTTP method as rules name it: an RFC 9110 §9.1 token, in upper case.
HTTP_METHOD = re.compile(r"^[A-Z][A-Z0-9!#$%&'*+.^_`|~-]*$")


class RouteSpec(Protocol):
    """What a rule is made of: a route as the configuration gives it."""

    @property
    def name(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def methods(self) -> frozenset[str] | None: ...  # None: every method
    @property
    def auth(self) -> str: ...  # required | none
    @property
    def issuers(self) -> tuple[str, ...] | None: ...  # None: every issuer
    @property
    def audience(self) -> str | None: ...  # None: the issuer's audiences
    @property
    def resource_uri(self) -> str | None: ...  # its resource's canonical URI, when known
    @property
    def path_params(self) -> str: ...  # refuse | allow
    @property
    def line(self) -> int: ...


class IssuerSpec(Protocol):
    """What a rule needs of a trusted issuer."""

    @property
    def issuer(self) -> str: ...
    @property
    def audiences(self) -> tuple[str, ...]: ...


R = TypeVar("R", bound=RouteSpec)

_PARAM = re.compile(r"^\{([A-Za-z_][A-Za-z0-9_]*)\}$")
# Characters a literal template segment may hold: RFC 3986 pchar without percent-encoding,
# and without `;`: request paths reach the rules with their parameters refused or removed.
_LITERAL = re.compile(r"^[A-Za-z0-9\-._~!$&'()*+,=:@]*$")


@dataclass(frozen=True)
class Pattern:
    """A compiled path template. `segments[i]` is a literal, or None for a `{param}`."""

    template: str
    segments: tuple[str | None, ...]
    params: tuple[str | None, ...]
    tail: bool  # ends with `**`

    @classmethod
    def parse(cls, template: str, *, fold_case: bool = False) -> Pattern:
        """Compile a template; with `fold_case`, its literal segments are kept in lower case
        (they are ASCII, so that is their whole case folding)."""
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
            elif ";" in part:
                raise ValueError(
                    f"{template!r}: segment {part!r} holds ';', which no request path reaches "
                    "the rules with (path parameters are refused, or removed with "
                    "path_params: allow)"
                )
            elif not _LITERAL.match(part):
                raise ValueError(
                    f"{template!r}: segment {part!r} has characters a path cannot hold"
                )
            else:
                segments.append(part.lower() if fold_case else part)
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


def methods_of(route: RouteSpec) -> frozenset[str] | None:
    """The methods a rule takes (None: all): those it names, and HEAD with GET.

    RFC 9110 §9.3.2: HEAD is GET without the content, and frameworks answer it with the GET
    handler; a rule that left HEAD to a later rule would let that rule decide on the very
    resource this one protects.
    """
    methods = route.methods
    if methods is not None and "GET" in methods and "HEAD" not in methods:
        return methods | {"HEAD"}
    return methods


@dataclass(frozen=True)
class Rule(Generic[R]):
    """A route ready for requests: its pattern, and the audiences accepted per issuer."""

    index: int
    settings: R
    pattern: Pattern
    public: bool
    # issuer -> audiences a token from that issuer must name one of; issuers absent here
    # are not accepted on this route.
    audiences_by_issuer: Mapping[str, frozenset[str]]
    methods: frozenset[str] | None  # what it takes: `methods_of(settings)`
    path_params: bool  # requests with `;` parameters may use it

    @property
    def name(self) -> str:
        return self.settings.name


# Paths made only of these characters need no decoding and hold nothing split_path refuses,
# except dot segments and `//`, which are looked for separately.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9\-._~!$&'()*+,;=:@/]*")


class BadPath(ValueError):
    """A request path that could be read two ways (dot segments, encoded slashes, ...).

    `reason` is a short fixed code (the metrics label and the access log's reason).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def split_path(raw_path: str) -> list[str]:
    """Split and percent-decode a request path (no query) into segments.

    The path is forwarded byte for byte, so anything an upstream might normalise
    differently from us is refused rather than guessed at: dot segments (RFC 3986 §5.2.4),
    encoded `/` or `\\`, empty inner segments, control characters. `;` parameters are left
    in their segments: `Router.read` decides about them.
    """
    if not raw_path.startswith("/"):
        raise BadPath("the request target must be an absolute path", "bad_target")
    if _PLAIN_PATH.fullmatch(raw_path) and "/." not in raw_path and "//" not in raw_path:
        return raw_path[1:].split("/")  # nothing to decode and nothing to refuse
    parts = raw_path[1:].split("/")
    last = len(parts) - 1
    for i, part in enumerate(parts):
        if "%" in part:
            lowered = part.lower()
            if "%2f" in lowered or "%5c" in lowered:
                raise BadPath("encoded / or \\ in the path", "encoded_separator")
            try:
                part = unquote(part, errors="strict")
            except UnicodeDecodeError:
                raise BadPath(
                    "the path is not UTF-8 once percent-decoded", "bad_encoding"
                ) from None
            parts[i] = part
        # `..;x` is a dot segment to servers that strip path parameters (RFC 2396 §3.3).
        if part.partition(";")[0] in (".", ".."):
            raise BadPath("dot segments in the path", "path_traversal")
        if not part and i != last:
            raise BadPath("empty segment in the path", "empty_segment")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in part):
            raise BadPath("control characters in the path", "control_character")
        if "\\" in part:
            raise BadPath("backslashes in the path", "backslash")
    return parts


class RequestPath(NamedTuple):
    """A request path as the rules see it."""

    segments: list[str]  # decoded; without `;` parameters and in lower case when configured
    parameters: bool  # the path had `;` parameters (they are not in `segments`)


_ASCII_LETTERS = frozenset(string.ascii_letters)


@functools.lru_cache(maxsize=1024)
def _folds_into_ascii(char: str) -> bool:
    """Whether some case mapping turns this non-ASCII character into ASCII letters.

    Servers disagree on whether these equal their ASCII look-alikes: U+0131 (dotless i)
    upper-cases to `I` and U+017F (long s) to `S`, so .NET, which compares upper-cased, takes
    them for `i` and `s`; JavaScript's case-insensitive patterns keep them apart outside Unicode
    mode; U+212A (Kelvin sign) lower-cases to `k`; full case folding turns `ß` into `ss`. No
    reading is safe to guess, so a path holding one is refused when case is ignored.
    """
    return any(
        c in _ASCII_LETTERS
        for mapped in (char.upper(), char.lower(), char.casefold())
        for c in mapped
    )


class Router(Generic[R]):
    """Rules indexed by method then first segment; `match` returns the first rule in file order."""

    def __init__(self, rules: Sequence[Rule[R]], *, fold_case: bool = False) -> None:
        self.rules = tuple(rules)
        self.fold_case = fold_case
        # One route allowing parameters makes every match use the path without them: the
        # rule that decides is the one the upstream will serve.
        self.strips_parameters = any(r.path_params for r in rules)
        methods = {m for r in rules if r.methods for m in r.methods}
        self._tables: dict[str, tuple[dict[str, tuple[Rule[R], ...]], tuple[Rule[R], ...]]] = {}
        for method in (*methods, _ANY):
            applicable = [r for r in rules if r.methods is None or method in r.methods]
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

    def read(self, raw_path: str) -> RequestPath:
        """The path (no query) as the rules match it; BadPath when it is refused whatever
        rule it meets."""
        segments = split_path(raw_path)
        # A `;` decoded from %3B counts too: some servers decode before they split off
        # parameters, so it cannot be told apart from a literal one.
        parameters = (";" in raw_path or "%" in raw_path) and any(";" in s for s in segments)
        if parameters:
            if not self.strips_parameters:
                raise _parameters_refused()
            _strip_parameters(segments)
        if self.fold_case:
            _fold_case(segments)
        return RequestPath(segments, parameters)

    def route(self, method: str, path: RequestPath) -> Rule[R] | None:
        """The rule for this request (None: unmatched); BadPath when the path has parameters
        and that rule does not allow them."""
        rule = self.match(method, path.segments)
        if path.parameters and (rule is None or not rule.path_params):
            raise _parameters_refused()
        return rule

    def candidates(self, method: str, path: Sequence[str]) -> tuple[Rule[R], ...]:
        """The rules `match` tries for this request, in file order; no other rule could match."""
        buckets, wildcard = self._tables.get(method) or self._tables[_ANY]
        return buckets.get(path[0], wildcard) if path else wildcard

    def match(self, method: str, path: Sequence[str]) -> Rule[R] | None:
        for rule in self.candidates(method, path):
            if rule.pattern.match(path):
                return rule
        return None


_ANY = ""  # bucket of rules for methods no rule names


def _parameters_refused() -> BadPath:
    # A new instance each time: a raised exception keeps the frames it passed through.
    return BadPath("path parameters (;) are not accepted on this route", "path_parameters")


def _strip_parameters(segments: list[str]) -> None:
    """Remove `;params` from every segment, as servers that honour them do (RFC 2396 §3.3)."""
    last = len(segments) - 1
    for i, segment in enumerate(segments):
        if ";" in segment:
            segment = segments[i] = segment.partition(";")[0]
            # `/a/;x/b` is `/a//b` to such a server, which many then read as `/a/b`.
            if not segment and i != last:
                raise BadPath(
                    "empty segment in the path once ;parameters are removed", "empty_segment"
                )


def _fold_case(segments: list[str]) -> None:
    for i, segment in enumerate(segments):
        if not segment.isascii() and any(_folds_into_ascii(c) for c in segment if not c.isascii()):
            raise BadPath(
                "a letter whose case servers fold differently (such as U+0131 or U+017F)",
                "ambiguous_case",
            )
        segments[i] = segment.lower()


def _literal_first(pattern: Pattern) -> bool:
    return bool(pattern.segments) and pattern.segments[0] is not None


def compile_rules(
    routes: Iterable[R],
    issuers: Sequence[IssuerSpec],
    *,
    fold_case: bool = False,
) -> Router[R]:
    compiled = []
    for index, route in enumerate(routes):
        allowed = route.issuers if route.issuers is not None else tuple(i.issuer for i in issuers)
        # RFC 8707 §2, RFC 9068 §4: a resource's canonical URI is an audience its tokens
        # may name, beside the configured ones.
        own = (route.resource_uri,) if route.resource_uri else ()
        audiences = {
            i.issuer: frozenset(((route.audience,) if route.audience else i.audiences) + own)
            for i in issuers
            if i.issuer in allowed
        }
        compiled.append(
            Rule(
                index=index,
                settings=route,
                pattern=Pattern.parse(route.path, fold_case=fold_case),
                public=route.auth == "none",
                audiences_by_issuer=audiences,
                methods=methods_of(route),
                path_params=route.path_params == "allow",
            )
        )
    return Router(compiled, fold_case=fold_case)


@dataclass(frozen=True)
class Conflict:
    """Something wrong with a rule, at its line."""

    line: int
    message: str


def _methods_cover(outer: frozenset[str] | None, inner: frozenset[str] | None) -> bool:
    if outer is None:
        return True
    return inner is not None and inner <= outer


def find_conflicts(routes: Sequence[RouteSpec], *, fold_case: bool = False) -> list[Conflict]:
    """Rules that can never match: an earlier rule takes all their methods and paths."""
    patterns = [Pattern.parse(r.path, fold_case=fold_case) for r in routes]
    methods = [methods_of(r) for r in routes]
    conflicts: list[Conflict] = []
    for j, later in enumerate(routes):
        for i in range(j):
            earlier = routes[i]
            if not _methods_cover(methods[i], methods[j]):
                continue
            if not patterns[i].covers(patterns[j]):
                continue
            same = patterns[j].covers(patterns[i]) and methods[i] == methods[j]
            what = "duplicates" if same else "is shadowed by"
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


def find_case_variants(routes: Sequence[RouteSpec]) -> list[Conflict]:
    """Public rules that take a request differing only in letter case from one a protected
    rule takes, such as `/docs/INTERNAL/x` beside a protected `/docs/internal/**` and a
    public `/docs/**`. Harmless while the upstream compares paths case-sensitively; an open
    door when it does not (Express by default, ASP.NET Core, IIS), unless
    `upstream.path_case: insensitive` makes the rules ignore case too."""
    patterns = [Pattern.parse(r.path) for r in routes]
    methods = [methods_of(r) for r in routes]
    found: list[Conflict] = []
    for j, public in enumerate(routes):
        if public.auth != "none":
            continue
        for i, protected in enumerate(routes):
            if protected.auth == "none" or not _methods_meet(methods[i], methods[j]):
                continue
            example = _case_variant(patterns[i], patterns[j])
            if example is None:
                continue
            method = _a_method(methods[i], methods[j])
            if _first_match(patterns, methods, method, example) != j:
                continue  # an earlier rule takes the variant (and is looked at on its own)
            found.append(
                Conflict(
                    public.line,
                    f"route {public.name!r} (auth: none) takes {method} /{'/'.join(example)}, "
                    f"which differs only in letter case from paths of the protected route "
                    f"{protected.name!r} (line {protected.line}); if the upstream ignores case "
                    "it serves both as one resource: set upstream.path_case: insensitive",
                )
            )
            break
    return found


def _first_match(
    patterns: Sequence[Pattern],
    methods: Sequence[frozenset[str] | None],
    method: str,
    path: list[str],
) -> int | None:
    for k, (pattern, taken) in enumerate(zip(patterns, methods, strict=True)):
        if (taken is None or method in taken) and pattern.match(path):
            return k
    return None


def _methods_meet(a: frozenset[str] | None, b: frozenset[str] | None) -> bool:
    return a is None or b is None or bool(a & b)


def _a_method(a: frozenset[str] | None, b: frozenset[str] | None) -> str:
    """A method both method sets take (they meet), for an example request."""
    both = a & b if a is not None and b is not None else a or b
    return "GET" if both is None or "GET" in both else min(both)


_ANYTHING = object()  # a segment position past a `**`: any segment at all


def _case_variant(protected: Pattern, public: Pattern) -> list[str] | None:
    """Segments of a path `public` matches that differ only in letter case from a path
    `protected` matches, without `protected` matching them; None when there is none."""
    n, m = len(protected.segments), len(public.segments)
    if not protected.tail and not (m == n or (public.tail and m <= n)):
        return None
    if not public.tail and not (n == m or (protected.tail and n <= m)):
        return None
    example: list[str] = []
    varied = False
    for k in range(max(n, m)):
        mine = protected.segments[k] if k < n else _ANYTHING
        theirs = public.segments[k] if k < m else _ANYTHING
        if isinstance(mine, str):
            if isinstance(theirs, str):
                if theirs.lower() != mine.lower():
                    return None
                segment = theirs
            elif theirs is None and not mine:
                return None  # a {param} takes no empty segment
            else:
                segment = mine.swapcase()
            varied = varied or segment != mine
        elif isinstance(theirs, str):
            if mine is None and not theirs:
                return None
            segment = theirs
        else:
            segment = "x"
        example.append(segment)
    return example if varied else None
