"""Stop strings (OpenAI's ``stop``): end a completion where its TEXT first contains one of them.

A stop string is text, not a token: with the byte tokenizer every character of ``"\\n\\n"`` is its
own token, and with word pieces a stop may start in the middle of one. So the check decodes the
whole answer so far and searches it, after every token, and only for requests that asked.

- The sequence ends as soon as a stop appears (``finish_reason`` "stop"); its blocks are free
  before the next step, like any finished sequence's.
- The stop string and anything after it in the same token are not returned. The answer's token
  ids still hold every token generated (usage counts them), as vLLM's do.
- A stream must not send text that may turn out to be the start of a stop: :class:`StopText`
  holds back the end of the text that is a prefix of a stop until the next token decides.
"""

from __future__ import annotations

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
    """The stop condition a sequence carries into the scheduler: has the decoded answer reached a stop?"""

    def __init__(self, stops: tuple[str, ...], tokenizer: Tokenizer) -> None:
        if not stops or len(stops) > MAX_STOPS or any(not stop for stop in stops):
            raise ValueError(f"stop takes 1 to {MAX_STOPS} non-empty strings, got {list(stops)!r}")
        self.stops, self.tokenizer = stops, tokenizer

    def reached(self, output_ids: list[int]) -> bool:
        return first_stop(self.tokenizer.decode(output_ids), self.stops) is not None


class StopText:
    """The answer's text as it may be shown: up to the first stop, never a character that a stop may still claim.

    :meth:`add` takes each new token and returns the text that became safe to send; :meth:`finish`
    returns the rest of what is shown (nothing past a stop). The pieces add up to :func:`visible_text`.
    """

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        stop = first_stop(text, self.stops)
        if stop is not None:
            return self._take(text, stop)
        decided = text.rstrip("\ufffd")  # probably an incomplete UTF-8 character: wait for the next token
        return self._take(text, len(decided) - undecided_tail(decided, self.stops))

    def finish(self) -> str:
        text = self.tokenizer.decode(self.ids)
        stop = first_stop(text, self.stops)
        return self._take(text, len(text) if stop is None else stop)

    def _take(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta


def visible_text(tokenizer: Tokenizer, output_ids: list[int], stops: tuple[str, ...] = ()) -> str:
    """The whole answer's text as returned: cut where the first stop string starts."""
    text = tokenizer.decode(output_ids)
    stop = first_stop(text, stops)
    return text if stop is None else text[:stop]
