"""Incremental detokenization and stop-string matching for streamed text.

Decoding tokens one at a time is wrong for byte-level BPE (a character can span tokens) and for
tokenizers whose spacing depends on the neighbours, so text is decoded over a short window of
already-emitted tokens and only the part after the previously emitted text is released; a trailing
U+FFFD (an incomplete UTF-8 sequence) is held back until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT = "\ufffd"
_WINDOW = 6  # tokens of left context re-decoded with each new token


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # tokens whose text has been released
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly stable text (may be empty)."""
        out = []
        for tok in new_token_ids:
            self.token_ids.append(int(tok))
            prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
                delta = full[len(prefix):]
                out.append(delta)
                self.read_offset = len(self.token_ids)
                self.prefix_offset = max(0, self.read_offset - _WINDOW)
        piece = "".join(out)
        self.text += piece
        return piece

    def flush(self) -> str:
        """At end of stream: release whatever is still held back (even an incomplete character)."""
        if self.read_offset == len(self.token_ids):
            return ""
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        self.read_offset = len(self.token_ids)
        piece = full[len(prefix):]
        self.text += piece
        return piece


class StopStringMatcher:
    """Finds stop strings in streamed text.

    ``feed`` returns the text that is safe to send: anything that could still be the start of a stop
    string is held back. Once a stop string appears, the text before it is released, ``stopped``
    becomes True and everything after is dropped (OpenAI semantics: the stop string is not returned).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stops]
        hits = [h for h in hits if h[0] >= 0]
        if hits:
            cut = min(h[0] for h in hits)
            out, self.pending, self.stopped = self.pending[:cut], "", True
            return out
        # Keep the longest tail that is a proper prefix of some stop string.
        keep = 0
        for n in range(min(self._hold, len(self.pending)), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stops):
                keep = n
                break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out

    def flush(self) -> str:
        """End of stream without a stop: release the held-back tail."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
