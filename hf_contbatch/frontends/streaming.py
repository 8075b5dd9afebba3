"""Token ids to text deltas, incrementally: safe with multi-byte characters and with stop strings.

For fast tokenizers the deltas come from the tokenizers library's own streaming decoder
(``tokenizers.decoders.DecodeStream``), which holds back incomplete characters itself.
``IncrementalDetokenizer`` is the fallback for slow tokenizers (and for ``clean_up_tokenization_spaces``,
which DecodeStream does not apply): it decodes only a short window of recent tokens per step (the approach of
vLLM's detokenizer), so streaming a sequence costs O(length), not the O(length²) of decoding the
whole output at every token; a character whose bytes span several tokens (byte-level BPE: emoji, CJK)
is held until complete, so no U+FFFD is ever emitted mid-stream and nothing is emitted twice.

``StopStringHoldback`` withholds any tail of the text that could still grow into a stop string, and
cuts the text at the first stop string, so no part of a stop string ever reaches the stream.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns appended token ids into text deltas.

    Args:
        tokenizer: a transformers tokenizer.
        skip_special_tokens, clean_up_tokenization_spaces: as in ``tokenizer.decode``.

    The deltas concatenate to ``tokenizer.decode(all_ids)`` for the tokenizers transformers ships
    (the window keeps the token before the new ones as context, so SentencePiece's leading spaces
    survive); ``finish()`` reconciles with one full decode at the end.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, clean_up_tokenization_spaces=None) -> None:
        self.tokenizer = tokenizer
        self._kw = {"skip_special_tokens": skip_special_tokens}
        if clean_up_tokenization_spaces is not None:
            self._kw["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens before this are emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, **self._kw)

    def add(self, new_ids: Iterable[int]) -> str:
        """Append tokens; return the newly completed text ("" while a character is incomplete)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # nothing printable yet, or a multi-byte character still incomplete
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """The rest of the text at the end of the sequence (an incomplete character included)."""
        full = self._decode(self.ids)
        if full.startswith(self.text):
            delta = full[len(self.text) :]
        else:  # a tokenizer whose windowed decode disagrees with its full decode: keep the stream's view
            tail = self._decode(self.ids[self._prefix_offset :])
            prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
            delta = tail[len(prefix_text) :] if tail.startswith(prefix_text) else ""
        self.text += delta
        self._prefix_offset = self._read_offset = len(self.ids)
        return delta


class DecodeStreamDetokenizer:
    """``IncrementalDetokenizer``'s interface over ``tokenizers.decoders.DecodeStream`` (fast
    tokenizers): the library keeps the decoding window and returns None while a character is
    incomplete.

    Args:
        tokenizer: a fast transformers tokenizer (``tokenizer.is_fast``).
        skip_special_tokens: as in ``tokenizer.decode``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far

    def add(self, new_ids: Iterable[int]) -> str:
        """Append tokens; return the newly completed text ("" while a character is incomplete)."""
        new_ids = list(new_ids)
        self.ids.extend(new_ids)
        delta = ""
        for token in new_ids:
            chunk = self._stream.step(self.tokenizer._tokenizer, token)
            if chunk:
                delta += chunk
        self.text += delta
        return delta

    def finish(self) -> str:
        """The rest of the text at the end of the sequence (an incomplete character included); the
        stream's text then equals ``tokenizer.decode(ids)`` whenever it was a prefix of it."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self._skip)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta


def make_detokenizer(tokenizer, skip_special_tokens: bool = True, clean_up_tokenization_spaces=None):
    """``DecodeStreamDetokenizer`` where the tokenizers library can stream (a fast tokenizer, no
    clean-up of tokenization spaces), else ``IncrementalDetokenizer``."""
    clean = clean_up_tokenization_spaces
    if clean is None:
        clean = getattr(tokenizer, "clean_up_tokenization_spaces", False)
    if getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "_tokenizer") and not clean:
        try:
            from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
        except ImportError:
            pass
        else:
            return DecodeStreamDetokenizer(tokenizer, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, skip_special_tokens, clean_up_tokenization_spaces)


class StopStringHoldback:
    """Releases text only once it can no longer be part of a stop string.

    Args:
        stop_strings: the request's stop strings (may be empty).
    """

    def __init__(self, stop_strings: Optional[Sequence[str]] = None) -> None:
        self.stop_strings = [s for s in (stop_strings or ()) if s]
        self._pending = ""  # text not released yet (may start a stop string)
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add text; return what is safe to release now."""
        if self.stopped or not text:
            return ""
        if not self.stop_strings:
            return text
        pending = self._pending + text
        cut = min((i for i in (pending.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return pending[:cut]
        keep = self._longest_stop_prefix_suffix(pending)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """At the end: release what was held (it never became a stop string)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


def text_deltas(
    token_batches: Iterable[Sequence[int]],
    tokenizer,
    stop_strings: Optional[Sequence[str]] = None,
    skip_special_tokens: bool = True,
    clean_up_tokenization_spaces=None,
) -> Iterator[str]:
    """Text deltas for a stream of token-id batches: nothing of a stop string, no split characters."""
    token_batches = iter(token_batches)
    detok = make_detokenizer(tokenizer, skip_special_tokens, clean_up_tokenization_spaces)
    hold = StopStringHoldback(stop_strings)
    for batch in token_batches:
        out = hold.feed(detok.add(batch))
        if out:
            yield out
        if hold.stopped:
            break
    for _ in token_batches:  # the engine stops right after a stop string: wait for the end
        pass
    out = hold.feed(detok.finish())
    out += hold.flush()
    if out:
        yield out
