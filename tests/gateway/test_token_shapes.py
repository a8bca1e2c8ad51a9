"""The shape checks of tokens (a compact JWS, a b64token) are single passes of
`bytes.translate`; they give exactly what the grammar's regular expressions give, on texts
made of the characters near each edge of the grammar."""

from __future__ import annotations

import re

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.core.bearer import is_b64token
from portcullis.jose import compact_parts
from tests.hypothesis_profiles import examples

# The grammars, as regular expressions (RFC 7515 §7.1 with RFC 7515 §2's base64url; RFC 6750
# §2.1's b64token).
COMPACT = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")

# Inside and just outside the alphabets, whitespace, controls, look-alikes beyond ASCII.
EDGES = "aZ09-_.~+/= \t\n\r\x00\x7f!\"'#$%&*,:;<>?@[\\]^`{|}éٳ０ａ\u200b"
texts = st.text(alphabet=st.sampled_from(EDGES) | st.characters(), max_size=40)
shaped = st.builds(
    lambda a, b, c, tail: f"{a}.{b}.{c}{tail}",
    st.text(alphabet="aZ09-_", max_size=6),
    st.text(alphabet="aZ09-_.", max_size=6),
    st.text(alphabet="aZ09-_=", max_size=6),
    st.sampled_from(["", "\n", "\r\n", " ", "=", ".", "é", "\x00"]),
)


@settings(max_examples=examples(600))
@given(st.one_of(texts, shaped))
@example("a.b.c")
@example("a.b.c\n")
@example("a..c")
@example(".b.c")
@example("a.b.")
@example("a.b.c.d")
@example("")
@example("a.b.c٣")
def test_compact_parts_is_the_grammar(text: str) -> None:
    parts = compact_parts(text)
    assert (parts is not None) is (COMPACT.fullmatch(text) is not None)
    if parts is not None:
        assert ".".join(parts) == text and len(parts) == 3


@settings(max_examples=examples(600))
@given(st.one_of(texts, shaped))
@example("abc")
@example("abc==")
@example("=")
@example("a=b")
@example("==a")
@example("abc\n")
@example("")
@example("abc=\n")
@example("a~b+c/d.e-f_g")
def test_is_b64token_is_the_grammar(text: str) -> None:
    assert is_b64token(text) is (B64TOKEN.fullmatch(text) is not None)
