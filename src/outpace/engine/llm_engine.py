"""LLMEngine: continuous batching with speculative decoding. One step reads as the algorithm:
schedule, propose, verify, accept, postprocess."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from outpace.config import EngineConfig, SamplingParams
from outpace.runner.calibrate import measure_verify_cost
from outpace.runner.cuda_graphs import CudaGraphRunner
from outpace.runner.staging import to_device
from outpace.runner.model_runner import ModelRunner, Row
from outpace.sampling.sampler import SamplingState, make_generator
from outpace.engine.scheduler import PrefillChunk, Scheduler, StepPlan
from outpace.engine.sequence import Sequence, SpecStats
from outpace.engine.stopping import StopChecker
from outpace.errors import InvalidParameterError, PromptTooLongError
from outpace.kernels import cpu_linear
from outpace.weights.hub import resolve_model
from outpace.weights.loader import load_model
from outpace.weights.tokenizer import Tokenizer
from outpace.speculative.controller import DraftController
from outpace.speculative.drafter import Draft, Drafter
from outpace.speculative.factory import make_drafter
from outpace.speculative.ngram_device import DeviceDrafts, DeviceNgramDrafter, GraphDrafts
from outpace.sampling.rejection import greedy_tokens, verify_greedy, verify_sampling


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidParameterError("device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        # bfloat16 is the fastest correct choice on CUDA; on the CPU the kernels' level decides
        is_bf16_cpu = not device.startswith("cuda") and cpu_linear.prefers_bfloat16()
        return torch.bfloat16 if device.startswith("cuda") or is_bf16_cpu else torch.float32
    return getattr(torch, dtype)


@dataclass
class Launched:
    """A greedy graph step queued on the device whose tokens the host has not read yet (overlap)."""

    seqs: list[Sequence]
    room: list[int]                     # drafted tokens each row may verify (0: a plain row)
    shape: tuple[int, int, int]         # its graph shape


class LLMEngine:
    def __init__(self, config: EngineConfig, drafter: Drafter | None = None):
        self.config = config
        t0 = time.perf_counter()
        folder = resolve_model(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.tokenizer = Tokenizer.from_folder(folder)
        self.model = load_model(folder, self.dtype, self.device, config.max_model_len)
        spec = config.spec
        self.max_draft = spec.num_draft_tokens if spec.enabled or drafter is not None else 0
        self.drafter = drafter if drafter is not None else self._make_drafter(spec)
        self.runner = self._make_runner(config, spec.num_draft_tokens + 1 if spec.exact else None)
        cost = None
        if self.max_draft and config.calibrate and not spec.exact:
            # measure_verify_cost waits for the device after each forward, so host clocks time it
            cost = measure_verify_cost(self.runner, config.max_num_seqs, self.max_draft + 1)
        self.controller = DraftController(self.max_draft, cost, packed=self.runner.packs_rows)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_prefill_tokens)
        self.stats = SpecStats()
        self.sequences: dict[int, Sequence] = {}
        self.launched: Launched | None = None       # overlap: the step after the last one, on the device
        self._read_at = 0.0                         # when the host last read a graph step's tokens
        self._ids = itertools.count()
        self.load_s = time.perf_counter() - t0

    def _make_runner(self, config: EngineConfig, exact_tokens: int | None) -> ModelRunner:
        """CUDA: decode/verify steps replay captured CUDA graphs (run eagerly with cuda_graphs off)."""
        max_step_tokens = max(config.max_prefill_tokens, self.max_draft + 1)
        if not self.device.startswith("cuda"):
            return ModelRunner(self.model, config.max_num_seqs, config.max_model_len, max_step_tokens, exact_tokens)
        extension = None
        if isinstance(self.drafter, DeviceNgramDrafter):     # its drafting and greedy verification join the graphs
            extension = self.drafter.graph_step(config.max_num_seqs, max(self.max_draft + 1, exact_tokens or 0))
        return CudaGraphRunner(self.model, config.max_num_seqs, config.max_model_len,
                               max(max_step_tokens, exact_tokens or 0), exact_tokens,
                               max_decode_tokens=self.max_draft + 1, use_graphs=config.cuda_graphs,
                               extension=extension, max_prefill_tokens=config.max_prefill_tokens)

    def _make_drafter(self, spec) -> Drafter:
        """CUDA: n-gram drafting over a device token buffer, no host round trip per step."""
        if self.device.startswith("cuda") and spec.method == "ngram":
            return DeviceNgramDrafter(spec, self.config.max_num_seqs, self.config.max_model_len, self.device,
                                      use_graph=self.config.cuda_graphs)
        return make_drafter(spec)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, speculate: bool = True) -> Sequence:
        """Queue a request. speculate=False decodes it plainly (a baseline in the same engine)."""
        limit = self.config.max_model_len
        if not prompt_ids:
            raise InvalidParameterError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= limit:
            raise PromptTooLongError(f"the prompt has {len(prompt_ids)} tokens; the context holds "
                                     f"{limit} (prompt plus at least one new token): shorten it "
                                     f"or raise max_model_len")
        vocab = self.model.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidParameterError(f"prompt token ids must be in [0, {vocab})")
        seq = Sequence(next(self._ids), prompt_ids, params)
        seq.speculate = speculate and self.max_draft > 0
        seq.generator = make_generator(params.seed, self.device)
        seq.stopper = StopChecker(self.tokenizer, params, self.model.cfg.eos_token_ids, limit)
        self.sequences[seq.seq_id] = seq
        self.scheduler.add(seq)
        self.drafter.begin(seq.seq_id, prompt_ids)
        return seq

    def abort(self, seq_id: int) -> None:
        """Cancel a request: its slot is free for the next step; other requests are untouched."""
        seq = self.sequences.get(seq_id)
        if seq is not None and not seq.is_finished:
            seq.finish_reason = "abort"
            self._finish(seq)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that got new tokens or finished."""
        if self.launched is not None:
            launched, self.launched = self.launched, None
            if not all(s.is_finished for s in launched.seqs):
                return self._step_launched(launched)
        plan = self.scheduler.schedule()
        # a packing runner caches this step's prompt chunks in the decode forward itself
        joined = bool(plan.decode) and self.runner.packs_rows
        if plan.prefill and not joined:
            self.prefill(plan)
        if not plan.decode:
            return []
        t0 = time.perf_counter()
        drafts, asked = self.propose(plan.decode)
        tokens, counts, num_drafts = self.verify(plan.decode, drafts, plan.prefill if joined else [])
        if plan.prefill and joined:
            self._prefilled(plan, time.perf_counter() - t0)
        is_timed = self.controller.is_timed     # an uncalibrated controller learns nothing from times
        # a step that also prefilled says nothing about decode cost, nor one that launched its
        # successor (its time holds that launch; launched steps are timed by their period)
        if is_timed and not plan.prefill and self.launched is None:
            on_device = isinstance(drafts, (DeviceDrafts, GraphDrafts))
            widths, rows = (asked if on_device else num_drafts), len(plan.decode)
            padded = on_device or not self.runner.packs_rows
            self.controller.observe_step(rows, rows + (rows * max(widths) if padded else sum(widths)),
                                         time.perf_counter() - t0)
        t1 = time.perf_counter()
        self.accept(plan.decode, drafts, asked, num_drafts, tokens, counts)
        done = self.postprocess(plan.decode)
        if is_timed:
            self.controller.observe_tokens(sum(counts), time.perf_counter() - t1)
        return done

    def _step_launched(self, launched: Launched) -> list[Sequence]:
        """A step the previous step launched (overlap): the same rows, their drafts made in the
        graph. Rows whose sequence ended meanwhile are dropped, tokens and all."""
        live = [i for i, s in enumerate(launched.seqs) if not s.is_finished]
        seqs, room = [launched.seqs[i] for i in live], [launched.room[i] for i in live]
        read_before = self._read_at
        tokens, counts, num_drafts = self._read_back(seqs, room, launched.shape, time.perf_counter(),
                                                     may_launch=len(seqs) == len(launched.seqs))
        if self.controller.is_timed:
            # what a launched step costs is the time between two reads, the longer of the device's
            # step and the host's loop; the host's work on the tokens overlaps the device's, so it
            # adds nothing beyond that period
            rows = len(launched.seqs)
            self.controller.observe_step(rows, rows * launched.shape[1], self._read_at - read_before)
            self.controller.observe_tokens(sum(counts), 0.0)
        self.accept(seqs, [None] * len(seqs), room, num_drafts, tokens, counts)
        return self.postprocess(seqs)

    def prefill(self, plan: StepPlan) -> None:
        """A forward of prompt chunks alone (no sequence decodes, or the runner pads its rows)."""
        t0 = time.perf_counter()
        self.runner.forward(self._chunk_rows(plan.prefill), logits="none")
        self._prefilled(plan, time.perf_counter() - t0)

    @staticmethod
    def _chunk_rows(chunks: list[PrefillChunk]) -> list[Row]:
        return [Row(c.seq.slot, c.seq.token_ids[c.start:c.end], c.start) for c in chunks]

    @staticmethod
    def _prefilled(plan: StepPlan, elapsed: float) -> None:
        for c in plan.prefill:
            c.seq.num_cached = c.end
            c.seq.prefill_s += elapsed

    def _in_graph(self, seqs: list[Sequence], room: list[int]) -> bool:
        """Whether the runner's graph step can draft and verify this step itself (greedy rows, a
        captured shape)."""
        runner = self.runner
        if not isinstance(runner, CudaGraphRunner) or runner.extension is None:
            return False
        if not all(s.params.is_greedy for s in seqs):
            return False
        rows = [Row(s.slot, [0], len(s.token_ids) - 1) for s in seqs]
        return runner.shape_for(rows, max(room)) is not None

    def propose(self, seqs: list[Sequence]) -> tuple[list[Draft | None] | DeviceDrafts, list[int]]:
        """Drafts for this step and how many tokens each row asked for. A host drafter drafts
        first, at the most each row has room for, so the controller weighs the drafts that exist;
        the device drafter is told the controller's length up front (its drafts stay on the device)."""
        none: list[Draft | None] = [None] * len(seqs)
        if not self.max_draft or not any(s.speculate for s in seqs):
            return none, [0] * len(seqs)
        t0 = time.perf_counter()
        room = [0 if not s.speculate else min(self.max_draft, s.params.max_tokens - s.num_output_tokens - 1,
                    self.config.max_model_len - len(s.token_ids) - 1) for s in seqs]
        asking = [i for i, r in enumerate(room) if r > 0]
        spec_ids = [s.seq_id for s in seqs if s.speculate]
        drafts: list[Draft | None] | DeviceDrafts = none
        if isinstance(self.drafter, DeviceNgramDrafter):
            k = self.controller.num_draft(spec_ids, len(seqs))
            room = [min(r, k) for r in room]
            if self._in_graph(seqs, room):
                drafts = GraphDrafts(room)
            elif k and asking:
                drafts = self.drafter.propose_device([s.seq_id for s in seqs], room)
        else:
            ids = [seqs[i].seq_id for i in asking]
            got = self.drafter.propose(ids, [room[i] for i in asking]) if asking else []
            lengths = self.controller.draft_lengths(ids, len(seqs), [len(d) if d else 0 for d in got],
                                                    [d.match_len if d else 0 for d in got])
            # asked: what a row verifies; nothing where it drafts nothing, so its estimates relax
            # toward their priors (counting a miss there instead measured 1.44x / 1.37x against
            # 1.49x / 1.42x on Spec-Bench summarization / rag)
            room = [0] * len(seqs)
            if any(lengths):
                drafts = list(none)
                for i, d, n in zip(asking, got, lengths):
                    if n:
                        drafts[i], room[i] = d.truncated(n), n
        elapsed = time.perf_counter() - t0
        for s in seqs:
            s.stats.draft_s += elapsed / len(seqs)
        return drafts, room

    def verify(self, seqs: list[Sequence], drafts: list[Draft | None], chunks: list[PrefillChunk] = ()):
        """One target forward over [last token + draft] of every sequence (and the step's prompt
        chunks, on a packing runner), then the acceptance rule (greedy or rejection sampling) as
        batched tensor math. Returns host lists: the tokens to append, their counts and the draft
        lengths."""
        t0 = time.perf_counter()
        if isinstance(drafts, GraphDrafts):
            return self._verify_in_graph(seqs, drafts.room, t0)
        if isinstance(drafts, DeviceDrafts):
            # drafts never visit the host: the runner appends them to each row's last token
            rows = [Row(s.slot, s.token_ids[-1:], len(s.token_ids) - 1) for s in seqs]
            logits, _ = self.runner.forward(rows, draft_tokens=drafts.tokens)          # [B, S, V]
            K = logits.shape[1] - 1
            draft_tokens = F.pad(drafts.tokens, (0, K - drafts.tokens.shape[1]))       # exact mode pads S
            draft_lens = drafts.num_draft
        else:
            num_draft = [len(d) if d else 0 for d in drafts]
            rows = [Row(s.slot, s.token_ids[-1:] + (d.tokens if d else []), len(s.token_ids) - 1)
                    for s, d in zip(seqs, drafts)]
            with_chunks = {"chunks": self._chunk_rows(chunks)} if chunks else {}    # a packing runner's only
            greedy = all(s.params.is_greedy for s in seqs)
            # [B, S, V], or for greedy rows on the CPU their argmax [B, S]
            logits, _ = self.runner.forward(rows, self.runner.greedy_logits if greedy else "all", **with_chunks)
            K = logits.shape[1] - 1
            if K == 0 and greedy:
                # a plain greedy step: each row's argmax is its one token, nothing to check
                return self._plain_greedy(seqs, logits, t0)
            draft_tokens = to_device([(d.tokens if d else []) + [0] * (K - n) for d, n in zip(drafts, num_draft)],
                                     logits.device).view(len(seqs), K)
            draft_lens = to_device(num_draft, logits.device)
        if all(s.params.is_greedy for s in seqs):
            out, num_out = verify_greedy(logits, draft_tokens, draft_lens)
        else:
            state = SamplingState.from_params([s.params for s in seqs], [s.generator for s in seqs], logits.device)
            out, num_out = verify_sampling(logits, draft_tokens, draft_lens, state)
        if isinstance(self.drafter, DeviceNgramDrafter):
            # the device token buffer takes the verified tokens, queued ahead of the sync
            self.drafter.append([s.seq_id for s in seqs], out, num_out)
        # the one host synchronisation of the step: accepted tokens return to the scheduler
        host = torch.cat([num_out[:, None], draft_lens[:, None], out], dim=1).tolist()
        return self._verified(seqs, host, t0)

    def _verify_in_graph(self, seqs: list[Sequence], room: list[int], t0: float):
        """verify() when the graph drafts, verifies and appends: its result rows come back."""
        rows = [Row(s.slot, s.token_ids[-1:], len(s.token_ids) - 1) for s in seqs]
        # every speculating sequence takes its buffer row now, drafting or not: a launched step
        # cannot take one (the host lacks the tokens of the step before it)
        inputs = self.drafter.step_inputs([s.seq_id for s in seqs], room, [s.speculate for s in seqs])
        self.runner.forward(rows, step_inputs=inputs, num_device_tokens=max(room))
        return self._read_back(seqs, room, self.runner.last_shape, t0)

    def _read_back(self, seqs: list[Sequence], room: list[int], shape: tuple[int, int, int], t0: float,
                   may_launch: bool = True):
        """verify()'s return for a greedy graph step: its result rows, read with the step's one
        host synchronisation. With overlap the next step is launched first, so the device works
        on it while the host reads this one and accepts its tokens."""
        runner = self.runner
        result = runner.step_result(shape)
        runner.start_read(result)
        if may_launch and self.config.overlap:
            self.launched = self._launch_next(seqs, shape, result)
        host = runner.read_back()                       # the step's one host synchronisation
        self._read_at = time.perf_counter()
        return self._verified(seqs, [host[s.slot] for s in seqs], t0)

    def _launch_next(self, seqs: list[Sequence], shape: tuple[int, int, int], result: torch.Tensor):
        """Launch the step after a greedy graph step whose tokens are not read yet, when that step
        holds the same rows (no request waits for a free slot, no prompt is being cached) and
        every row's positions, however many tokens the step being read adds, stay in the context.
        Rows draft up to what they have room for after that many tokens."""
        scheduler, limit = self.scheduler, self.config.max_model_len
        if (scheduler.waiting and scheduler.free_slots) or len(scheduler.running) != len(seqs):
            return None
        ahead = shape[1]                                # the most tokens the step being read adds to a row
        speculating = [s.seq_id for s in seqs if s.speculate]
        drafts = bool(speculating) and isinstance(self.drafter, DeviceNgramDrafter)
        k = self.controller.num_draft(speculating, len(seqs)) if drafts else 0
        has_row = self.drafter.rows if drafts else {}     # a launched step cannot take a row
        room = [max(0, min(k, s.params.max_tokens - s.num_output_tokens - ahead - 1,
                           limit - len(s.token_ids) - ahead - 1)) if s.seq_id in has_row else 0 for s in seqs]
        rows = [Row(s.slot, [0], len(s.token_ids) - 1 + ahead) for s in seqs]     # starts, at the most
        if max(r.start for r in rows) + 1 + max(room) > limit:
            return None
        next_shape = self.runner.shape_for(rows, max(room))
        if next_shape is None or next_shape[0] != shape[0]:
            return None
        slots = {s.slot for s in seqs}
        active = to_device([int(r in slots) for r in range(shape[0])], result.device)
        inputs = self.drafter.step_inputs([s.seq_id for s in seqs], room) if drafts else None
        self.runner.replay_next(result, active, next_shape, rows, inputs)
        return Launched(seqs, room, next_shape)

    @staticmethod
    def _verified(seqs: list[Sequence], host: list[list[int]], t0: float):
        """verify()'s return from its host rows [tokens out, tokens drafted, tokens...]: the tokens
        to append, their counts and the draft lengths; the step's time is charged to its rows."""
        elapsed = time.perf_counter() - t0
        for s in seqs:
            s.stats.verify_s += elapsed / len(seqs)
        return [h[2:2 + h[0]] for h in host], [h[0] for h in host], [h[1] for h in host]

    def _plain_greedy(self, seqs: list[Sequence], logits: torch.Tensor, t0: float):
        """verify()'s result for a step without drafts whose rows are all greedy (logits [B, 1, V],
        or their argmax [B, 1]): each row's argmax (a graph step's read from the device, its
        successor launched first where it may be)."""
        on_device = isinstance(self.drafter, DeviceNgramDrafter)
        runner = self.runner
        if isinstance(runner, CudaGraphRunner) and runner.last_shape is not None and not (
                on_device and any(s.seq_id in self.drafter.rows for s in seqs)):
            return self._read_back(seqs, [0] * len(seqs), runner.last_shape, t0)
        tokens = greedy_tokens(logits)
        if on_device:
            self.drafter.append([s.seq_id for s in seqs], tokens, torch.ones_like(tokens[:, 0]))
        host = tokens.tolist()                          # the step's one host synchronisation
        return self._verified(seqs, [[1, 0, t] for (t,) in host], t0)

    def accept(self, seqs, drafts, asked, num_drafts, tokens, counts) -> None:
        now = time.perf_counter()
        # what the controller learns by match length (drafts on the device report none)
        matches = [d.match_len if d else 0 for d in drafts] if isinstance(drafts, list) else [0] * len(seqs)
        for seq, ask, num_draft, new, n, match_len in zip(seqs, asked, num_drafts, tokens, counts, matches):
            seq.stats.record(num_draft, n - 1)
            if seq.speculate:       # the controller never drafts for (nor reads) a plain sequence
                self.controller.observe(seq.seq_id, ask, num_draft, n - 1, match_len)
            # the last token and the accepted drafts are now cached; the new last token is not
            seq.num_cached = len(seq.token_ids) + n - 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            self.drafter.accept(seq.seq_id, seq.stopper.append(seq, new))

    def postprocess(self, seqs: list[Sequence]) -> list[Sequence]:
        for seq in seqs:
            if seq.finish_reason is not None and not seq.is_finished:
                self._finish(seq)
        if self.launched is not None and all(s.is_finished for s in self.launched.seqs):
            self.launched = None                        # nobody reads it; the device finishes it unread
        return seqs

    def _finish(self, seq: Sequence) -> None:
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)
        self.drafter.end(seq.seq_id)
        self.controller.end(seq.seq_id)
        self.stats.add(seq.stats)
        self.sequences.pop(seq.seq_id, None)
