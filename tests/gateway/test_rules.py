"""gateway.core.rules: path templates, the indexed router, conflict detection, path splitting and
reading (`;` parameters, letter case), and HEAD going with GET."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import rules
from gateway.core.rules import (
    BadPath,
    Pattern,
    RequestPath,
    Router,
    Rule,
    find_case_variants,
    find_conflicts,
    methods_of,
    split_path,
)
from gateway.settings import IssuerSettings, RouteSettings
from tests.hypothesis_profiles import examples

ISSUERS = (
    IssuerSettings("https://a.example", ("api",)),
    IssuerSettings("https://b.example", ("other",)),
)


def route(
    name: str, path: str, methods: Sequence[str] | None = None, line: int = 0, **more: object
) -> RouteSettings:
    return RouteSettings(
        name=name,
        path=path,
        methods=frozenset(methods) if methods is not None else None,
        line=line,
        **more,  # type: ignore[arg-type]
    )


def router(*routes: RouteSettings, fold_case: bool = False) -> Router:
    return rules.compile_rules(routes, ISSUERS, fold_case=fold_case)


def matched(r: Router, method: str, path: str) -> str | None:
    rule = r.match(method, split_path(path))
    return rule.name if rule else None


# ---------------------------------------------------------------------------- templates


@pytest.mark.parametrize(
    ("template", "segments", "params", "tail"),
    [
        ("/", ("",), (None,), False),
        ("/**", (), (), True),
        ("/orders", ("orders",), (None,), False),
        ("/orders/", ("orders", ""), (None, None), False),
        ("/orders/{id}", ("orders", None), (None, "id"), False),
        ("/orders/**", ("orders",), (None,), True),
        ("/{tenant}/orders/{id}/**", (None, "orders", None), ("tenant", None, "id"), True),
        ("/a-b_c.d~e/x:y@z", ("a-b_c.d~e", "x:y@z"), (None, None), False),
    ],
)
def test_template_parses_into_literal_param_and_tail_segments(
    template: str,
    segments: tuple[str | None, ...],
    params: tuple[str | None, ...],
    tail: bool,
) -> None:
    pattern = Pattern.parse(template)
    assert (pattern.template, pattern.segments, pattern.params, pattern.tail) == (
        template,
        segments,
        params,
        tail,
    )


@pytest.mark.parametrize(
    ("template", "fragment"),
    [
        ("", "must start with /"),
        ("orders/**", "must start with /"),
        ("/a/**/b", "** may only be the last segment"),
        ("/**/**", "** may only be the last segment"),
        ("/{a}/{a}", "uses {a} twice"),
        ("/a/..", "dot segments"),
        ("/./a", "dot segments"),
        ("/a//b", "empty segment"),
        ("//**", "write /** rather than //**"),
        ("/a*", "neither literal nor {name}"),
        ("/{1x}", "neither literal nor {name}"),
        ("/a/{b}c", "neither literal nor {name}"),
        ("/a#frag", "without query or fragment"),
        ("/a b", "characters a path cannot hold"),
        ("/caf%C3%A9", "characters a path cannot hold"),
        ("/a;v=1", "holds ';'"),
        ("/a/;/**", "holds ';'"),
    ],
)
def test_bad_template_is_refused(template: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        Pattern.parse(template)


# ---------------------------------------------------------------------------- matching


@pytest.mark.parametrize(
    ("template", "path", "expected"),
    [
        ("/orders", "/orders", True),
        ("/orders", "/orders/", False),
        ("/orders", "/order", False),
        ("/orders", "/orders/7", False),
        ("/orders/", "/orders/", True),
        ("/orders/", "/orders", False),
        ("/orders/{id}", "/orders/7", True),
        ("/orders/{id}", "/orders/", False),  # a {param} needs a non-empty segment
        ("/orders/{id}", "/orders", False),
        ("/orders/{id}", "/orders/7/items", False),
        ("/orders/**", "/orders", True),  # ** matches zero segments
        ("/orders/**", "/orders/", True),
        ("/orders/**", "/orders/7/items/3", True),
        ("/orders/**", "/ordersx", False),
        ("/**", "/", True),
        ("/**", "/anything/at/all", True),
        ("/", "/", True),
        ("/", "/x", False),
        ("/{p}", "/", False),
        ("/{a}/x/**", "/t/x", True),
        ("/{a}/x/**", "/t/y", False),
    ],
)
def test_pattern_matches_split_paths(template: str, path: str, expected: bool) -> None:
    assert Pattern.parse(template).match(split_path(path)) is expected


def test_bind_returns_the_param_values_of_a_match() -> None:
    pattern = Pattern.parse("/{tenant}/orders/{id}/**")
    assert pattern.bind(split_path("/acme/orders/42/lines/1")) == {"tenant": "acme", "id": "42"}


def test_first_matching_rule_in_file_order_wins() -> None:
    r = router(
        route("one", "/orders/{id}", ["GET"]),
        route("all", "/orders/**"),
        route("root", "/"),
        route("rest", "/**"),
    )
    assert matched(r, "GET", "/orders/7") == "one"
    assert matched(r, "PUT", "/orders/7") == "all"
    assert matched(r, "GET", "/orders/7/lines") == "all"
    assert matched(r, "GET", "/") == "root"
    assert matched(r, "GET", "/elsewhere") == "rest"


def test_wildcard_first_rule_before_literal_rules_takes_their_requests() -> None:
    r = router(
        route("tenant-admin", "/{tenant}/admin"),
        route("acme", "/acme/**"),
        route("billing", "/billing/**", ["GET"]),
    )
    assert matched(r, "GET", "/acme/admin") == "tenant-admin"
    assert matched(r, "GET", "/billing/admin") == "tenant-admin"
    assert matched(r, "GET", "/acme/other") == "acme"
    assert matched(r, "GET", "/billing/x") == "billing"
    assert matched(r, "POST", "/billing/x") is None


def test_wildcard_first_rule_after_literal_rules_gets_only_what_they_leave() -> None:
    r = router(
        route("acme", "/acme/**", ["GET"]),
        route("x", "/x"),
        route("tenant", "/{tenant}/**"),
    )
    assert matched(r, "GET", "/acme/admin") == "acme"
    assert matched(r, "DELETE", "/acme/admin") == "tenant"
    assert matched(r, "GET", "/x") == "x"
    assert matched(r, "GET", "/x/y") == "tenant"
    assert matched(r, "GET", "/other") == "tenant"
    assert matched(r, "GET", "/") is None


def test_method_no_rule_names_meets_only_rules_without_methods() -> None:
    r = router(
        route("read", "/orders/**", ["GET", "HEAD"]),
        route("write", "/orders/{id}", ["PUT"]),
        route("any-orders", "/orders/{id}/**"),
    )
    assert matched(r, "HEAD", "/orders/1") == "read"
    assert matched(r, "PUT", "/orders/1") == "write"
    assert matched(r, "PATCH", "/orders/1") == "any-orders"
    assert matched(r, "PROPFIND", "/orders/1") == "any-orders"
    assert matched(r, "PATCH", "/orders") is None


def test_a_rule_naming_get_takes_head_too_and_nothing_else_it_does_not_name() -> None:
    assert methods_of(route("r", "/", ["GET"])) == {"GET", "HEAD"}
    assert methods_of(route("r", "/", ["GET", "POST"])) == {"GET", "HEAD", "POST"}
    assert methods_of(route("r", "/", ["HEAD"])) == {"HEAD"}  # HEAD does not imply GET
    assert methods_of(route("r", "/", ["POST"])) == {"POST"}
    assert methods_of(route("r", "/", None)) is None
    r = router(
        route("reports", "/reports/**", ["GET"], scopes=None),
        route("drop", "/reports/**", auth="none"),
    )
    assert matched(r, "HEAD", "/reports/q3") == "reports"
    assert matched(r, "GET", "/reports/q3") == "reports"
    assert matched(r, "OPTIONS", "/reports/q3") == "drop"
    assert r.rules[0].methods == {"GET", "HEAD"}


def test_a_head_only_rule_does_not_take_get() -> None:
    r = router(route("peek", "/x", ["HEAD"]), route("rest", "/x"))
    assert matched(r, "HEAD", "/x") == "peek"
    assert matched(r, "GET", "/x") == "rest"


def test_unmatched_request_gets_no_rule() -> None:
    r = router(route("orders", "/orders/**", ["GET"]))
    assert matched(r, "GET", "/users") is None
    assert matched(r, "POST", "/orders/1") is None


def test_index_keeps_candidates_to_the_requests_bucket_however_many_routes() -> None:
    many = [route(f"r{i}", f"/svc{i}/**", ["GET"] if i % 2 else None) for i in range(300)]
    wildcard = [route("tenant", "/{tenant}/special"), route("rest", "/**", ["GET"])]
    r = router(*many[:150], wildcard[0], *many[150:], wildcard[1])
    for i in (0, 1, 149, 150, 151, 298, 299):
        segments = split_path(f"/svc{i}/thing")
        candidates = r.candidates("GET", segments)
        assert [c.name for c in candidates] == (
            [f"r{i}", "tenant", "rest"] if i < 150 else ["tenant", f"r{i}", "rest"]
        )
        assert r.match("GET", segments).name == f"r{i}"  # type: ignore[union-attr]
    # Odd-numbered routes are GET-only: a DELETE sees neither them nor the GET catch-all.
    assert [c.name for c in r.candidates("DELETE", split_path("/svc3/x"))] == ["tenant"]
    assert [c.name for c in r.candidates("DELETE", split_path("/svc4/x"))] == ["r4", "tenant"]
    assert [c.name for c in r.candidates("GET", split_path("/nowhere"))] == ["tenant", "rest"]


def test_compiled_rule_accepts_listed_issuers_with_their_or_the_route_audiences() -> None:
    r = router(
        route("all", "/a"),
        route("only-b", "/b", issuers=("https://b.example",)),
        route("override", "/c", audience="special"),
        route("open", "/d", auth="none"),
    )
    all_, only_b, override, open_ = r.rules
    assert all_.audiences_by_issuer == {
        "https://a.example": frozenset({"api"}),
        "https://b.example": frozenset({"other"}),
    }
    assert only_b.audiences_by_issuer == {"https://b.example": frozenset({"other"})}
    assert override.audiences_by_issuer == {
        "https://a.example": frozenset({"special"}),
        "https://b.example": frozenset({"special"}),
    }
    assert (all_.public, open_.public) == (False, True)
    assert [rule.index for rule in r.rules] == [0, 1, 2, 3]


# ---------------------------------------------------------------------------- conflicts


def conflict_messages(*routes: RouteSettings) -> list[tuple[int, str]]:
    return [(c.line, c.message.split(":")[0]) for c in find_conflicts(routes)]


def test_exact_duplicate_rule_is_a_conflict() -> None:
    assert conflict_messages(
        route("a", "/orders/{id}", ["GET"], line=3), route("b", "/orders/{x}", ["GET"], line=4)
    ) == [(4, "route 'b' duplicates route 'a' (line 3)")]


def test_rule_shadowed_by_an_earlier_broader_path_is_a_conflict() -> None:
    assert conflict_messages(
        route("broad", "/orders/**", line=1),
        route("narrow", "/orders/{id}/items", ["GET"], line=2),
        route("root", "/orders", line=3),
    ) == [
        (2, "route 'narrow' is shadowed by route 'broad' (line 1)"),
        (3, "route 'root' is shadowed by route 'broad' (line 1)"),
    ]


def test_rule_shadowed_by_an_earlier_rule_with_more_methods_is_a_conflict() -> None:
    assert conflict_messages(
        route("rw", "/orders/{id}", ["GET", "PUT"], line=1),
        route("r", "/orders/{id}", ["GET"], line=2),
        route("any", "/x", line=3),
        route("get-x", "/x", ["GET"], line=4),
    ) == [
        (2, "route 'r' is shadowed by route 'rw' (line 1)"),
        (4, "route 'get-x' is shadowed by route 'any' (line 3)"),
    ]


def test_later_broader_rule_or_different_methods_are_not_conflicts() -> None:
    assert (
        find_conflicts(
            [
                route("narrow", "/orders/{id}", ["GET"]),
                route("broad", "/orders/**", ["GET"]),
                route("write", "/orders/{id}", ["PUT"]),
                route("any-method", "/orders/{id}"),  # PATCH etc. still reach it
                route("everything", "/**"),
            ]
        )
        == []
    )


def test_param_does_not_cover_an_empty_literal_segment() -> None:
    # "/orders/{id}" never takes "/orders/", and neither "/{x}" nor "/{x}/**" takes "/":
    # only the second "/" is unreachable.
    assert conflict_messages(
        route("item", "/orders/{id}", line=1),
        route("trailing", "/orders/", line=2),
        route("param-root", "/{x}", line=3),
        route("under", "/{x}/**", line=4),
        route("root", "/", line=5),
        route("root-again", "/", line=6),
    ) == [(6, "route 'root-again' duplicates route 'root' (line 5)")]


def test_a_get_rule_shadows_a_later_head_rule_and_duplicates_a_get_head_one() -> None:
    assert conflict_messages(
        route("read", "/orders/**", ["GET"], line=1),
        route("peek", "/orders/{id}", ["HEAD"], line=2),
        route("again", "/orders/**", ["GET", "HEAD"], line=3),
    ) == [
        (2, "route 'peek' is shadowed by route 'read' (line 1)"),
        (3, "route 'again' duplicates route 'read' (line 1)"),
    ]
    # HEAD does not take GET, so a GET rule after a HEAD rule still gets its requests.
    assert find_conflicts([route("peek", "/x", ["HEAD"]), route("read", "/x", ["GET"])]) == []


def test_with_case_folded_templates_case_variants_are_duplicates() -> None:
    table = [route("upper", "/Docs/**", line=1), route("lower", "/docs/**", line=2)]
    assert find_conflicts(table) == []
    assert conflict_messages(*table) == []
    assert [c.line for c in find_conflicts(table, fold_case=True)] == [2]


def test_literal_does_not_cover_a_param_segment() -> None:
    assert find_conflicts([route("lit", "/orders/7"), route("param", "/orders/{id}")]) == []


# ---------------------------------------------------------------------------- properties

SEGMENTS = st.sampled_from(["a", "b", "{p}", ""])
METHODS = st.sampled_from([None, ("GET",), ("HEAD",), ("PUT",), ("GET", "PUT"), ("HEAD", "PUT")])
REQUEST_METHODS = ("GET", "HEAD", "PUT", "DELETE")
PATH_SEGMENTS = ["a", "b", "c", ""]


@st.composite
def templates(draw: st.DrawFn) -> str:
    parts = draw(st.lists(SEGMENTS, max_size=3))
    # Empty literal segments are only valid last, and not before `**`.
    parts = [p for p in parts[:-1] if p] + parts[-1:]
    tail = draw(st.booleans())
    if tail and parts and parts[-1] == "":
        parts.pop()
    names = iter(f"{{p{i}}}" for i in range(10))
    parts = [next(names) if p == "{p}" else p for p in parts]
    return "/" + "/".join([*parts, "**"] if tail else parts)


@st.composite
def route_tables(draw: st.DrawFn) -> list[RouteSettings]:
    n = draw(st.integers(min_value=1, max_value=6))
    return [route(f"r{i}", draw(templates()), draw(METHODS), line=i + 1) for i in range(n)]


paths = st.lists(st.sampled_from(PATH_SEGMENTS), min_size=1, max_size=4).map(
    lambda segs: [s for s in segs[:-1] if s] + segs[-1:]
)


def naive_first_match(table: Sequence[Rule], method: str, path: list[str]) -> Rule | None:
    """The documented semantics, written out plainly: the first rule in file order whose
    path matches and that names the method (or names none); naming GET names HEAD too."""
    for rule in table:
        named = rule.settings.methods
        takes = named is None or method in named or (method == "HEAD" and "GET" in named)
        if takes and rule.pattern.match(path):
            return rule
    return None


@settings(max_examples=examples(300), deadline=None)
@given(table=route_tables(), method=st.sampled_from(REQUEST_METHODS), path=paths)
def test_router_agrees_with_a_linear_first_match_scan(
    table: list[RouteSettings], method: str, path: list[str]
) -> None:
    r = rules.compile_rules(table, ISSUERS)
    assert r.match(method, path) is naive_first_match(r.rules, method, path)


def all_paths(max_len: int) -> list[list[str]]:
    """Every request path of up to max_len segments over PATH_SEGMENTS (inner ones non-empty)."""
    out: list[list[str]] = []
    for n in range(1, max_len + 1):
        for combo in itertools.product(PATH_SEGMENTS, repeat=n):
            if all(combo[:-1]):
                out.append(list(combo))
    return out


UNIVERSE = all_paths(5)


@settings(max_examples=examples(300), deadline=None)
@given(earlier=templates(), later=templates())
def test_covers_holds_exactly_when_every_path_of_the_later_is_matched_by_the_earlier(
    earlier: str, later: str
) -> None:
    outer, inner = Pattern.parse(earlier), Pattern.parse(later)
    contained = all(outer.match(p) for p in UNIVERSE if inner.match(p))
    assert outer.covers(inner) is contained


@settings(max_examples=examples(200), deadline=None)
@given(table=route_tables())
def test_a_rule_reported_as_unreachable_never_wins_a_request(table: list[RouteSettings]) -> None:
    unreachable = {c.line for c in find_conflicts(table)}
    r = rules.compile_rules(table, ISSUERS)
    for method in REQUEST_METHODS:
        for path in UNIVERSE:
            winner = r.match(method, path)
            assert winner is None or winner.settings.line not in unreachable


# ---------------------------------------------------------------------------- split_path


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("/", [""]),
        ("/orders", ["orders"]),
        ("/orders/", ["orders", ""]),
        ("/orders/7/items", ["orders", "7", "items"]),
        ("/caf%C3%A9", ["café"]),
        ("/a%20b", ["a b"]),
        ("/100%25", ["100%"]),
        ("/%2e%2e%2e", ["..."]),
        ("/.well-known/x", [".well-known", "x"]),
        ("/a;b=c", ["a;b=c"]),
    ],
)
def test_split_path_decodes_normal_paths(raw: str, expected: list[str]) -> None:
    assert split_path(raw) == expected


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("orders", "absolute path"),
        ("/a/../b", "dot segments"),
        ("/a/./b", "dot segments"),
        ("/a/..", "dot segments"),
        ("/a/%2e%2e/b", "dot segments"),
        ("/a/%2E%2e", "dot segments"),
        ("/a/%2e/b", "dot segments"),
        ("/public/..;/admin", "dot segments"),
        ("/a%2fb", "encoded / or \\"),
        ("/a%2Fb", "encoded / or \\"),
        ("/a%5cb", "encoded / or \\"),
        ("/a%5Cb", "encoded / or \\"),
        ("/a//b", "empty segment"),
        ("//", "empty segment"),
        ("/a/%0a", "control characters"),
        ("/a/%00", "control characters"),
        ("/a/%7F", "control characters"),
        ("/a\\b", "backslashes"),
        ("/a/%ff", "not UTF-8"),
        ("/a/%c3", "not UTF-8"),
        ("/a/%C3%28", "not UTF-8"),
    ],
)
def test_split_path_refuses_paths_that_could_be_read_two_ways(raw: str, reason: str) -> None:
    with pytest.raises(BadPath) as caught:
        split_path(raw)
    assert reason in str(caught.value)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("orders", "bad_target"),
        ("/a/../b", "path_traversal"),
        ("/a/%2e%2e", "path_traversal"),
        ("/public/..;/admin", "path_traversal"),
        ("/public/.;x/admin", "path_traversal"),
        ("/a%2fb", "encoded_separator"),
        ("/a//b", "empty_segment"),
        ("/a/%0a", "control_character"),
        ("/a\\b", "backslash"),
        ("/a/%5c", "encoded_separator"),
        ("/a/%ff", "bad_encoding"),
    ],
)
def test_each_refusal_carries_a_short_reason_code(raw: str, reason: str) -> None:
    with pytest.raises(BadPath) as caught:
        split_path(raw)
    assert caught.value.reason == reason


# ---------------------------------------------------------------------------- reading paths

PUBLIC_DOCS = (
    route("internal", "/docs/internal/**"),
    route("docs", "/docs/**", auth="none"),
)


@pytest.mark.parametrize(
    "raw",
    [
        "/docs/internal;x=1/secret",
        "/docs/internal;/secret",
        "/docs/readme;v=2",
        "/docs/internal%3Bx/secret",
        "/docs/internal%3b/secret",
        "/;x",
    ],
)
def test_path_parameters_are_refused_when_no_route_allows_them(raw: str) -> None:
    with pytest.raises(BadPath, match=r"path parameters \(;\)") as caught:
        router(*PUBLIC_DOCS).read(raw)
    assert caught.value.reason == "path_parameters"


def test_a_path_without_parameters_is_read_as_split_path_splits_it() -> None:
    r = router(*PUBLIC_DOCS)
    assert r.read("/docs/caf%C3%A9/x") == RequestPath(["docs", "café", "x"], False)
    assert r.read("/docs/Readme") == RequestPath(["docs", "Readme"], False)


ALLOWING = (
    route("internal", "/docs/internal/**"),
    route("docs", "/docs/**", auth="none", path_params="allow"),
)


@pytest.mark.parametrize(
    ("raw", "segments"),
    [
        ("/docs/internal;x=1/secret", ["docs", "internal", "secret"]),
        ("/docs/internal%3Bx/secret", ["docs", "internal", "secret"]),
        ("/docs/readme;v=2;w=3", ["docs", "readme"]),
        ("/docs/a;b%3Bc/d", ["docs", "a", "d"]),
        ("/docs/readme/;v=2", ["docs", "readme", ""]),
        ("/;x", [""]),
    ],
)
def test_once_a_route_allows_parameters_every_path_is_read_without_them(
    raw: str, segments: list[str]
) -> None:
    assert router(*ALLOWING).read(raw) == RequestPath(segments, True)


def test_the_rule_is_chosen_on_the_path_without_parameters_and_must_allow_them() -> None:
    r = router(*ALLOWING)
    with pytest.raises(BadPath) as caught:
        r.route("GET", r.read("/docs/internal;x=1/secret"))
    assert caught.value.reason == "path_parameters"
    assert r.route("GET", r.read("/docs/internal/secret")).name == "internal"  # type: ignore[union-attr]
    assert r.route("GET", r.read("/docs/guide;v=2")).name == "docs"  # type: ignore[union-attr]
    with pytest.raises(BadPath):
        r.route("GET", r.read("/elsewhere;v=2"))  # unmatched: no rule allows it either
    assert r.route("GET", r.read("/elsewhere")) is None


@pytest.mark.parametrize("raw", ["/docs/;x/internal", "/;x/docs", "/docs/%3Bx/internal"])
def test_a_segment_emptied_by_removing_parameters_is_refused(raw: str) -> None:
    # Tomcat reads /docs/;x/internal as /docs//internal, and many servers then as
    # /docs/internal: the segment cannot be kept empty, nor dropped on a guess.
    with pytest.raises(BadPath) as caught:
        router(*ALLOWING).read(raw)
    assert caught.value.reason == "empty_segment"


def test_folded_case_matches_templates_and_paths_in_lower_case() -> None:
    r = router(
        route("internal", "/Docs/Internal/{Page}"),
        route("docs", "/docs/**", auth="none"),
        fold_case=True,
    )
    assert r.rules[0].pattern.segments == ("docs", "internal", None)
    assert r.rules[0].pattern.params == (None, None, "Page")
    for raw in ("/docs/internal/x", "/DOCS/INTERNAL/X", "/dOcS/%49nternal/x"):
        path = r.read(raw)
        assert path.segments[:2] == ["docs", "internal"]
        assert r.route("GET", path).name == "internal"  # type: ignore[union-attr]
    assert r.read("/D%C3%89J%C3%80") == RequestPath(["déjà"], False)
    sensitive = router(route("internal", "/docs/internal/**"), route("docs", "/docs/**"))
    assert sensitive.read("/DOCS/INTERNAL/x").segments == ["DOCS", "INTERNAL", "x"]


def test_folded_case_and_parameters_combine() -> None:
    r = router(
        route("internal", "/docs/internal/**"),
        route("docs", "/docs/**", auth="none", path_params="allow"),
        fold_case=True,
    )
    with pytest.raises(BadPath):
        r.route("GET", r.read("/DOCS/INTERNAL;x=1/y"))
    assert r.read("/DOCS/Guide;V=2") == RequestPath(["docs", "guide"], True)


@pytest.mark.parametrize(
    "letter", ["\u0131", "\u0130", "\u017f", "\u212a", "\u00df", "\u1e9e", "\ufb01"]
)
def test_folded_case_refuses_letters_servers_fold_into_ascii_differently(letter: str) -> None:
    r = router(route("any", "/**"), fold_case=True)
    raw = "/docs/" + "".join(f"%{b:02X}" for b in f"adm{letter}n".encode())
    with pytest.raises(BadPath) as caught:
        r.read(raw)
    assert caught.value.reason == "ambiguous_case"
    # Sent without percent-encoding too, and refused only when case is folded.
    with pytest.raises(BadPath):
        r.read(f"/docs/adm{letter}n")
    assert router(route("any", "/**")).read(raw).segments == ["docs", f"adm{letter}n"]


def _maps_onto(segment: str, literal: str) -> bool:
    """Whether some common case comparison takes `segment` for the ASCII `literal`."""
    return any(fold(segment) == fold(literal) for fold in (str.upper, str.lower, str.casefold))


# How a letter of an ASCII literal may be written so that some case comparison still takes
# it for that letter: either case, and the non-ASCII letters that map onto it.
SPELLINGS = {
    "a": "aA",
    "f": "fF",
    "i": "iI\u0131\u0130",
    "k": "kK\u212a",
    "s": "sS\u017f",
    "ss": "\u00df\u1e9e",
    "fi": "\ufb01",
}


@st.composite
def spelled(draw: st.DrawFn) -> tuple[str, str]:
    """An ASCII literal, and a segment spelling it with other cases or look-alike letters."""
    parts = draw(st.lists(st.sampled_from(sorted(SPELLINGS)), min_size=1, max_size=4))
    literal = "".join(draw(st.sampled_from([p, p.upper()])) for p in parts)
    segment = "".join(draw(st.sampled_from(SPELLINGS[p])) for p in parts)
    return literal, segment


@settings(max_examples=examples(300), deadline=None)
@given(pair=spelled())
def test_a_segment_any_upstream_could_take_for_a_literal_is_refused_or_folds_onto_it(
    pair: tuple[str, str],
) -> None:
    literal, segment = pair
    r = router(route("any", "/**"), fold_case=True)
    try:
        [folded] = r.read("/" + "".join(f"%{b:02X}" for b in segment.encode())).segments
    except BadPath:
        assert not segment.isascii()
        return
    if _maps_onto(segment, literal):
        assert folded == literal.lower()


# ---------------------------------------------------------------------------- case variants


def variant_warnings(*routes: RouteSettings) -> list[tuple[int, str]]:
    return [(c.line, c.message.split(", which")[0]) for c in find_case_variants(routes)]


def test_a_public_rule_taking_case_variants_of_a_protected_path_is_named() -> None:
    assert variant_warnings(
        route("internal", "/docs/internal/**", line=1),
        route("docs", "/docs/**", auth="none", line=2),
    ) == [(2, "route 'docs' (auth: none) takes GET /docs/INTERNAL")]
    # The case variant written into the public rule itself, before or after.
    assert variant_warnings(
        route("open", "/Admin/**", ["POST"], auth="none", line=1),
        route("admin", "/admin/{id}", line=2),
    ) == [(1, "route 'open' (auth: none) takes POST /Admin/x")]


def test_no_case_variant_warning_where_none_can_reach_a_public_rule() -> None:
    assert (
        find_case_variants(
            [
                route("health", "/healthz", auth="none"),
                route("public", "/public/**", auth="none"),
                route("orders", "/orders/**"),
                route("tenant", "/{tenant}/**"),  # nothing to vary: no letters to change
                route("rest", "/**"),
            ]
        )
        == []
    )
    # Methods that never meet, and a variant another protected rule takes first.
    assert (
        find_case_variants(
            [
                route("write", "/docs/internal/**", ["POST"]),
                route("read", "/docs/**", ["GET"], auth="none"),
            ]
        )
        == []
    )
    assert (
        find_case_variants(
            [
                route("internal", "/docs/internal/**"),
                route("any-second", "/{a}/{b}/**"),
                route("docs", "/docs/**", auth="none"),
            ]
        )
        == []
    )


CASED_UNIVERSE = [
    list(combo)
    for n in range(1, 5)
    for combo in itertools.product(["a", "b", "A", "B", "c", ""], repeat=n)
    if all(combo[:-1])
]


@settings(max_examples=examples(300), deadline=None)
@given(protected=templates(), public=templates())
def test_a_case_variant_is_found_exactly_when_one_exists(protected: str, public: str) -> None:
    """The public pattern takes a path the protected one does not, whose lower-case form the
    protected one takes (the templates drawn are in lower case)."""
    mine, theirs = Pattern.parse(protected), Pattern.parse(public)
    example = rules._case_variant(mine, theirs)
    exists = any(
        theirs.match(p) and not mine.match(p) and mine.match([s.lower() for s in p])
        for p in CASED_UNIVERSE
    )
    assert (example is not None) is exists
    if example is not None:
        assert theirs.match(example)
        assert not mine.match(example)
        assert mine.match([s.lower() for s in example])
