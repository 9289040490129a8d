"""``runtime.protocol.framing``: stdio line framing without trio; the result never depends on where
the byte stream was cut."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.protocol.framing import TOO_LONG, Item, LineSplitter

LIMIT = 16


def split(stream: bytes, cuts: list[int]) -> list[Item]:
    splitter = LineSplitter(LIMIT)
    out: list[Item] = []
    start = 0
    for cut in sorted(set(c for c in cuts if 0 < c < len(stream))) + [len(stream)]:
        out += splitter.feed(stream[start:cut])
        start = cut
    return out + splitter.end()


lines = st.lists(st.one_of(st.binary(min_size=0, max_size=40).filter(lambda b: b"\n" not in b),
                           st.just(b"x" * LIMIT), st.just(b"x" * LIMIT + b"\r"), st.just(b"y" * (LIMIT + 1))),
                 max_size=12)


@settings(max_examples=400, deadline=None)
@given(lines, st.lists(st.integers(min_value=0, max_value=600), max_size=30), st.booleans())
def test_any_cutting_of_the_stream_gives_the_same_messages(parts: list[bytes], cuts: list[int], final_newline: bool) -> None:
    stream = b"\n".join(parts) + (b"\n" if final_newline else b"")
    assert split(stream, cuts) == split(stream, [])


def test_messages_crlf_blank_lines_and_over_size_lines() -> None:
    stream = b"one\r\n\n  \ntwo\n" + b"z" * (LIMIT + 5) + b"\nthree"
    assert split(stream, []) == [b"one", b"two", TOO_LONG, b"three"]


def test_a_line_of_exactly_the_limit_ending_in_crlf_is_a_message_however_cr_and_lf_are_cut() -> None:
    line = b"a" * LIMIT
    for cut in range(1, LIMIT + 3):
        assert split(line + b"\r\n" + b"next\n", [cut]) == [line, b"next"]


def test_an_over_size_line_is_reported_once_and_skipped_to_its_end() -> None:
    assert split(b"b" * 100 + b"\nok\n", list(range(0, 110, 7))) == [TOO_LONG, b"ok"]
