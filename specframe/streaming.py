"""Text handed out while it is generated (`generate(..., stream=write)`, and `specframe generate`'s output).

After every verification step the engine gives `TextStream.update` the tokens so far; the stream decodes them
and writes the part of the text that later tokens can no longer change: all but the last HOLD_CHARS characters,
the tail's unsettled pieces: the bytes of a character whose rest is in the next token (decoded as U+FFFD until
then; SentencePiece's byte fallback gives one per byte, so the text can grow shorter: "\ufffd\ufffd\ufffd" to
"😀"), and a space that a tokenizer's clean-up drops when the next token arrives ("do n" + "'t" decodes as
"don't"). With stop strings, the longest one's length more is held back: a stop string is cut from the text
with whatever follows it, and one still to be completed may end in the unsettled tail, so start that much
before it. When generation ends, `finish` writes the rest of the result's text, so the pieces always add up to
`result.text` exactly. A tokenizer whose text changes further back than that is not streamed wrong: from that
step nothing more is written until the end, and if the written part is then no longer the start of the text, a
warning says so.

Decoding the whole text costs more as it grows (on a 2-core AMD EPYC, with SmolLM2's tokenizer: 0.03 ms at 128
tokens, 0.9 ms at 4,096, 2.6 ms at 8,192), so a stream skips the steps that come sooner after its last decode
than DECODE_SHARE of the time allows, once the text is longer than ALWAYS_DECODED tokens (shorter ones cost
next to nothing, and so come out at every step whatever a busy machine's timings say): decoding takes at most
about that share of a generation's time, and a long text comes in pieces of several steps (on a CPU, whose steps
are slow, that happens only past thousands of tokens; a GPU's fast steps reach it sooner).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

HOLD_CHARS = 8  # characters of the newest text held back (and the longest stop string's length more)
DECODE_SHARE = 0.02  # the most of a generation's time that decoding its text for the stream may take
ALWAYS_DECODED = 256  # texts of up to this many tokens are decoded at every step (SmolLM2's: 0.06 ms)


class TextStream:
    """Writes a generation's text to `write` in pieces as it settles; see the module's docstring."""

    def __init__(
        self,
        write: Callable[[str], object],
        decode: Callable[[list[int]], str],
        stop: list[str],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.write, self.decode, self.clock = write, decode, clock
        self.hold = HOLD_CHARS + max((len(s) for s in stop), default=0)
        self.written = ""
        self.diverged = False  # (the text changed before what was held back: nothing more until the end)
        self.next_decode = float("-inf")  # (the clock's time before which an update skips its decode)

    def update(self, token_ids: list[int]) -> None:
        """The tokens generated so far (generation goes on)."""
        if self.diverged:
            return
        started = self.clock()
        if started < self.next_decode and len(token_ids) > ALWAYS_DECODED:
            return
        text = self.decode(token_ids)
        self.next_decode = started + (self.clock() - started) / DECODE_SHARE
        if not text.startswith(self.written):  # (the whole text: one grown shorter may hold less than is out)
            self.diverged = True
        elif len(text) - self.hold > len(self.written):
            self.write(text[len(self.written) : len(text) - self.hold])
            self.written = text[: len(text) - self.hold]

    def finish(self, text: str) -> None:
        """Generation ended with `text` (the result's): write what is left of it."""
        if text.startswith(self.written):
            if len(text) > len(self.written):
                self.write(text[len(self.written) :])
            return
        warnings.warn(
            f"the streamed text ({len(self.written)} characters) is not the start of the result's text: the "
            "tokenizer's decoded text changed further back than the stream holds back; result.text (the text of "
            "`specframe generate --json`) is the right one",
            RuntimeWarning,
            stacklevel=3,
        )
