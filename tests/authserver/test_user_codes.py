"""User codes (RFC 8628 §6.1) and the device code's poll events, as plain values."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from authserver.protocol import lifecycle, user_codes
from authserver.protocol.lifecycle import Device

codes = st.text(alphabet=user_codes.ALPHABET, min_size=8, max_size=8)


def test_the_alphabet_has_twenty_consonants_none_easily_confused() -> None:
    assert len(set(user_codes.ALPHABET)) == len(user_codes.ALPHABET) == 20
    assert not set(user_codes.ALPHABET) & set("AEIOUY")  # no words
    assert not set(user_codes.ALPHABET) & set("0123456789")
    assert user_codes.SPACE == 20**8


def test_drawn_codes_are_eight_alphabet_letters_and_vary() -> None:
    drawn = {user_codes.generate() for _ in range(500)}
    assert len(drawn) == 500
    for code in drawn:
        assert len(code) == 8 and set(code) <= set(user_codes.ALPHABET)
    # Every letter turns up in every position over enough draws.
    for position in range(8):
        assert {code[position] for code in drawn} == set(user_codes.ALPHABET)


@given(codes)
def test_a_shown_code_reads_back_whatever_the_case_hyphen_or_spaces(code: str) -> None:
    shown = user_codes.display(code)
    assert shown == f"{code[:4]}-{code[4:]}"
    for typed in (shown, shown.lower(), code.lower(), f" {code[:4]} {code[4:]} ", shown.title()):
        assert user_codes.normalise(typed) == code


@given(st.text(max_size=12))
def test_normalise_accepts_only_eight_alphabet_letters(typed: str) -> None:
    result = user_codes.normalise(typed)
    stripped = "".join(c for c in typed if c not in "- \t").upper()
    if len(stripped) == 8 and set(stripped) <= set(user_codes.ALPHABET):
        assert result == stripped
    else:
        assert result is None


@pytest.mark.parametrize(
    ("state", "too_fast", "event"),
    [
        (Device.PENDING, False, "poll"),
        (Device.PENDING, True, "poll_too_fast"),
        # Once decided, the decision is the answer however fast the device polls.
        (Device.APPROVED, True, "poll"),
        (Device.DENIED, True, "poll"),
        (Device.REDEEMED, True, "poll"),
    ],
)
def test_only_a_pending_code_treats_a_fast_poll_differently(
    state: Device, too_fast: bool, event: str
) -> None:
    assert lifecycle.device_poll_event(state, too_fast) == event
    # Every event a poll can be has a row for the state.
    lifecycle.step(lifecycle.DEVICE, state, event)
