"""Stop strings (OpenAI's ``stop``): end a completion where its text first contains one; a stop is text, not a token, so after
each token only the text it added (and the few characters before it a stop may start in) is decoded and searched. The stop and
what follows are not returned, nor log-probabilities of tokens starting at or after it; ``usage`` counts every token generated."""

from __future__ import annotations

from chapters.ch08_continuous_batching.streaming import TextDelta
from shared.tokenizer import Tokenizer

MAX_STOPS = 4  # OpenAI's completions API accepts up to 4 stop sequences


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in ``text``, or None."""
    found = [at for at in (text.find(stop) for stop in stops) if at >= 0]
    return min(found) if found else None


def undecided_tail(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that could still become a stop string (the longest such prefix)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class StopStrings:
    """A sequence's stop condition (one per sequence): each call decodes and searches only what the new tokens added."""

    def __init__(self, stops: tuple[str, ...], tokenizer: Tokenizer) -> None:
        if not stops or len(stops) > MAX_STOPS or any(not stop for stop in stops):
            raise ValueError(f"stop takes 1 to {MAX_STOPS} non-empty strings, got {list(stops)!r}")
        self.stops = stops
        self._text = TextDelta(tokenizer)
        self._reach = max(map(len, stops)) - 1  # a stop ending in new text starts at most this far before it
        self._recent = ""  # the last ``_reach`` characters of the text handed out so far

    def reached(self, output_ids: list[int]) -> bool:
        """Does the text of ``output_ids`` (this sequence's answer so far, only ever longer) contain a stop?"""
        for token in output_ids[len(self._text.ids):]:
            seen = self._recent + self._text.add(token)
            if first_stop(seen + self._text.held, self.stops) is not None:
                return True
            self._recent = seen[-self._reach:] if self._reach else ""
        return False


class EndOfTurn:
    """The chat route's stop condition: the model's end-of-turn token, or a stop string when the request gave any."""

    def __init__(self, token_ids: frozenset[int], strings: StopStrings | None = None) -> None:
        self.token_ids, self.strings = token_ids, strings

    def reached(self, output_ids: list[int]) -> bool:
        if output_ids and output_ids[-1] in self.token_ids:
            return True
        return self.strings is not None and self.strings.reached(output_ids)


class StopText:
    """The answer's text as it may be shown: :meth:`add` returns the text a token made safe to send (never a character a stop
    may still claim), :meth:`finish` the rest up to the first stop; the pieces add up to :func:`visible_text`."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.stops = stops
        self._text = TextDelta(tokenizer)
        self._unsent = ""  # decoded, whole characters, not sent yet: a stop may still claim them
        self._sent = 0  # characters sent
        self.stopped_at: int | None = None  # where the shown text ends (characters) once a stop was found

    @property
    def sent_chars(self) -> int:
        """Characters returned so far by :meth:`add` (none is ever taken back)."""
        return self._sent

    @property
    def decoded_chars(self) -> int:
        """Characters in the text of every token added so far (as one decode of them all would give)."""
        return self._sent + len(self._unsent) + len(self._text.held)

    def add(self, token: int) -> str:
        self._unsent += self._text.add(token)
        return self._take(final=False)

    def finish(self) -> str:
        self._unsent += self._text.flush()
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        if self.stopped_at is not None:
            return ""
        # The decoder's held-back text (ending in U+FFFD) is searched too, as a decode of every token would be.
        text = self._unsent + self._text.held
        stop = first_stop(text, self.stops)
        if stop is not None:
            self.stopped_at = self._sent + stop
            return text[:stop]
        end = len(self._unsent) if final else len(self._unsent) - undecided_tail(self._unsent, self.stops)
        delta, self._unsent = self._unsent[:end], self._unsent[end:]
        self._sent += len(delta)
        return delta


class ShownTokens:
    """A stream's per-token items, released with their token's text; never for a token starting at or after a stop."""

    def __init__(self, text: StopText) -> None:
        self.text, self._held = text, []

    def add(self, token: int, item: object) -> tuple[str, list]:
        """``token``'s text that became safe to send (``StopText.add``) and the items released with it."""
        self._held.append((self.text.decoded_chars, item))
        return self.text.add(token), self._release(final=False)

    def finish(self) -> tuple[str, list]:
        return self.text.finish(), self._release(final=True)

    def _release(self, final: bool) -> list:
        stopped = self.text.stopped_at is not None
        limit = self.text.stopped_at if stopped else (float("inf") if final else self.text.sent_chars)
        released = [item for offset, item in self._held if offset < limit]
        self._held = [] if stopped or final else [(offset, item) for offset, item in self._held if offset >= limit]
        return released


def visible_text(tokenizer: Tokenizer, output_ids: list[int], stops: tuple[str, ...] = ()) -> str:
    """The whole answer's text as returned: cut where the first stop string starts."""
    text = tokenizer.decode(output_ids)
    stop = first_stop(text, stops)
    return text if stop is None else text[:stop]
