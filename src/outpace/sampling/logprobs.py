"""The target's log-probabilities of the tokens a step emits, for requests that ask
(SamplingParams.logprobs).

They come from the logits the step verified with: at each emitted position the target's
prediction after the tokens before it, which is the forward plain decoding runs there, so a
speculative request reports what a plain one reports (bit for bit in exact mode, and wherever
both forwards compute alike). They are the model's own distribution, log_softmax of its logits,
before temperature and the filters, as vLLM reports them by default; rank 1 is the target's most
likely token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from outpace.runner.staging import to_device


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int                           # 1 + the number of tokens the target finds more likely
    decoded_token: str | None = None    # the token's text, filled in by the API that returns it


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int):
    """logits [R, S, V] and the tokens [R, S] emitted at those positions: (logprob [R, S] float32,
    rank [R, S], top ids [R, S, num_top], top logprobs [R, S, num_top] float32), on the device."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, tokens[..., None])
    rank = (logprobs > chosen).sum(-1) + 1
    top, ids = logprobs.topk(num_top, dim=-1)
    return chosen[..., 0], rank, ids, top


class StepLogprobs:
    """A step's logprobs, computed on the device for the rows of `rows` (logits [B, S, V] of every
    row, out [B, S] its emitted tokens; at: where each of rows is in them, where that is not its
    row of the step: a graph step's buffers are by slot) and read on the host after the step's
    synchronisation."""

    def __init__(self, rows: list[int], num_top: list[int], logits: torch.Tensor, out: torch.Tensor,
                 at: list[int] | None = None):
        self.rows, self.num_top = rows, num_top
        index = to_device(rows if at is None else at, logits.device)      # no wait for the device
        values = token_logprobs(logits.index_select(0, index), out.index_select(0, index), max(num_top))
        self.copied = None
        if logits.is_cuda:
            # copied to pinned host memory as soon as computed, and waited for alone: a .tolist()
            # would wait for everything queued on the device by then, a step launched ahead too
            values = tuple(torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
                           for v in values)
            self.copied = torch.cuda.Event()
            self.copied.record()
        self.values = values

    def host(self, tokens: list[list[int]]) -> list[list[dict[int, Logprob]] | None]:
        """Per row of the step, given the tokens it emits (read at the step's synchronisation), one
        {token: Logprob} a token, the emitted token first, then its alternatives by rank; None for
        a row that did not ask."""
        if self.copied is not None:
            self.copied.synchronize()
        chosen, rank, ids, top = (v.tolist() for v in self.values)
        out: list[list[dict[int, Logprob]] | None] = [None] * len(tokens)
        for k, (row, n) in enumerate(zip(self.rows, self.num_top)):
            entries = []
            for j, token in enumerate(tokens[row]):
                entry = {token: Logprob(chosen[k][j], rank[k][j])}
                for r, (t, value) in enumerate(zip(ids[k][j][:n], top[k][j][:n])):
                    entry.setdefault(t, Logprob(value, r + 1))
                entries.append(entry)
            out[row] = entries
        return out
