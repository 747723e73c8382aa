"""Byte-level tokenizer: every UTF-8 byte is a token, plus two special ids.

The embedded default model speaks this vocabulary. A Hugging Face GPT-2 directory brings its own
``tokenizer.json``; :func:`load_hf_tokenizer` wraps it behind the same two methods.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

BYTE_VOCAB = 256
EOS_ID = 256  # separates documents in the training corpus
PAD_ID = 257  # fills the left of a padded batch; always masked, never attended to
BYTE_VOCAB_SIZE = 258

SPECIAL_TOKENS = {EOS_ID: "<|endoftext|>", PAD_ID: "<|pad|>"}


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes in, UTF-8 bytes out; invalid byte sequences decode to U+FFFD."""

    vocab_size = BYTE_VOCAB_SIZE
    pad_id = PAD_ID
    eos_id = EOS_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        try:  # every id a byte (the common case: specials are rare in an answer): one C call
            return bytes(ids).decode("utf-8", errors="replace")
        except ValueError:  # a special id among them: decode the bytes between them, name the specials
            pass
        parts: list[str] = []
        run = bytearray()
        for token in ids:
            if token < BYTE_VOCAB:
                run.append(token)
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            parts.append(SPECIAL_TOKENS.get(token, f"<|{token}|>"))
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)


class HFTokenizer:
    """A ``tokenizer.json`` from a Hugging Face GPT-2 directory (needs the ``tokenizers`` package)."""

    def __init__(self, path: Path, vocab_size: int) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        self.vocab_size = vocab_size
        eos = self._tok.token_to_id("<|endoftext|>")
        self.eos_id = eos if eos is not None else vocab_size - 1
        self.pad_id = self.eos_id  # GPT-2 has no pad token; padding is masked anyway

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_hf_tokenizer(directory: Path, vocab_size: int) -> Tokenizer:
    """The directory's ``tokenizer.json`` if present, else the byte tokenizer when it fits the vocabulary."""
    path = Path(directory) / "tokenizer.json"
    if path.exists():
        return HFTokenizer(path, vocab_size)
    if vocab_size >= BYTE_VOCAB_SIZE:
        return ByteTokenizer()
    raise ValueError(f"{directory} has no tokenizer.json and its vocabulary ({vocab_size}) is too small for bytes")
