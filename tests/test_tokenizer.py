"""The byte tokenizer against a plain reading of its contract: bytes as UTF-8, specials by name."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.tokenizer import BYTE_VOCAB, BYTE_VOCAB_SIZE, SPECIAL_TOKENS, ByteTokenizer


def reference_decode(ids: list[int]) -> str:
    """Each run of byte ids decoded as UTF-8 (invalid sequences as U+FFFD), each special id as its name."""
    text, run = "", []
    for token in [*ids, None]:
        if token is not None and token < BYTE_VOCAB:
            run.append(token)
            continue
        text += bytes(run).decode("utf-8", errors="replace")
        run = []
        if token is not None:
            text += SPECIAL_TOKENS[token]
    return text


# Byte tokens, the special ones above them, and runs of bytes that make or break UTF-8 characters
# (chapter 8's text-delta and stop-string tests draw from it too).
byte_ids = st.lists(st.one_of(st.integers(0, BYTE_VOCAB_SIZE - 1), st.sampled_from([0xE2, 0x82, 0xAC, 0xC3, 0xA9, 0xF0, 0x9F])),
                    max_size=40)


@given(byte_ids)
@settings(max_examples=400, deadline=None)
def test_decode_is_utf8_between_the_specials_and_each_special_by_name(ids: list[int]) -> None:
    assert ByteTokenizer().decode(ids) == reference_decode(ids)


def test_decode_round_trips_encoded_text() -> None:
    text = "caf\u00e9 \u20ac \U0001F600 plain"
    tokenizer = ByteTokenizer()
    assert tokenizer.decode(tokenizer.encode(text)) == text
