"""Tokenizers behind one protocol: the default model's bytes (plus two special ids), a real model's BPE (:class:`HFTokenizer`)."""

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
    eos_id: int
    chat_template: str | None  # the model's Jinja chat template, None where it has none

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes in, UTF-8 bytes out; invalid byte sequences decode to U+FFFD."""

    vocab_size = BYTE_VOCAB_SIZE
    pad_id = PAD_ID
    eos_id = EOS_ID
    chat_template = None

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
    """A ``tokenizers`` tokenizer (``tokenizer.json``, or a GGUF's vocabulary); special tokens in a prompt become their ids."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int, bos_id: int | None = None, pad_id: int | None = None,
                 chat_template: str | None = None) -> None:
        self._tok = tokenizer
        self.vocab_size = vocab_size
        self.eos_id, self.bos_id = eos_id, bos_id
        self.pad_id = eos_id if pad_id is None else pad_id  # padding is masked anyway
        self.chat_template = chat_template

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_hf_tokenizer(directory: Path, vocab_size: int) -> Tokenizer:
    """The directory's ``tokenizer.json`` (``tokenizer_config.json``: specials, template), else bytes if they fit."""
    import json
    directory = Path(directory)
    path = directory / "tokenizer.json"
    if path.exists():
        from tokenizers import Tokenizer as _Tokenizer
        tok = _Tokenizer.from_file(str(path))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        special = lambda key, default: tok.token_to_id(_token_content(config.get(key)) or default)  # noqa: E731
        eos = special("eos_token", "<|endoftext|>")
        return HFTokenizer(tok, vocab_size, eos_id=eos if eos is not None else vocab_size - 1,
                           bos_id=special("bos_token", ""), pad_id=special("pad_token", ""),
                           chat_template=config.get("chat_template"))
    if vocab_size >= BYTE_VOCAB_SIZE:
        return ByteTokenizer()
    raise ValueError(f"{directory} has no tokenizer.json and its vocabulary ({vocab_size}) is too small for bytes")


def _token_content(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token
