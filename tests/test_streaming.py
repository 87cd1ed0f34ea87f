"""Text streamed while it is generated (`generate(stream=...)`, specframe/streaming.py)."""

import warnings

import pytest

from specframe import SpeculativeDecoder
from specframe.decoder import target_info
from specframe.errors import BadInputError, SpecframeError
from specframe.proposers.draft import DraftConfig, DraftProposer
from specframe.proposers.none import NoneConfig, NoneProposer
from specframe.streaming import ALWAYS_DECODED, DECODE_SHARE, HOLD_CHARS, TextStream
from specframe.testing.tiny import tiny_llama


class LetterTokenizer:
    """Token id i decodes to the i-th character from 'a' on."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


class ByteTokenizer(LetterTokenizer):
    """Token i is the byte i, decoded as byte-level BPE decodes: the first bytes of a character whose rest is
    still to come read as U+FFFD until it comes."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def decoders(vocab_size, tokenizer):
    target = tiny_llama(vocab_size=vocab_size, seed=5)
    info = target_info(target)
    draft = DraftProposer.random(info, DraftConfig(num_speculative_tokens=3), seed=1)  # (steps of several tokens)
    for proposer in (NoneProposer(NoneConfig(), info), draft):
        dec = SpeculativeDecoder(target, proposer, tokenizer)
        dec.eos_ids = set()
        yield dec


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("vocab_size, tokenizer", [(26, LetterTokenizer()), (256, ByteTokenizer())])
def test_the_pieces_add_up_to_the_text_and_come_while_it_is_generated(vocab_size, tokenizer, temperature):
    for dec in decoders(vocab_size, tokenizer):
        pieces, seen_by_step = [], []
        propose = dec.proposer.propose
        dec.proposer.propose = lambda state, seen=seen_by_step, pieces=pieces, propose=propose: (
            seen.append(len(pieces)) or propose(state)
        )
        for seed in range(3):
            pieces.clear()
            res = dec.generate([1, 2, 3], max_new_tokens=40, temperature=temperature, seed=seed, stream=pieces.append)
            assert "".join(pieces) == res.text and len(res.text) >= 3 * HOLD_CHARS
            assert all(pieces) and seen_by_step[-1] >= 1  # (text out before the last step, never an empty piece)


def test_a_stop_string_is_never_streamed():
    for dec in decoders(26, LetterTokenizer()):
        full = dec.generate([1, 2, 3], max_new_tokens=40).text
        for stop in ([full[20:22]], [full[15:30]], [full[25:27], "z" * 30]):
            pieces = []
            res = dec.generate([1, 2, 3], max_new_tokens=40, stop=stop, stream=pieces.append)
            assert res.stats["finish_reason"] == "stop" and "".join(pieces) == res.text
            assert all(s not in "".join(pieces) for s in stop) and len(res.text) <= 25


def test_the_tail_a_tokenizer_may_still_change_is_held_back():
    texts = iter(["Well, I think I do n", "Well, I think I don't know yet, but"])
    pieces = []
    stream = TextStream(pieces.append, lambda ids: next(texts), stop=[])
    stream.update([1])
    assert pieces == ["Well, I think"[: len("Well, I think I do n") - HOLD_CHARS]]
    stream.update([1, 2])
    stream.finish("Well, I think I don't know yet, but sure.")
    assert "".join(pieces) == "Well, I think I don't know yet, but sure."
    long_stop = TextStream(pieces.append, lambda ids: "x" * 30, stop=["y" * 20])
    assert long_stop.hold == HOLD_CHARS + 20  # (a stop string may end in the unsettled tail)


class ScriptedClock:
    """A clock that moves only when told: by each decode's cost and by the time between steps."""

    def __init__(self):
        self.now, self.decoding = 0.0, 0.0

    def __call__(self):
        return self.now

    def decoder(self, cost, text):
        def decode(ids):
            self.now += cost
            self.decoding += cost
            return text[: len(ids)]

        return decode


@pytest.mark.parametrize("decode_cost, decodes", [(1e-4, 200), (1.0, 40)])
def test_decoding_takes_at_most_its_share_of_the_time(decode_cost, decodes):
    # (steps of 10 s, two tokens each past ALWAYS_DECODED: a decode of 0.1 ms runs at every one of the 200; one of
    # 1 s only at every fifth, and the text still comes while it is generated, in pieces that add up to it)
    start = ALWAYS_DECODED
    text = "".join(chr(ord("a") + i % 26) for i in range(start + 400))
    clock, pieces = ScriptedClock(), []
    stream = TextStream(pieces.append, clock.decoder(decode_cost, text), stop=[], clock=clock)
    for n in range(1, 201):
        stream.update(list(range(start + 2 * n)))
        clock.now += 10.0
    assert round(clock.decoding / decode_cost) == decodes
    assert clock.decoding <= DECODE_SHARE * clock.now + decode_cost
    assert len("".join(pieces)) >= len(text) - 2 * 5 * 2 - HOLD_CHARS  # (the last decode at most ~5 steps back)
    stream.finish(text)
    assert "".join(pieces) == text


