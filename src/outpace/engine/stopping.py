"""StopChecker: appends a sequence's new tokens one by one and decides when it ends.

Ends on EOS (unless ignore_eos), a stop token id, a stop string, max_tokens, or the context
limit. Tokens after the one that ended the sequence are dropped. The stopping token stays in
token_ids; a stop string and what follows it never reach the text. While running, `seq.text`
holds back any tail that could still grow into a stop string, so streamed text is never retracted.
"""
from __future__ import annotations

from outpace.config import SamplingParams
from outpace.weights.tokenizer import IncrementalDecoder, Tokenizer


class StopChecker:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, eos_ids, max_model_len: int):
        self.params = params
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids |= set(eos_ids) | set(tokenizer.eos_token_ids)
        self.max_model_len = max_model_len
        self.decoder = IncrementalDecoder(tokenizer, [])
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
            self.full_text += self.decoder.step([token])
            if self.params.stop and self._apply_stop_strings(seq):
                break
            if seq.num_output_tokens >= self.params.max_tokens or len(seq.token_ids) >= self.max_model_len:
                seq.finish_reason = "length"
                break
        if seq.finish_reason and not self.is_stopped_by_string:
            self.full_text += self.decoder.finish()     # a character held back at the very end
        # without stop strings nothing is held back
        seq.text = self.full_text if seq.finish_reason or not self.params.stop else self._visible(self.full_text)
        return appended

    def _apply_stop_strings(self, seq) -> bool:
        for stop in self.params.stop:
            # only the tail can hold a new match: the text before it was checked already
            at = self.full_text.find(stop, max(0, len(self.full_text) - len(stop) - 32))
            if at >= 0:
                self.full_text = self.full_text[:at]
                seq.finish_reason = "stop"
                self.is_stopped_by_string = True
                return True
        return False

    def _visible(self, text: str) -> str:
        keep = len(text)
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    keep = min(keep, len(text) - n)
                    break
        return text[:keep]
