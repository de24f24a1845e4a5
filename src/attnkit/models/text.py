"""The text of a growing answer, piece by piece: the one incremental-text and stop-string stream.

``generate``'s ``stream()``, the chat and generate commands and the serving
engine all turn tokens into text here: :class:`IncrementalDecoder` gives the
text each new id completes, :class:`TextStream` adds stop strings (text that
ends the answer and is not shown) on top of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_HELD = 4  # tokens held back for an incomplete character: a UTF-8 character has at most 4 bytes


class IncrementalDecoder:
    """Text of a growing list of token ids, new text only, decoding a short window each time.

    The window starts at the tokens of the last piece returned, so a decoder
    that drops a leading space at the start of a text still sees what precedes
    the new tokens; text is held back while it ends in an incomplete
    character, for fewer than :data:`MAX_HELD` tokens (a longer run is no one
    character: its undecodable bytes show as U+FFFD, all but a last character's
    start). Linear in the answer's length.

    ``context``: the ids before the first new one (the prompt's last), decoded
    only as the first window's start: a SentencePiece decoder drops the space
    that begins a text, so " Paris" after "is" would come out "Paris" alone.
    """

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int] = ()) -> None:
        self.decode = decode
        self.ids: list[int] = list(context)
        self._start, self._shown = 0, len(self.ids)  # ids[start:shown] were last returned; ids[shown:] not yet

    def add(self, token: int) -> str:
        """Append one id; the text it completes ("" while a character is incomplete)."""
        self.ids.append(token)
        return self._take(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        return self._take(final=True)

    def _take(self, *, final: bool) -> str:
        end = len(self.ids)
        before, after = self.decode(self.ids[self._start : self._shown]), self.decode(self.ids[self._start :])
        if after.endswith("\ufffd") and not final:
            if end - self._shown < MAX_HELD:
                return ""  # maybe the first bytes of a character: wait for the rest
            end -= self._lead_bytes()  # a run longer than a character: show it, but a last character's start
            after = self.decode(self.ids[self._start : end])
        if len(after) <= len(before):
            return ""
        self._start, self._shown = self._shown, end
        return after[len(before) :]

    def _lead_bytes(self) -> int:
        """How many of the last ids (at most ``MAX_HELD - 1``) may be the start of one character still to come:
        the longest such tail that decodes to a lone U+FFFD (0: none)."""
        for n in range(MAX_HELD - 1, 0, -1):
            if self.decode(self.ids[-n:]) == "\ufffd":
                return n
        return 0


class TextStream:
    """New text per token, ended by a stop string: the first match (whatever the order of ``stop``) ends the
    text before it, and text that may be the start of a stop string is held back until it is not.

    ``context``: the prompt's last id (see :class:`IncrementalDecoder`). ``add`` returns the text that can be
    shown now; :attr:`stopped` turns True once a stop string appeared
    (nothing after it is ever shown); ``flush`` returns what was held back at the end of the answer.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (), context: Sequence[int] = ()
                 ) -> None:
        self.text, self.stop = IncrementalDecoder(decode, context), tuple(stop)
        self.held = ""  # text that may be the start of a stop string
        self.stopped = False

    def add(self, token: int) -> str:
        """The text ``token`` makes showable ("" once stopped)."""
        if self.stopped:
            return ""
        text = self._cut(self.held + self.text.add(token))
        self.held = ""
        if self.stopped:
            return text
        keep = max((len(s) - 1 for s in self.stop), default=0)  # the end may start a stop string
        for n in range(min(keep, len(text)), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stop):
                self.held = text[-n:]
                return text[:-n]
        return text

    def flush(self) -> str:
        """The held-back rest at the end of the answer ("" once stopped)."""
        if self.stopped:
            return ""
        rest, self.held = self._cut(self.held + self.text.flush()), ""
        return rest

    def _cut(self, text: str) -> str:
        """``text`` up to its first stop string (then :attr:`stopped`), or all of it."""
        at = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if at < 0:
            return text
        self.stopped = True
        return text[:at]
