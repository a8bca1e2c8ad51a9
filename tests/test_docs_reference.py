"""The generated reference pages of the docs site, held to what the programs declare.

- each committed page (docs/reference/) is the one docs/generate.py makes now: a setting, an
  option or an admin operation changed without `make reference` fails here;
- what the pages are made from is all in them: every key of both configuration files under
  its section's table, every command and option of both command lines, every operation and
  schema of the admin API;
- the stale check names a page that differs, and a page that is missing.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from authserver import settings as authserver_settings
from authserver.admin import openapi
from docs import generate
from gateway import settings as gateway_settings
from portcullis import sections

PAGES = generate.pages()


def test_the_committed_reference_pages_are_the_ones_the_programs_give() -> None:
    found = [str(path.relative_to(generate.ROOT)) for path in generate.stale(PAGES)]
    assert found == [], "stale: run `make reference`"


def test_the_stale_check_names_a_changed_page_and_a_missing_one(tmp_path: Path) -> None:
    changed, missing, current = tmp_path / "a.md", tmp_path / "b.md", tmp_path / "c.md"
    changed.write_text("# as it was\n", encoding="utf-8")
    current.write_text("# as it is\n", encoding="utf-8")
    expected = {changed: "# as it is\n", missing: "# new\n", current: "# as it is\n"}
    assert generate.stale(expected) == [changed, missing]
    assert generate.main(["--check"]) == 0  # the repository's own pages are current


def _tables(page: str) -> dict[str, set[str]]:
    """The keys of each section's table in a configuration reference page, by heading."""
    tables: dict[str, set[str]] = {}
    heading = None
    for line in page.splitlines():
        if line.startswith("## "):
            heading = line[3:].strip("`")
            tables[heading] = set()
        elif heading and (row := re.match(r"^\| `([^`]+)` \|", line)):
            tables[heading].add(row.group(1))
    return tables


@pytest.mark.parametrize(
    ("page", "settings"),
    [
        ("gateway-configuration.md", gateway_settings.Settings),
        ("authserver-configuration.md", authserver_settings.Settings),
    ],
)
def test_the_configuration_reference_has_every_key_in_its_sections_table(
    page: str, settings: type
) -> None:
    tables = _tables(PAGES[generate.REFERENCE / page])
    # A section used in several places has one table, under the first path that uses it.
    table_of: dict[type, str] = {}
    for path, cls, _ in sections.keys(settings):
        parent = path.rpartition(".")[0] or "Top level"
        if parent in tables:
            table_of.setdefault(cls, parent)
    missing = [
        f"{path} (in {table_of.get(cls)})"
        for path, cls, key in sections.keys(settings)
        if key not in tables.get(table_of.get(cls, ""), set())
    ]
    assert missing == []
    assert sum(len(keys) for keys in tables.values()) > 100


def _commands(
    parser: argparse.ArgumentParser, words: tuple[str, ...]
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    found = [(words, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*words, name))
    return found


@pytest.mark.parametrize(
    ("program", "command_line"),
    [
        ("portcullis-gateway", generate.gateway_main.command_line),
        ("portcullis-authserver", generate.authserver_main.command_line),
    ],
)
def test_the_cli_reference_has_every_command_and_option(program: str, command_line: Any) -> None:
    page = PAGES[generate.REFERENCE / "cli.md"]
    parser = command_line()
    commands = _commands(parser, (program,))
    assert len(commands) > 3
    for words, command in commands:
        section = page.split(f"# `{' '.join(words)}`\n", 1)
        assert len(section) == 2, f"no heading for {' '.join(words)}"
        body = re.split(r"^#+ `", section[1], maxsplit=1, flags=re.MULTILINE)[0]
        for action in command._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert f"`{option}" in body, f"{' '.join(words)} lacks {option}"
    # The admin commands are the authorization server's.
    if program == "portcullis-authserver":
        assert "# `portcullis-authserver clients add`" in page
        assert "`--ca-file CA_FILE`" in page


def test_the_admin_api_reference_has_every_operation_and_schema() -> None:
    page = PAGES[generate.REFERENCE / "admin-api.md"]
    document = openapi.document(generate.ADMIN_BASE)
    for path, item in document["paths"].items():
        for method in generate._METHODS:
            if method in item:
                assert f"### {method.upper()} `{path}`" in page
    for name in document["components"]["schemas"]:
        assert f"\n### {name}\n" in page
    # Fields of the schemas, camelCase as the API speaks them.
    assert "| `tokenEndpointAuthMethod` |" in page
    assert "`urn:ietf:params:oauth:grant-type:device_code`" in page
