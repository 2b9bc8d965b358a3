"""DraftModelDrafter: a small model of the target's vocabulary drafts, in one batched draft context.

The draft model runs beside the target with a KV cache of its own in the same slots (a runner
from DraftContext.make_runner). Each step drafts for every row at once: one forward over all rows
per draft position, never a loop over sequences. The first forward of a step also catches each
row up on the tokens its cache lacks (the target's own token of the last step, and any tokens of
steps it did not draft in), so a row's input is [uncached tokens..., last token]; later forwards
feed one drafted token a row. A row stops drafting at its budget or when the draft's top
probability falls below p_min (it is unlikely to be accepted).

Where the host reads the drafts: on the CPU after every forward, so that rows which stopped leave
the batch (their forwards cost compute); on a GPU once, at the end (`drafts_on_device`). There every
drafting row drafts the step's largest budget, each forward's token fed to the next as a device
tensor (a host read a position would leave the device idle while the host reads and launches the
next forward), and each row is cut afterwards where the per-position loop would have stopped it.

Cache invariant, per sequence: positions [0, valid) of its slot hold this model's keys and values
of the first `valid` tokens it reads (the whole sequence, or from the window's start). Drafting
writes entries past `valid` for the drafted tokens fed back; after verification those that equal
the accepted tokens stay valid, the rest are stale and are overwritten by the next catch-up (the
target's rollback rule, by length). Prompt chunks are
cached in the same chunks as the target's (prefilled), so the first draft needs no long catch-up,
unless the controller does not expect the sequence to draft (its prompt's cost would not be
repaid at the present load, Prefilled.defer): then they are left to a catch-up, which the
controller prices like the one after steps the row did not draft in (setup_seconds, measured at
start as what a forward of one row of n tokens costs beyond one of a single token), so a load
where the model does not pay costs nothing for it after the controller's probes. With a
window (draft_window N), the model reads only each prompt's last N tokens, as a sequence of its
own from position 0 of its slot: its share of a long prompt's prefill is N tokens at most, and it
drafts from that much context (a lookup ahead of it, ngram_first, still matches the whole prompt).
A sequence's slot keeps this model's keys once it ends, as the target's does (engine/scheduler.py):
the next sequence this model caches in that slot starts with them valid as far as its tokens
begin with the kept ones, whatever prefix the target reused (a shorter one: the chunks cache
the rest; a longer one: the first draft catches up).

A greedy row drafts the draft's argmax. A sampled row samples the draft's distribution, shaped
by the row's own parameters, with the target's noise for that output position (u(seed, i),
sampling/sampler.py): where the two distributions agree the two inverse CDFs land on the same
token, so the draft is accepted as often as the coupling allows, and the output stays plain
seeded sampling's whatever the draft (verification accepts a draft only where it equals the
target's own sample).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

import torch

from outpace.engine.scheduler import common_prefix
from outpace.errors import InvalidParameterError
from outpace.runner.calibrate import batch_buckets, kept, settle
from outpace.runner.model_runner import Row
from outpace.runner.staging import to_device
from outpace.sampling.sampler import SamplingState, inverse_cdf, logits_to_probs
from outpace.speculative.compat import check_vocab_compatible
from outpace.speculative.controller import interpolate
from outpace.speculative.drafter import DraftBatch, DraftContext, Drafter, Drafts, KeptKeys, Prefilled
from outpace.weights.hub import resolve_model
from outpace.weights.loader import load_model
from outpace.weights.tokenizer import Tokenizer


class DraftModelDrafter(Drafter):
    name = "draft"
    priced_after_drafting = False       # every drafted token costs a forward: the controller's budget first

    def __init__(self, model: str, p_min: float = 0.0, draft_vocab: int = 0, window: int = 0,
                 weights: str = "q4_0"):
        """model: a known name, a Hugging Face folder or a .gguf file of the draft model;
        draft_vocab: draft among the first token ids alone (0: every id the two models share);
        window: the draft model reads only the last `window` tokens of each prompt (0: all of it);
        weights: "q4_0" holds its quantized matrices in Q4_0 where the file's take more bytes,
        "file" as the file holds them (SpecConfig.draft_weights)."""
        self.source = model
        self.weights = weights
        self.p_min = p_min
        self.draft_vocab = draft_vocab
        self.window = window
        self.tokens: dict[int, list[int]] = {}      # seq_id -> the tokens it reads: prompt tail, accepted tokens
        self.offset: dict[int, int] = {}            # seq_id -> the sequence's position of tokens[0]
        self.valid: dict[int, int] = {}             # seq_id -> cached prefix of tokens (the invariant above)
        self.fed: dict[int, list[int]] = {}         # seq_id -> drafted tokens written past valid
        self.per_token: dict[int, float] = {}       # batch bucket -> seconds per drafted token
        self.catch_up: list[tuple[int, float]] = []  # (n, seconds a row of n tokens adds to a forward)

    def bind(self, context: DraftContext) -> None:
        folder = resolve_model(self.source)
        # ids below `vocab` mean the same token to both models; drafts stay below it
        shared = check_vocab_compatible(context.tokenizer, Tokenizer.from_folder(folder))
        self.model = load_model(folder, context.dtype, str(context.device), context.max_len, weights=context.weights,
                                requantize="Q4_0" if self.weights == "q4_0" else None)
        if self.model.is_recurrent:
            raise InvalidParameterError(f"the draft model {self.source!r} has recurrent layers, whose state "
                                        "cannot be rolled back across draft steps yet: use an attention-only draft model")
        self.vocab = min(shared, self.model.cfg.vocab_size, context.target.cfg.vocab_size, self.draft_vocab or shared)
        # the LM head computes the drafted ids' logits alone: a 151,936-token head is over a third
        # of a 0.5B draft's bytes read a token
        self.model.logit_rows = min(self.model.cfg.vocab_size, self.vocab)
        self.runner = context.make_runner(self.model)
        self.kept_keys = KeptKeys(context.prefix_key)        # a slot's keys for the next sequence there
        # whether propose feeds drafted tokens on the device and reads them once (see the top)
        self.drafts_on_device = self.runner.device.type == "cuda"
        self._measure(context.num_slots, context.max_len, context.max_step_tokens)

    def _measure(self, num_slots: int, max_len: int, width: int) -> None:
        """Seconds per drafted token by batch bucket: one forward of b rows of one token, over b;
        and what a catch-up of n tokens adds: one row of n tokens against one of a single token.
        A GPU replays graphs of rows up to `width` tokens (a verify row's) and runs longer rows
        eagerly, at about the same cost for any length (launches, not arithmetic): the curve has
        points on both sides of that step. Writes scratch keys into the slots it uses; prefills
        overwrite them. Measured once per model and machine (calibrate.kept), each timing settled
        as the verify cost's shapes are (calibrate.settle): a busy machine's measure is not kept."""
        def measure() -> tuple[dict, bool]:
            flags = []

            def seconds(rows: list[Row], reps: int) -> float:
                value, settled = settle(lambda: self._time(rows), reps)
                flags.append(settled)
                return value
            per_token = {b: seconds([Row(slot, [0], 1) for slot in range(b)], 3) / b
                         for b in batch_buckets(num_slots)}
            single = per_token[1]           # one row of one token (bucket 1 is always measured)
            catch_up = [(1, 0.0)] + [(n, max(seconds([Row(0, [0] * n, 0)], 2) - single, 0.0))
                                     for n in sorted({width, width + 1, 32, 128}) if 1 < n < max_len]
            return {"per_token": per_token, "catch_up": catch_up}, all(flags)
        costs = kept(self.runner, ["draft model", num_slots, max_len, width], measure)
        self.per_token = {int(b): seconds for b, seconds in costs["per_token"].items()}
        self.catch_up = [tuple(point) for point in costs["catch_up"]]

    def _time(self, rows: list[Row]) -> float:
        """The seconds of one forward of these rows."""
        t0 = time.perf_counter()
        self.runner.forward(rows)
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        return time.perf_counter() - t0

    def cost_per_token(self, batch_size: int) -> float:
        bucket = min((b for b in self.per_token if b >= batch_size), default=max(self.per_token))
        return self.per_token[bucket]

    def setup_seconds(self, seq_ids: Sequence[int]) -> list[float]:
        """A row's first draft forward reads the tokens its cache lacks: one (the target's token
        of the last step) or two (a whole draft accepted) after a drafting step, every token since
        after steps without drafts, the prompt where it was deferred. Up to two are part of every
        drafting step (cost_per_token); more are priced by the catch-up curve, linear between its
        points and past the last."""
        points = self.catch_up
        if len(points) < 2:         # a context too short to measure one
            return [0.0] * len(seq_ids)
        seconds = []
        for seq_id in seq_ids:
            n = len(self.tokens[seq_id]) - min(self.valid[seq_id], len(self.tokens[seq_id]) - 1)
            seconds.append(0.0 if n <= 2 else max(0.0, interpolate(points, n, extend=True)))
        return seconds

    # ---- sequences ----------------------------------------------------------------------------
    def begin(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """A window keeps the prompt's tail; the draft model reads it as a sequence of its own, from
        position 0 of its slot (rotary positions are relative, so the shift changes nothing else)."""
        offset = max(0, len(token_ids) - self.window) if self.window else 0
        self.tokens[seq_id], self.offset[seq_id] = list(token_ids[offset:]), offset
        self.valid[seq_id], self.fed[seq_id] = 0, []

    def prefilled(self, chunks: Prefilled) -> None:
        """The target's prompt chunks, cached in this model's slots too (one forward), but for the
        deferred ones (the top)."""
        rows, cached = [], []
        defer = chunks.defer or [False] * len(chunks.seq_ids)
        for seq_id, slot, tokens, start, later in zip(chunks.seq_ids, chunks.slots, chunks.token_ids, chunks.starts,
                                                      defer):
            if later:
                continue
            self._adopt(seq_id, slot)
            # the chunk at the draft's own positions (inside the window), past what its cache holds
            start -= self.offset[seq_id]
            valid, end = self.valid[seq_id], start + len(tokens)
            if start <= valid < end:
                rows.append(Row(slot, tokens[valid - start:], valid))
                cached.append((seq_id, end))
        if rows:
            self.runner.forward(rows, logits="none")
        for seq_id, end in cached:
            self.valid[seq_id] = end

    def accept(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Drafted entries past `valid` stay valid as far as they equal the accepted tokens."""
        tokens = self.tokens[seq_id]
        if self.valid[seq_id] == len(tokens):       # the entries past valid continue this sequence
            fed, same = self.fed[seq_id], 0
            while same < min(len(fed), len(token_ids)) and fed[same] == token_ids[same]:
                same += 1
            self.valid[seq_id] += same
        tokens += token_ids
        self.fed[seq_id] = []

    def _adopt(self, seq_id: int, slot: int) -> None:
        """Before this model first writes seq_id's slot: the keys kept there that begin its tokens
        are valid (KeptKeys)."""
        kept = self.kept_keys.adopt(seq_id, slot)
        if kept is not None:
            self.valid[seq_id] = common_prefix(kept, self.tokens[seq_id])

    def copy_prefix(self, source_id: int, source_slot: int, seq_id: int, slot: int, length: int) -> None:
        """The entries the source holds of the tokens the two share, where both read their prompts
        from the same position (a window's); it catches up past them by itself (no bound)."""
        self._adopt(seq_id, slot)
        if self.offset[source_id] != self.offset[seq_id]:
            return
        n = min(self.valid[source_id], common_prefix(self.tokens[source_id], self.tokens[seq_id]))
        if n > self.valid[seq_id]:
            self.runner.copy_prefix(source_slot, slot, n)
            self.valid[seq_id] = n

    def end(self, seq_id: int) -> None:
        if seq_id in self.tokens:
            self.kept_keys.end(seq_id, self.tokens[seq_id][:self.valid[seq_id]])
        for state in (self.tokens, self.offset, self.valid, self.fed):
            state.pop(seq_id, None)

    # ---- drafting -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Drafts:
        """Up to budget[i] tokens for each row: the first forward catches rows up and drafts one
        token each; every further forward feeds each drafting row its last drafted token."""
        active = [i for i, k in enumerate(batch.budget) if k > 0]
        if self.window:         # the rows' positions in the draft model's own sequences
            batch = replace(batch, positions=[p - self.offset[s] for s, p in zip(batch.seq_ids, batch.positions)])
        rows = []
        for i in active:
            seq_id = batch.seq_ids[i]
            self._adopt(seq_id, batch.slots[i])
            tokens, valid = self.tokens[seq_id], min(self.valid[seq_id], len(self.tokens[seq_id]) - 1)
            rows.append(Row(batch.slots[i], tokens[valid:], valid))
            self.fed[seq_id] = []
        drafts: list[list[int]] = [[] for _ in range(len(batch))]
        if active:
            draft = self._draft_on_device if self.drafts_on_device else self._draft_by_position
            draft(batch, active, rows, drafts)
        for i in active:            # every real token is cached once the first forward ran
            self.valid[batch.seq_ids[i]] = len(self.tokens[batch.seq_ids[i]])
        return Drafts.from_lists(drafts)

    def _draft_by_position(self, batch: DraftBatch, active: list[int], rows: list[Row],
                           drafts: list[list[int]]) -> None:
        """The host reads each position's tokens and the rows that stop leave the next forward."""
        logits = self._last_logits(self.runner.forward(rows)[0], rows)                     # [B, V]
        drafted = 0                         # by every row still drafting
        while active:
            best, token = self._pick(logits, self._sampling(batch, active, drafted, 1), 0)
            best, token = best.tolist(), token.tolist()                     # one host read per draft position
            still, rows = [], []
            for i, p, t in zip(active, best, token):
                if p < self.p_min or t >= self.vocab:
                    continue
                drafts[i].append(t)
                if len(drafts[i]) < batch.budget[i]:
                    # feeds the drafted token: its entry lands past `valid` (fed, checked in accept)
                    self.fed[batch.seq_ids[i]].append(t)
                    still.append(i)
                    rows.append(Row(batch.slots[i], [t], batch.positions[i] + len(drafts[i])))
            active, drafted = still, drafted + 1
            if active:
                logits = self.runner.forward(rows)[0][:, 0]                 # [B, V]

    def _draft_on_device(self, batch: DraftBatch, active: list[int], rows: list[Row],
                         drafts: list[list[int]]) -> None:
        """Every row drafts the largest budget's positions, each token fed to the next forward on
        the device, and the host reads the [B, K] tokens once; then each row is cut at its budget,
        or before its first token below p_min or outside the shared ids. The tokens fed past a
        row's cut were cached all the same: fed lists them, and accept keeps those accepted."""
        num_positions = max(batch.budget[i] for i in active)
        sampling = self._sampling(batch, active, 0, num_positions)
        logits = self._last_logits(self.runner.forward(rows)[0], rows)                     # [B, V]
        tokens, best = [], []               # per position: [B] each
        for d in range(num_positions):
            if d:
                # a row holds no host token: the drafted one is its input, at position + d
                rows = [Row(batch.slots[i], [], batch.positions[i] + d) for i in active]
                logits = self.runner.forward(rows, draft_tokens=tokens[-1][:, None])[0][:, 0]
            p, token = self._pick(logits, sampling, d)
            tokens.append(token)
            best.append(p)
        # the one host read: [B, 2K] in float32, where token ids (below 2**24) are exact
        host = torch.stack(tokens + best, 1).tolist()
        for i, row in zip(active, host):
            draft = [int(t) for t in row[:num_positions]]
            n = 0
            while n < batch.budget[i] and row[num_positions + n] >= self.p_min and draft[n] < self.vocab:
                n += 1
            drafts[i] = draft[:n]
            self.fed[batch.seq_ids[i]] = draft[:-1]       # each fed at position + 1 + its index

    def _last_logits(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """logits [B, S, V] of the rows -> [B, V] at each row's last token."""
        lengths = [len(r.token_ids) for r in rows]
        if min(lengths) == max(lengths):
            return logits[:, lengths[0] - 1]
        last = to_device([n - 1 for n in lengths], logits.device)
        return logits[torch.arange(len(rows), device=logits.device), last]

    @staticmethod
    def _pick(logits: torch.Tensor, sampling: tuple[SamplingState, torch.Tensor] | None,
              column: int) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] -> (top probability [B], token [B]): the argmax, or where rows sample
        (sampling: their state and noise [B, n]) the inverse CDF of the shaped distribution at the
        noise's column (greedy rows: the argmax still, their probabilities being one-hot)."""
        best, token = torch.softmax(logits.float(), -1).max(-1)
        if sampling is not None:
            state, noise = sampling
            token = inverse_cdf(logits_to_probs(logits, state), noise[:, column])
        return best, token

    def _sampling(self, batch: DraftBatch, rows: list[int], drafted: int,
                  num_positions: int) -> tuple[SamplingState, torch.Tensor] | None:
        """The rows' sampling state and the target's noise u [len(rows), num_positions] at their
        next output positions (num_output + drafted onwards); None where every row is greedy."""
        if not batch.params or all(batch.params[i].is_greedy for i in rows):
            return None
        state = SamplingState.from_params([batch.params[i] for i in rows], [batch.seeds[i] for i in rows],
                                          [batch.num_output[i] + drafted for i in rows], self.runner.device)
        return state, state.uniforms(num_positions)