def test_a_short_text_is_decoded_at_every_step_however_slow_a_decode_looks():
    # (on a busy machine one decode of a short text can take long: its text must come out at every step anyway)
    clock, pieces = ScriptedClock(), []
    text = "".join(chr(ord("a") + i % 26) for i in range(ALWAYS_DECODED))
    stream = TextStream(pieces.append, clock.decoder(5.0, text), stop=[], clock=clock)
    for n in range(1, ALWAYS_DECODED + 1):
        stream.update(list(range(n)))
        clock.now += 0.001
    assert round(clock.decoding / 5.0) == ALWAYS_DECODED and "".join(pieces) == text[:-HOLD_CHARS]


def byte_fallback_tokenizer():
    """SentencePiece's kind (Llama 2's, Mistral's): spaces as "▁", other text as its UTF-8 bytes (<0xNN>), each
    byte of a character whose rest is still to come decoded as one U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    vocab["▁"] = 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    parts = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    tok.decoder = decoders.Sequence(parts)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_text_that_grows_shorter_is_streamed_on():
    # (before: "\ufffd\ufffd\ufffd" becoming "😀", or "x '" cleaned up to "x'", left less settled text than was
    # out, which was taken for a change further back: nothing more was streamed until the end)
    tokenizer = byte_fallback_tokenizer()
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    ids = tokenizer.encode("the cat 😀 sat on the mat, the cat sat on the mat", add_special_tokens=False)
    assert decode(ids[:12]) == "the cat \ufffd\ufffd\ufffd" and decode(ids[:13]) == "the cat 😀"
    pieces = []
    stream = TextStream(pieces.append, decode, stop=[])
    for n in range(1, len(ids)):  # (a token a step, as plain decoding)
        stream.update(ids[:n])
    assert "".join(pieces) == decode(ids[:-1])[:-HOLD_CHARS]
    texts = ["Well, I think it was x '", "Well, I think it was x'", "Well, I think it was x' and more"]
    pieces = []
    stream = TextStream(pieces.append, lambda ids: texts[len(ids) - 1], stop=[])
    for n in range(1, 4):
        stream.update([0] * n)
    assert "".join(pieces) == texts[2][:-HOLD_CHARS]


def test_a_stop_string_that_the_last_byte_of_a_character_completes_is_never_streamed():
    # (before: "cat sat \ufffd\ufffd\ufffd" gave way to "cat sat 😀" two characters shorter, so the stop string
    # began two characters before the tail held back: its "c" was streamed, then a warning)
    tokenizer = byte_fallback_tokenizer()
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    ids = tokenizer.encode("the mat, the cat sat 😀 on the mat", add_special_tokens=False)
    stop = "cat sat 😀"
    completes = next(n for n in range(1, len(ids) + 1) if stop in decode(ids[:n]))
    pieces = []
    stream = TextStream(pieces.append, decode, stop=[stop])
    for n in range(1, completes):  # (the engine's updates before the step that completes it)
        stream.update(ids[:n])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stream.finish("the mat, the ")  # (the result's text: cut where the stop string starts)
    assert "".join(pieces) == "the mat, the "


def test_text_that_changes_further_back_stops_the_stream_and_is_never_written_wrong():
    texts = iter(["abcdefghijklmnopq", "abcdeZZZZZZZZZZZZZZZZZ", "abcdeZZZZZZZZZZZZZZZZZZZZZZ"])
    pieces = []
    stream = TextStream(pieces.append, lambda ids: next(texts), stop=[])
    for _ in range(3):
        stream.update([1])
    assert pieces == ["abcdefghi"]  # (nothing after the change)
    with pytest.warns(RuntimeWarning, match="streamed text .* is not the start of the result's text"):
        stream.finish("abcdeZZZZZZZZZZZZZZZZZZZZZZ")
    assert pieces == ["abcdefghi"]
    again = TextStream(pieces.append, lambda ids: "abcdefghijklmnopq", stop=[])
    again.update([1])
    again.finish("abcdefghijklmnopq and the rest")  # (consistent after all: the rest, no warning)
    assert pieces[-2:] == ["abcdefghi", "jklmnopq and the rest"]


def test_a_stream_that_fails_ends_the_call_and_leaves_the_decoder_as_it_was():
    dec = list(decoders(26, LetterTokenizer()))[1]  # (the draft proposer: its per-call state too)
    expected = dec.generate([1, 2, 3], max_new_tokens=40, temperature=1.0, seed=2).token_ids

    def failing(piece):
        raise KeyboardInterrupt

    for stream, error, match in (
        (failing, KeyboardInterrupt, None),
        (lambda piece: dec.generate([1], max_new_tokens=2), SpecframeError, "by its proposer 'draft', or the funct"),
    ):
        with pytest.raises(error, match=match):
            dec.generate([1, 2, 3], max_new_tokens=40, stream=stream)
        pieces = []
        res = dec.generate([1, 2, 3], max_new_tokens=40, temperature=1.0, seed=2, stream=pieces.append)
        assert res.token_ids == expected and "".join(pieces) == res.text


def test_bad_streams_are_refused():
    dec = next(decoders(26, LetterTokenizer()))
    with pytest.raises(BadInputError, match="stream must be a function taking the text's pieces, got an int"):
        dec.generate([1, 2], max_new_tokens=3, stream=5)
    dec.tokenizer = None
    with pytest.raises(BadInputError, match="stream needs the target's tokenizer"):
        dec.generate([1, 2], max_new_tokens=3, stream=print)
