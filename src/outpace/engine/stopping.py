"""StopChecker: appends a sequence's new tokens one by one and decides when it ends.

Ends on EOS (unless ignore_eos), a stop token id, a stop string, max_tokens, or the context
limit. Tokens after the one that ended the sequence are dropped. The stopping token stays in
token_ids; a stop string and what follows it never reach the text. While running, `seq.text`
holds back any tail that could still grow into a stop string, so streamed text is never retracted.
"""
from __future__ import annotations

from outpace.config import SamplingParams
from outpace.weights.tokenizer import IncrementalDecoder, Tokenizer


class StopStrings:
    """The first stop string to complete in a growing text, found in O(new characters x stops)
    per append, however long the text is.

    Invariant: matched[j] is the length of the longest prefix of stops[j] that ends the text read
    so far (Knuth-Morris-Pratt's state), so a stop completes when it reaches len(stops[j]), and
    the text's last max(matched) characters are all that could still start one.
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.fallback = [_prefix_function(s) for s in stops]
        self.matched = [0] * len(stops)
        self.first_chars = {s[0] for s in stops}
        self.is_matching = False            # some matched[j] > 0
        self.length = 0                     # characters read

    def feed(self, text: str) -> int | None:
        """Read the text's next characters; returns where (an index into all the text read) the
        first stop string to complete starts, the earliest-starting one among those completing at
        the same character; None while none has."""
        for char in text:
            self.length += 1
            if not self.is_matching and char not in self.first_chars:
                continue                    # every state stays 0
            start = None
            for j, stop in enumerate(self.stops):
                k = self.matched[j]
                while k and stop[k] != char:
                    k = self.fallback[j][k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):
                    at = self.length - k
                    start = at if start is None else min(start, at)
                    k = self.fallback[j][k - 1]
                self.matched[j] = k
            self.is_matching = any(self.matched)
            if start is not None:
                return start
        return None

    @property
    def num_held(self) -> int:
        """Characters at the end of the text that may still be the start of a stop string."""
        return max(self.matched, default=0)


def _prefix_function(s: str) -> list[int]:
    """fallback[i]: the length of the longest proper prefix of s[:i+1] that is also its suffix."""
    fallback = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fallback[k - 1]
        if s[i] == s[k]:
            k += 1
        fallback[i] = k
    return fallback


class StopChecker:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, eos_ids, max_model_len: int):
        self.params = params
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids |= set(eos_ids) | set(tokenizer.eos_token_ids)
        self.max_model_len = max_model_len
        self.decoder = IncrementalDecoder(tokenizer, [])
        self.stop_strings = StopStrings(params.stop) if params.stop else None
        self.full_text = ""
        self.is_stopped_by_string = False

    def append(self, seq, new_tokens: list[int]) -> list[int]:
        """Append tokens until one ends the sequence; returns the tokens appended."""
        appended = []
        for token in new_tokens:
            seq.token_ids.append(token)
            appended.append(token)
            if token in self.stop_ids:
                seq.finish_reason = "stop"
                break
            if self.params.detokenize and self._feed_text(seq, token):
                seq.finish_reason = "stop"
                break
            if seq.num_output_tokens >= self.params.max_tokens or len(seq.token_ids) >= self.max_model_len:
                seq.finish_reason = "length"
                break
        if self.params.detokenize:
            self._set_text(seq)
        return appended

    def _feed_text(self, seq, token: int) -> bool:
        """Detokenize one more token; True where a stop string ends the text (not before the
        output holds min_tokens tokens: a stop string completed sooner stays in the text)."""
        new_text = self.decoder.step([token])
        self.full_text += new_text
        at = self.stop_strings.feed(new_text) if self.stop_strings is not None else None
        if at is not None and seq.num_output_tokens < self.params.min_tokens:
            at = None
        if at is not None:
            self.full_text = self.full_text[:at]
            self.is_stopped_by_string = True
        return at is not None

    def _set_text(self, seq) -> None:
        """seq.text: the text so far, less what a stop string may yet claim."""
        if seq.finish_reason and not self.is_stopped_by_string:
            last = self.decoder.finish()                # a character held back at the very end
            self.full_text += last
            at = self.stop_strings.feed(last) if self.stop_strings is not None else None
            if at is not None:
                self.full_text, seq.finish_reason = self.full_text[:at], "stop"
        held = 0 if seq.finish_reason or self.stop_strings is None else self.stop_strings.num_held
        seq.text = self.full_text[:len(self.full_text) - held]
