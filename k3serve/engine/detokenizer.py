"""Streaming text output: incremental detokenization and stop-string matching.

``IncrementalDetokenizer`` works on token bytes (``tokenizer.decode_bytes``) fed through an
incremental UTF-8 decoder, so a character whose bytes are split across byte-level tokens is
emitted exactly when its last byte arrives, and the concatenation of all ``push`` results plus
``flush()`` equals ``tokenizer.decode(all_ids)``. O(1) per token (nothing is re-decoded).
Bytes that can never start/continue a valid character are replaced (U+FFFD) as soon as they are
known to be invalid — exactly as the one-shot ``bytes.decode("utf-8", "replace")`` would — while
a valid but incomplete tail is held and only replaced by ``flush()``.

``StopStringMatcher`` holds back any text that could still be the beginning of a stop string.
Semantics (independent of how the text is chunked): the stop is the occurrence that *completes
first* (smallest end offset; on a tie the one starting earliest, i.e. the longest); the output is
the text before it (plus the stop string when ``include_stop``), and nothing after it is ever
emitted. This is what token-by-token checking (vLLM, HF ``StopStringCriteria``) yields: a stop is
acted on as soon as it completes, never delayed for a longer stop that might still complete.
"""

from __future__ import annotations

import codecs
from typing import Iterable

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "apply_stop_strings"]


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._token_bytes = getattr(tokenizer, "token_bytes", None)
        self.num_tokens = 0

    def _bytes(self, token_id: int) -> bytes:
        if self._token_bytes is not None:
            return self._token_bytes(token_id, self.skip_special_tokens)
        return self.tokenizer.decode_bytes([token_id], skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Text completed by this token ('' while a multi-byte character is still incomplete)."""
        self.num_tokens += 1
        return self._decoder.decode(self._bytes(int(token_id)), False)

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """End of stream: an incomplete trailing character becomes U+FFFD."""
        return self._decoder.decode(b"", True)

    @property
    def pending_bytes(self) -> bytes:
        """Bytes held back because they may still become a complete character."""
        return self._decoder.getstate()[0]


def _first_completed(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """(start offset, stop) of the occurrence with the smallest end, ties to the longest."""
    best: tuple[int, int, str] | None = None  # (end, -len, stop)
    for s in stops:
        i = text.find(s, start)
        if i >= 0:
            key = (i + len(s), -len(s), s)
            if best is None or key < best:
                best = key
    if best is None:
        return None
    return best[0] + best[1], best[2]


def apply_stop_strings(text: str, stops: list[str], include_stop: bool = False) -> tuple[str, str | None]:
    """Non-streaming reference: (output text, matched stop or None)."""
    stops = [s for s in stops if s]
    hit = _first_completed(text, stops)
    if hit is None:
        return text, None
    i, s = hit
    return text[:i + (len(s) if include_stop else 0)], s


class StopStringMatcher:
    def __init__(self, stops: Iterable[str], include_stop: bool = False) -> None:
        # empty strings would match everywhere; they are ignored
        self.stops = list(dict.fromkeys(s for s in stops if s))
        self.include_stop = include_stop
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the output
        self._max_prefix = max((len(s) for s in self.stops), default=1) - 1
        # every proper, non-empty prefix of every stop, for the hold-back test
        self._prefixes = {s[:k] for s in self.stops for k in range(1, len(s))}

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string has completed)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        # no stop can end inside the held text (it was checked), so only matches ending in the
        # new text are possible; text.find over buf is O(len(buf)) with len(held) < max stop len
        hit = _first_completed(buf, self.stops)
        if hit is not None:
            i, s = hit
            self.stopped = True
            self.matched = s
            self._held = ""
            return buf[:i + (len(s) if self.include_stop else 0)], True
        k = min(self._max_prefix, len(buf))
        while k > 0 and buf[-k:] not in self._prefixes:
            k -= 1
        if k:
            self._held = buf[-k:]
            return buf[:-k], False
        self._held = ""
        return buf, False

    def flush(self) -> str:
        """End of stream without a stop: release the held-back text."""
        if self.stopped:
            return ""
        out, self._held = self._held, ""
        return out

    @property
    def held(self) -> str:
        return self._held
