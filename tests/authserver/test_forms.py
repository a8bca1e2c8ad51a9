"""Url-encoded forms are read as urllib's parse_qsl reads them (blank values kept, strict
UTF-8, at most MAX_FORM_FIELDS fields), whether or not they hold anything to decode."""

from __future__ import annotations

from urllib.parse import parse_qsl

import pytest

from authserver.endpoints.forms import MAX_FORM_FIELDS, _pairs

FORMS = [
    "",
    "&",
    "&&",
    "a",
    "a=",
    "=b",
    "=",
    "a=b=c",
    "a==&b",
    "a=b&&c=d",
    "&a=b&",
    "a;b=c",
    "grant_type=client_credentials&scope=bench:read",
    "grant_type=client_credentials&scope=a%20b",
    "scope=a+b&client_id=x%2By",
    "name=%C3%A9t%C3%A9",
    "é=ü&ü",
    "a=b&" * (MAX_FORM_FIELDS - 1) + "a=b",
    "a=b&" * MAX_FORM_FIELDS + "a=b",
    "a&" * MAX_FORM_FIELDS,
    "+=%2B" + "&x" * MAX_FORM_FIELDS,
]


def _as_parse_qsl(text: str) -> list[tuple[str, str]] | str:
    try:
        return parse_qsl(
            text, keep_blank_values=True, max_num_fields=MAX_FORM_FIELDS, errors="strict"
        )
    except ValueError:
        return "refused"


def _as_read(text: str) -> list[tuple[str, object]] | str:
    try:
        return _pairs(text)
    except ValueError:
        return "refused"


@pytest.mark.parametrize("text", FORMS)
def test_a_form_is_read_as_parse_qsl_reads_it(text: str) -> None:
    assert _as_read(text) == _as_parse_qsl(text)


def test_an_escape_that_is_not_utf8_is_refused() -> None:
    with pytest.raises(ValueError):
        _pairs("scope=%FF")
