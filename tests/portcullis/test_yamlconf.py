"""portcullis.yamlconf: YAML with lines, ${VAR} interpolation, value parsers, problem collection."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from portcullis import yamlconf
from portcullis.yamlconf import ConfigError, Problem, Reader, Section


def load(text: str, env: dict[str, str] | None = None) -> yamlconf.LocatedMap:
    return yamlconf.load_text(text, "conf.yaml", env or {})


def problems_of(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(text, env)
    return [str(p) for p in caught.value.problems]


# ---------------------------------------------------------------------------- interpolation


def test_interpolate_expands_set_variables_and_defaults_and_lists_the_missing() -> None:
    text, missing = yamlconf.interpolate(
        "${A}-${B:-fallback}-${C}-${D:-}", {"A": "one", "C": "three"}
    )
    assert (text, missing) == ("one-fallback-three-", [])
    text, missing = yamlconf.interpolate("x${NOPE}y${ALSO}z", {})
    assert (text, missing) == ("xyz", ["NOPE", "ALSO"])


def test_empty_variable_takes_the_default_like_the_shell() -> None:
    assert yamlconf.interpolate("${E:-dflt}", {"E": ""}) == ("dflt", [])
    # Set but empty, no default: expands to nothing and is not reported as unset.
    assert yamlconf.interpolate("<${E}>", {"E": ""}) == ("<>", [])


def test_set_variable_wins_over_its_default() -> None:
    data = load("timeout: ${T:-5s}\n", {"T": "30s"})
    assert data["timeout"] == "30s"
    assert load("timeout: ${T:-5s}\n")["timeout"] == "5s"


def test_plain_scalar_takes_its_type_from_the_expanded_text() -> None:
    data = load(
        "port: ${PORT}\nenabled: ${ON}\nratio: ${R}\nname: ${NAME}\n",
        {"PORT": "8080", "ON": "true", "R": "0.5", "NAME": "orders"},
    )
    assert data["port"] == 8080 and type(data["port"]) is int
    assert data["enabled"] is True
    assert data["ratio"] == 0.5
    assert data["name"] == "orders"


def test_quoted_or_explicitly_tagged_scalar_stays_a_string_after_interpolation() -> None:
    data = load(
        "a: \"${PORT}\"\nb: '${PORT}'\nc: !!str ${PORT}\nd: |\n  ${PORT}\n", {"PORT": "8080"}
    )
    assert data["a"] == "8080"
    assert data["b"] == "8080"
    assert data["c"] == "8080"
    assert data["d"] == "8080\n"


def test_default_with_type_is_resolved_like_a_written_value() -> None:
    assert load("workers: ${WORKERS:-4}\n")["workers"] == 4


def test_double_dollar_is_a_literal_dollar_and_suppresses_expansion() -> None:
    data = load('secret: "pa$$word"\nliteral: "$${HOME}"\n', {"HOME": "/root"})
    assert data["secret"] == "pa$word"
    assert data["literal"] == "${HOME}"


def test_text_without_a_dollar_is_left_alone() -> None:
    assert load("a: plain {braces}\n")["a"] == "plain {braces}"


def test_unset_variable_without_default_is_an_error_on_its_line() -> None:
    text = "listen: ok\nupstream:\n  url: ${UPSTREAM_URL}\n"
    assert problems_of(text) == [
        "conf.yaml:3: environment variable UPSTREAM_URL is not set (use ${UPSTREAM_URL:-default})"
    ]


def test_every_unset_variable_is_reported_in_line_order() -> None:
    text = "a: ${ONE}\nb: ok\nc: [x, '${TWO}']\nd: ${THREE:-fine}\n"
    assert problems_of(text) == [
        "conf.yaml:1: environment variable ONE is not set (use ${ONE:-default})",
        "conf.yaml:3: environment variable TWO is not set (use ${TWO:-default})",
    ]


def test_unset_variable_reached_through_an_alias_is_reported_once() -> None:
    text = "a: &v ${NOPE}\nb: *v\nc: *v\n"
    assert problems_of(text) == [
        "conf.yaml:1: environment variable NOPE is not set (use ${NOPE:-default})"
    ]


def test_variables_are_expanded_in_keys_too() -> None:
    assert load("${K}: 1\n", {"K": "name"}) == {"name": 1}


def test_file_reference_is_replaced_by_the_file_without_its_trailing_line_break(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t value\n")
    crlf = tmp_path / "crlf"
    crlf.write_bytes(b"two\nlines\r\n")
    port = tmp_path / "port"
    port.write_text("8080\n")
    data = load(f'a: "${{file:{secret}}}"\nb: pre-${{file:{crlf}}}-post\nc: ${{file:{port}}}\n')
    assert data["a"] == "s3cr3t value"
    assert data["b"] == "pre-two\nlines-post"
    assert data["c"] == 8080  # a plain scalar takes its type from the expanded text


def test_unreadable_file_reference_is_an_error_on_its_line_naming_the_file(
    tmp_path: Path,
) -> None:
    absent = tmp_path / "absent"
    text = f"a: ok\nb:\n  c: ${{file:{absent}}}\nd: [x, '${{file:{absent}}}']\n"
    assert problems_of(text) == [
        f"conf.yaml:3: cannot read {absent}: No such file or directory",
        f"conf.yaml:4: cannot read {absent}: No such file or directory",
    ]


def test_interpolate_lists_an_unreadable_file_with_the_reason(tmp_path: Path) -> None:
    text, missing = yamlconf.interpolate(f"x${{file:{tmp_path}}}y$${{file:/etc/hostname}}", {})
    assert text == "xy${file:/etc/hostname}"
    assert missing == [f"file:{tmp_path}"]
    assert missing[0].problem == f"cannot read {tmp_path}: Is a directory"


def test_a_value_with_something_missing_is_reported_by_the_reader_unless_it_is_a_withheld_secret(
    tmp_path: Path,
) -> None:
    text = "port: ${PORT}\nsecret: ${SECRET}\nother_file: /nowhere\n"
    data = yamlconf.load_text(text, "conf.yaml", {}, keep_incomplete=True)
    assert [v.problems[0].line for v in data.incomplete] == [1, 2]

    reader = Reader("conf.yaml", data.incomplete)
    section = Section(reader, data, "s")
    assert section.get("port", yamlconf.integer()) is None  # no "expected an integer" too
    assert section.secret("secret") is None
    assert section.secret("other") is None  # other_file cannot be read
    section.finish()
    with pytest.raises(ConfigError) as caught:
        reader.raise_if_any()
    assert [str(p) for p in caught.value.problems] == [
        "conf.yaml:1: environment variable PORT is not set (use ${PORT:-default})",
        "conf.yaml:2: environment variable SECRET is not set (use ${SECRET:-default})",
        "conf.yaml:3: s.other_file: cannot read /nowhere: No such file or directory",
    ]

    # A command that needs no secret: the secrets are withheld, everything else still counts.
    reader = Reader("conf.yaml", data.incomplete, secrets=False)
    section = Section(reader, data, "s")
    section.get("port", yamlconf.integer())
    assert section.secret("secret") is yamlconf.WITHHELD
    assert section.secret("other") is yamlconf.WITHHELD
    section.finish()
    with pytest.raises(ConfigError) as caught:
        reader.raise_if_any()
    assert [str(p) for p in caught.value.problems] == [
        "conf.yaml:1: environment variable PORT is not set (use ${PORT:-default})"
    ]


def test_a_secret_comes_from_its_key_or_its_file_key_but_not_both(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("from-the-file\n")
    data = load(f'one: inline\ntwo_file: "{secret}"\nthree: x\nthree_file: "{secret}"\n')
    reader = Reader("conf.yaml")
    section = Section(reader, data, "s")
    assert section.secret("one") == "inline"
    assert section.secret("two") == "from-the-file"
    assert section.secret("three") is None
    assert section.secret("four") is None
    section.finish()
    assert [str(p) for p in reader.problems] == [
        "conf.yaml:4: s: give three or three_file, not both"
    ]


# ---------------------------------------------------------------------------- structure


def test_mappings_and_lists_remember_their_lines() -> None:
    data = load("# comment\nfirst: 1\nnested:\n  inner: x\nitems:\n  - a\n  - {b: 2}\n")
    assert data.line == 2
    assert data.key_lines == {"first": 2, "nested": 3, "items": 5}
    assert data["nested"].key_lines == {"inner": 4}
    assert data["items"].item_lines == [6, 7]
    assert data["items"][1].line == 7


def test_duplicate_key_is_reported_with_both_lines() -> None:
    text = "a: 1\nb: 2\na: 3\n"
    assert problems_of(text) == ["conf.yaml:3: duplicate key 'a' (first on line 1)"]


def test_duplicate_keys_at_several_levels_are_all_reported() -> None:
    text = "top:\n  x: 1\n  x: 2\nlist:\n  - {k: 1, k: 2}\ntop: again\n"
    assert problems_of(text) == [
        "conf.yaml:3: duplicate key 'x' (first on line 2)",
        "conf.yaml:5: duplicate key 'k' (first on line 5)",
        "conf.yaml:6: duplicate key 'top' (first on line 1)",
    ]


def test_merge_key_values_can_be_overridden_without_a_duplicate_error() -> None:
    text = "base: &b {x: 1, y: 2}\nchild:\n  <<: *b\n  x: 3\n"
    data = load(text)
    assert data["child"] == {"x": 3, "y": 2}
    assert data["child"].key_lines["x"] == 4


def test_keys_from_several_merged_mappings_are_not_duplicates() -> None:
    text = "a: &a {x: 1, y: 1}\nb: &b {x: 2, z: 2}\nc:\n  <<: [*a, *b]\n  w: 0\n"
    # YAML's merge key: the first mapping listed wins over later ones.
    assert load(text)["c"] == {"x": 1, "y": 1, "z": 2, "w": 0}


def test_key_written_twice_beside_a_merge_is_still_a_duplicate() -> None:
    text = "base: &b {x: 1}\nchild:\n  <<: *b\n  y: 3\n  y: 4\n"
    assert problems_of(text) == ["conf.yaml:5: duplicate key 'y' (first on line 4)"]


def test_non_string_key_is_reported() -> None:
    assert problems_of("a: 1\n42: x\n") == ["conf.yaml:2: keys must be strings, not 42"]


def test_yaml_syntax_error_is_reported_with_its_line() -> None:
    found = problems_of("a: 1\nb: 2\nc: d: e\n")
    assert len(found) == 1
    assert found[0].startswith("conf.yaml:3: YAML syntax: ")
    assert "mapping values are not allowed" in found[0]


def test_unclosed_flow_list_is_a_syntax_error_with_a_line() -> None:
    found = problems_of("a: [1, 2\nb: 3\n")
    assert len(found) == 1
    assert found[0].startswith("conf.yaml:") and "YAML syntax" in found[0]
    line = int(found[0].split(":")[1])
    assert 1 <= line <= 3


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just text\n", "42\n"])
def test_top_level_that_is_not_a_mapping_is_refused(text: str) -> None:
    assert problems_of(text) == ["conf.yaml:1: the file must hold a mapping of settings"]


def test_several_problems_of_different_kinds_are_reported_together_in_line_order() -> None:
    text = "a: 1\nb: ${UNSET}\nc: 1\nc: 2\nd: ${ALSO_UNSET}\n"
    assert problems_of(text) == [
        "conf.yaml:2: environment variable UNSET is not set (use ${UNSET:-default})",
        "conf.yaml:4: duplicate key 'c' (first on line 3)",
        "conf.yaml:5: environment variable ALSO_UNSET is not set (use ${ALSO_UNSET:-default})",
    ]


def test_config_error_orders_problems_by_line_and_formats_file_line_message() -> None:
    error = ConfigError(
        [Problem("f.yaml", 9, "late"), Problem("f.yaml", 2, "early"), Problem("f.yaml", 5, "mid")]
    )
    assert [p.line for p in error.problems] == [2, 5, 9]
    assert str(error) == "f.yaml:2: early\nf.yaml:5: mid\nf.yaml:9: late"


def test_load_file_reads_utf8_and_uses_the_environment_given(tmp_path: Path) -> None:
    path = tmp_path / "conf.yaml"
    path.write_text("name: ${WHO}\nmotto: café\n", encoding="utf-8")
    assert yamlconf.load_file(str(path), {"WHO": "gateway"}) == {
        "name": "gateway",
        "motto": "café",
    }


def test_load_file_reports_an_unreadable_or_non_utf8_file(tmp_path: Path) -> None:
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as caught:
        yamlconf.load_file(str(missing), {})
    assert [str(p) for p in caught.value.problems] == [
        f"{missing}:0: cannot read: No such file or directory"
    ]
    binary = tmp_path / "latin1.yaml"
    binary.write_bytes(b"a: caf\xe9\n")
    with pytest.raises(ConfigError) as caught:
        yamlconf.load_file(str(binary), {})
    assert [str(p) for p in caught.value.problems] == [f"{binary}:0: not UTF-8 text"]


# ---------------------------------------------------------------------------- value parsers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", timedelta(seconds=30)),
        ("5m", timedelta(minutes=5)),
        ("250ms", timedelta(milliseconds=250)),
        ("100ms", timedelta(milliseconds=100)),
        ("1.5h", timedelta(minutes=90)),
        ("14d", timedelta(days=14)),
        ("2h", timedelta(hours=2)),
        (" 10 s ", timedelta(seconds=10)),
        ("0s", timedelta(0)),
        (0, timedelta(0)),
    ],
)
def test_duration_parses_numbers_with_units(text: Any, expected: timedelta) -> None:
    assert yamlconf.duration(text) == expected


@pytest.mark.parametrize(
    "value",
    [
        "30",
        30,
        1.5,
        "30 sec",
        "-5s",
        "5S",
        "5w",
        "",
        "s",
        "1.5.5s",
        "1e3s",
        True,
        None,
        "99999999999d",
    ],
)
def test_duration_without_a_known_unit_or_out_of_range_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match=r"is not a duration|is longer than any duration"):
        yamlconf.duration(value)


@pytest.mark.parametrize(
    ("text", "count", "per", "per_second"),
    [
        ("100/s", 100, timedelta(seconds=1), 100.0),
        ("10/m", 10, timedelta(minutes=1), 10 / 60),
        ("5000/h", 5000, timedelta(hours=1), 5000 / 3600),
        ("3/10s", 3, timedelta(seconds=10), 0.3),
        ("1/250ms", 1, timedelta(milliseconds=250), 4.0),
        (" 2 / 1.5m ", 2, timedelta(seconds=90), 2 / 90),
    ],
)
def test_rate_parses_count_per_period(
    text: str, count: float, per: timedelta, per_second: float
) -> None:
    parsed = yamlconf.rate(text)
    assert parsed.count == count
    assert parsed.per == per
    assert parsed.per_second == pytest.approx(per_second)


@pytest.mark.parametrize(
    "value", ["0/s", "100", "100/0s", "/s", "-1/s", "10/x", 100, None, "1/99999999999d"]
)
def test_rate_that_is_zero_unitless_or_malformed_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match=r"is not a rate|has a period longer"):
        yamlconf.rate(value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1048576, 1048576),
        (0, 0),
        ("512B", 512),
        ("512", 512),
        ("64KiB", 64 * 1024),
        ("8K", 8 * 1024),
        ("1KB", 1000),
        ("10MiB", 10 * 1024**2),
        ("2MB", 2_000_000),
        ("1GiB", 1024**3),
        ("1.5KiB", 1536),
    ],
)
def test_size_parses_byte_counts_with_binary_and_decimal_units(value: Any, expected: int) -> None:
    assert yamlconf.size(value) == expected


@pytest.mark.parametrize("value", [-1, "-5KiB", "ten", "10XB", "10 kib", True, None, 1.5, "1e3"])
def test_size_that_is_negative_or_unknown_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        yamlconf.size(value)


def test_scalar_parsers_refuse_the_wrong_kind_of_value() -> None:
    assert yamlconf.string("x") == "x"
    with pytest.raises(ValueError, match="expected a string, got int 5"):
        yamlconf.string(5)
    with pytest.raises(ValueError, match="must not be empty"):
        yamlconf.non_empty_string("  ")
    assert yamlconf.boolean(False) is False
    with pytest.raises(ValueError, match="expected true or false, got str 'yes'"):
        yamlconf.boolean("yes")
    bounded = yamlconf.integer(1, 10)
    assert bounded(10) == 10
    with pytest.raises(ValueError, match="at least 1"):
        bounded(0)
    with pytest.raises(ValueError, match="at most 10"):
        bounded(11)
    with pytest.raises(ValueError, match="expected an integer"):
        bounded(True)
    choice = yamlconf.one_of("deny", "allow")
    assert choice("allow") == "allow"
    with pytest.raises(ValueError, match="'maybe' is not one of deny, allow"):
        choice("maybe")


# ---------------------------------------------------------------------------- reader


def test_section_reports_unknown_keys_naming_every_key_it_knows() -> None:
    data = load("name: a\nsize: 2\ncolour: red\n")
    reader = Reader("conf.yaml")
    section = Section(reader, data, "thing")
    section.get("name", yamlconf.string)
    section.has("shape")  # asked about, absent: still a known key
    section.get("size", yamlconf.integer(), 0)
    section.finish()
    assert [str(p) for p in reader.problems] == [
        "conf.yaml:3: thing: unknown key 'colour'; known keys: name, shape, size"
    ]


def test_section_collects_every_bad_value_with_its_line() -> None:
    data = load("a: 1\nb: nope\nc: [1, x, 3]\nd: scalar\n")
    reader = Reader("conf.yaml")
    section = Section(reader, data, "s")
    assert section.get("a", yamlconf.integer()) == 1
    assert section.get("b", yamlconf.integer(), 7) == 7
    assert section.list_of("c", yamlconf.integer()) == (1, 3)
    assert section.list_of("d", yamlconf.integer()) == ()
    assert section.get("missing", yamlconf.string) is None
    assert section.get("optional", yamlconf.string, "dflt") == "dflt"
    section.finish()
    with pytest.raises(ConfigError) as caught:
        reader.raise_if_any()
    assert [str(p) for p in caught.value.problems] == [
        "conf.yaml:1: s: missing is required",
        "conf.yaml:2: s.b: expected an integer, got str 'nope'",
        "conf.yaml:3: s.c[1]: expected an integer, got str 'x'",
        "conf.yaml:4: s.d must be a list, got str 'scalar'",
    ]


def test_reader_section_refuses_something_that_is_not_a_mapping() -> None:
    reader = Reader("conf.yaml")
    assert reader.section(load("l: [1]\n")["l"], "upstream", 1) is None
    assert [str(p) for p in reader.problems] == [
        "conf.yaml:1: upstream must be a mapping, got a list"
    ]
    with pytest.raises(ConfigError):
        reader.raise_if_any()


@pytest.mark.parametrize(
    ("parse", "value"),
    [
        (yamlconf.duration, "\u0663s"),  # ARABIC-INDIC DIGIT THREE
        (yamlconf.duration, "3\u2003s"),  # EM SPACE
        (yamlconf.rate, "\u0661/s"),
        (yamlconf.rate, "1/\u0662s"),
        (yamlconf.size, "\u0663KiB"),
        (yamlconf.size, "3\u2003KiB"),
    ],
)
def test_digits_and_spaces_outside_ascii_are_not_numbers(parse: Any, value: str) -> None:
    # Python's \d takes every script's digits; an editor's JSON Schema (and a reader) does not.
    with pytest.raises(ValueError, match=r"is not a (duration|rate|size)"):
        parse(value)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (timedelta(0), "0s"),
        (timedelta(milliseconds=250), "250ms"),
        (timedelta(microseconds=1500), "1.5ms"),
        (timedelta(seconds=30), "30s"),
        (timedelta(seconds=90), "90s"),
        (timedelta(minutes=5), "5m"),
        (timedelta(hours=36), "36h"),
        (timedelta(days=14), "14d"),
    ],
)
def test_duration_text_is_what_a_person_would_write_and_reads_back(
    value: timedelta, text: str
) -> None:
    assert yamlconf.duration_text(value) == text
    assert yamlconf.duration(text) == value


@pytest.mark.parametrize("value", [5, "", "  ", None, ["hunter2"]])
def test_secret_refuses_what_is_not_a_string_without_showing_the_value(value: Any) -> None:
    assert yamlconf.secret("hunter2") == "hunter2"
    with pytest.raises(ValueError) as caught:
        yamlconf.secret(value)
    assert str(caught.value) == "must be a non-empty string (quote it; the value is not shown)"
