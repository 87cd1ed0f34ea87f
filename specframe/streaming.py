"""Text handed out while it is generated (`generate(..., stream=write)`, and `specframe generate`'s output).

After every verification step the engine gives `TextStream.update` the tokens so far; the stream decodes them
and writes the part of the text that later tokens can no longer change: all but the last HOLD_CHARS characters,
and all but the longest stop string's length (a stop string is cut from the text with whatever follows it, and
one still to be completed starts within that tail). Held back with them are the tail's other unsettled pieces:
the bytes of a character whose rest is in the next token (decoded as U+FFFD until then), and a space that a
tokenizer's clean-up drops when the next token arrives ("do n" + "'t" decodes as "don't"). When generation ends,
`finish` writes the rest of the result's text, so the pieces always add up to `result.text` exactly. A tokenizer
whose text changes further back than that is not streamed wrong: from that step nothing more is written until
the end, and if the written part is then no longer the start of the text, a warning says so.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

HOLD_CHARS = 8  # characters of the newest text held back (more when a stop string is longer)


class TextStream:
    """Writes a generation's text to `write` in pieces as it settles; see the module's docstring."""

    def __init__(self, write: Callable[[str], object], decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self.write, self.decode = write, decode
        self.hold = max([HOLD_CHARS, *(len(s) for s in stop)])
        self.written = ""
        self.diverged = False  # (the text changed before what was held back: nothing more until the end)

    def update(self, token_ids: list[int]) -> None:
        """The tokens generated so far (generation goes on)."""
        if self.diverged:
            return
        text = self.decode(token_ids)
        settled = text[: max(0, len(text) - self.hold)]
        if not settled.startswith(self.written):
            self.diverged = True
        elif len(settled) > len(self.written):
            self.write(settled[len(self.written) :])
            self.written = settled

    def finish(self, text: str) -> None:
        """Generation ended with `text` (the result's): write what is left of it."""
        if text.startswith(self.written):
            if len(text) > len(self.written):
                self.write(text[len(self.written) :])
            return
        warnings.warn(
            f"the streamed text ({len(self.written)} characters) is not the start of the result's text: the "
            "tokenizer's decoded text changed further back than the stream holds back; result.text is the right "
            "one",
            RuntimeWarning,
            stacklevel=3,
        )
