"""LLMEngine: continuous batching with speculative decoding. One step reads as the algorithm:
schedule, propose, verify, accept, postprocess."""
from __future__ import annotations

import itertools
import sys
import time
from functools import partial

import torch

from outpace.config import EngineConfig, SamplingParams
from outpace.engine.graph_step import GraphStep
from outpace.engine.scheduler import PrefillChunk, Scheduler, StepPlan
from outpace.engine.sequence import Sequence, SpecStats
from outpace.engine.step import EagerStep, Proposal, StepResult, chunk_rows
from outpace.engine.stopping import StopChecker
from outpace.errors import InvalidParameterError, PromptTooLongError
from outpace.kernels import cpu_linear
from outpace.model.recurrent_rows import has_triton
from outpace.runner.calibrate import measure_verify_cost
from outpace.runner.cuda_graphs import CudaGraphRunner
from outpace.runner.model_runner import ModelRunner
from outpace.runner.parallel import ParallelRunner
from outpace.runner.state_cache import free_memory, state_bytes
from outpace.runner.workers import start_workers
from outpace.sampling.logprobs import StepLogprobs
from outpace.sampling.sampler import request_seed
from outpace.speculative.controller import DraftController
from outpace.speculative.drafter import DraftContext, Drafter, Prefilled
from outpace.speculative.factory import make_drafter
from outpace.weights.hub import resolve_model
from outpace.weights.loader import load_model
from outpace.weights.tokenizer import Tokenizer


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


# the most of a device's memory left after loading that a hybrid model's state snapshots may take
SNAPSHOT_MEMORY_SHARE = 0.25


class LLMEngine:
    def __init__(self, config: EngineConfig, drafter: Drafter | None = None):
        self.workers = None
        try:
            self._build(config, drafter)
        except BaseException:       # tensor-parallel workers started already stop with it
            self.close()
            raise

    def _build(self, config: EngineConfig, drafter: Drafter | None) -> None:
        self.config = config
        t0 = time.perf_counter()
        folder = resolve_model(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.tokenizer = Tokenizer.from_folder(folder)
        # tensor parallelism: this process is rank 0 and drives ranks 1..N-1 (runner/parallel.py)
        tp = config.tensor_parallel_size
        self.workers = start_workers(folder, self.dtype, self.device, config.max_model_len, tp) if tp > 1 else None
        self.model = load_model(folder, self.dtype, self.device, config.max_model_len,
                                self.workers.shard if self.workers else None, config.weights)
        # the CUDA graph runner on a GPU; a recurrent model's steps need the Triton kernels there
        self.uses_graphs = self.device.startswith("cuda") and (not self.model.is_recurrent or has_triton())
        spec = config.spec
        if self.uses_graphs and spec.method == "ngram" and spec.tree_width > 1:
            print(f"outpace: n-gram token trees (tree width {spec.tree_width}) are drafted and verified outside the "
                  "CUDA graphs, which on a GPU measured slower than plain decoding (docs/BENCHMARKS.md, \"GPU: "
                  "EAGLE-3 head\"): --tree-width 1 drafts chains in the graphs", file=sys.stderr)
        num_draft_tokens = spec.num_draft_tokens if spec.enabled or drafter is not None else 0
        self.num_draft_tokens = num_draft_tokens
        exact_width = spec.num_draft_tokens + 1 if spec.exact else None     # exact mode's one width
        self.max_step_tokens = max(config.max_prefill_tokens, num_draft_tokens + 1, exact_width or 0)
        self.drafter = drafter if drafter is not None else make_drafter(
            spec, config.model, self.device, config.max_num_seqs, config.max_model_len, config.cuda_graphs)
        # bound first: a head learns the layers it reads when it loads, and the runner's graphs write them
        self.drafter.bind(DraftContext(config.max_num_seqs, config.max_model_len, num_draft_tokens + 1,
                                       next(self.model.parameters()).device, self.dtype, self.model,
                                       self.tokenizer, self._draft_runner, config.weights,
                                       graphs=self.uses_graphs and config.cuda_graphs, prefix_key=self._prefix_key,
                                       salt=lambda seq_id: self.sequences[seq_id].cache_salt))
        self.snapshots = self._snapshots(config, max(num_draft_tokens + 1, exact_width or 1))
        self.runner = self._make_runner(config, num_draft_tokens, exact_width)
        cost = None
        if num_draft_tokens and config.calibrate and not spec.exact:
            # measure_verify_cost waits for the device after each forward, so host clocks time it
            cost = measure_verify_cost(self.runner, config.max_num_seqs, num_draft_tokens)
        # a head's trees draft inside the graphs and its chains would not: trees every step, sized by depth
        self.controller = DraftController(num_draft_tokens, cost, packed=self.runner.packs_rows,
                                          draft_cost=self.drafter.cost_per_token,
                                          draft_step_cost=self.drafter.step_cost, tree_width=spec.tree_width,
                                          tree_depth=getattr(getattr(self.runner, "extension", None), "tree_depth",
                                                             None))
        # prefix sharing copies within one process's cache: not where tensor-parallel ranks hold theirs
        self.scheduler = Scheduler(config.max_num_seqs, config.max_prefill_tokens, low_slots_first=self.uses_graphs,
                                   reuse_bound=self._reuse_bound,
                                   share_bound=self._share_bound if self.workers is None else None)
        parts = (self.drafter, self.controller, config.max_model_len, num_draft_tokens)
        # under tensor parallelism graph steps neither draft in the graph nor overlap (yet): EagerStep
        self.steps = (GraphStep(self.runner, *parts, scheduler=self.scheduler, overlap=config.overlap)
                      if self.uses_graphs and self.workers is None else EagerStep(self.runner, *parts))
        self.stats = SpecStats()
        self.sequences: dict[int, Sequence] = {}
        self._ids = itertools.count()
        self.load_s = time.perf_counter() - t0

    def _snapshots(self, config: EngineConfig, max_row_tokens: int) -> bool:
        """Whether a hybrid model rolls verify rows back from a state snapshot per token (else a
        checkpoint and replay): config.recurrent_snapshots where set; by default snapshots, unless
        their states would take more than SNAPSHOT_MEMORY_SHARE of what the device has left once
        the model is loaded (the key/value cache is still to come), then replay, said on stderr."""
        if config.recurrent_snapshots is not None or not self.model.is_recurrent:
            return config.recurrent_snapshots is not False
        shapes, slots = self.model.state_shapes(), config.max_num_seqs
        snapshots, replay = (state_bytes(shapes, slots, max_row_tokens, mode, self.dtype) for mode in (True, False))
        free = free_memory(next(self.model.parameters()).device)
        if free is None or snapshots <= SNAPSHOT_MEMORY_SHARE * free:
            return True
        print(f"outpace: recurrent state snapshots for {slots} sequences of up to {max_row_tokens} verified tokens "
              f"would take {snapshots / 2**30:.2f} GiB of the {free / 2**30:.2f} GiB left; rolling back by replay "
              f"({replay / 2**30:.2f} GiB, each step reruns the accepted tokens' state updates). Fewer --max-num-seqs "
              f"or --num-draft-tokens keep snapshots; --recurrent-rollback snapshots insists", file=sys.stderr)
        return False

    def _make_runner(self, config: EngineConfig, num_draft_tokens: int, exact_width: int | None) -> ModelRunner:
        """CUDA: decode/verify steps replay captured CUDA graphs (run eagerly with cuda_graphs
        off), which draft and verify themselves where the drafter has a graph step (not under
        tensor parallelism, where every rank builds its runner as rank 0 does: ParallelRunner),
        and return the hidden states the drafter reads."""
        max_step_tokens = self.max_step_tokens
        if not self.uses_graphs:
            make = partial(ModelRunner, num_slots=config.max_num_seqs, max_len=config.max_model_len,
                           max_step_tokens=max_step_tokens, exact_width=exact_width,
                           max_verify_tokens=num_draft_tokens + 1, snapshots=self.snapshots)
        else:
            # no in-graph drafting for a recurrent model: its graph would verify without the commit
            # that rolls the state back
            extension = None if self.workers or self.model.is_recurrent else self.drafter.graph_step(
                config.max_num_seqs, max(num_draft_tokens + 1, exact_width or 0))
            make = partial(CudaGraphRunner, num_slots=config.max_num_seqs, max_len=config.max_model_len,
                           max_step_tokens=max_step_tokens, exact_width=exact_width,
                           num_draft_tokens=num_draft_tokens, use_graphs=config.cuda_graphs,
                           extension=extension, max_prefill_tokens=config.max_prefill_tokens,
                           hidden_layers=self.drafter.hidden_layers, snapshots=self.snapshots)
        return make(self.model) if self.workers is None else ParallelRunner(make, self.model, self.workers)

    def _draft_runner(self, model) -> ModelRunner:
        """A runner for a drafter's own model, beside the target's: the same slots and context,
        rows of up to 1 + num_draft_tokens tokens (a draft model catching up on the tokens it has
        not seen, then a token a row); CUDA graphs on a GPU. Called while the drafter is bound,
        before the target's runner exists; its cache is as long as the target's will be."""
        config = self.config
        spare = self.max_step_tokens        # the target's spare positions (a graph runner rounds both alike)
        if not self.device.startswith("cuda") or model.is_recurrent:
            return ModelRunner(model, config.max_num_seqs, config.max_model_len, spare)
        return CudaGraphRunner(model, config.max_num_seqs, config.max_model_len, spare,
                               num_draft_tokens=self.num_draft_tokens, use_graphs=config.cuda_graphs, progress=False)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device); also done at exit."""
        if self.workers is not None:
            self.workers.close()

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, speculate: bool = True,
                    cache_salt: str = "") -> Sequence:
        """Queue a request. speculate=False decodes it plainly (a baseline in the same engine).
        cache_salt: the request reuses only prefixes kept from requests of the same salt."""
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
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidParameterError(f"logit_bias names token {max(params.logit_bias)}; this model's token ids "
                                        f"are in [0, {vocab})", "logit_bias")
        seq = Sequence(next(self._ids), prompt_ids, params)
        seq.speculate = speculate and self.num_draft_tokens > 0
        seq.cache_salt = cache_salt
        # prompt logprobs are read from the prompt's own forwards: none of it may come from the cache
        seq.reuse_prefix = self._reuses_prefix(seq) and params.prompt_logprobs is None
        seq.seed = request_seed(params)
        seq.stopper = StopChecker(self.tokenizer, params, self.model.cfg.eos_token_ids, limit)
        self.sequences[seq.seq_id] = seq
        self.scheduler.add(seq)
        self.drafter.begin(seq.seq_id, prompt_ids)
        return seq

    def _reuses_prefix(self, seq: Sequence) -> bool:
        """Whether seq may start from a freed slot's kept prefix (scheduler.py): with prefix
        caching on, not for a recurrent model (its state holds the whole sequence, not a prefix)."""
        return self.config.prefix_caching and not self.model.is_recurrent

    def _reuse_bound(self, seq: Sequence, slot: int) -> int | None:
        """A speculating sequence reuses no more of a slot's kept prefix than its drafter's own
        cache there holds for it (Drafter.reusable_prefix)."""
        return self.drafter.reusable_prefix(seq.seq_id, slot) if seq.speculate else None

    def _share_bound(self, source: Sequence, seq: Sequence) -> int | None:
        """A speculating sequence takes no more of a running sequence's prefix than its drafter's
        own cache holds for that sequence (Drafter.shareable_prefix)."""
        return self.drafter.shareable_prefix(source.seq_id, seq.seq_id) if seq.speculate else None

    def _copy_prefixes(self, copies: list[tuple[Sequence, Sequence, int]]) -> None:
        """Prefix sharing (scheduler.py): each placed sequence's first n entries copied from its
        running source's slot, the target's and a speculating sequence's drafter's own, in the
        plan's order (a source placed by an earlier copy of the same step has its entries by then)."""
        for source, seq, n in copies:
            self.runner.copy_prefix(source.slot, seq.slot, n)
            if seq.speculate:
                self.drafter.copy_prefix(source.seq_id, source.slot, seq.seq_id, seq.slot, n)

    def _prefix_key(self, seq_id: int) -> str | None:
        seq = self.sequences[seq_id]
        return seq.cache_salt if seq.reuse_prefix else None

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
        plan = self.steps.resume() or self.scheduler.schedule()
        self._copy_prefixes(plan.copies)
        # a packing runner caches this step's prompt chunks in the verify forward itself (unless
        # the drafter asks for their hidden states, or a chunk's request for its logprobs)
        joined = plan.prefill if (plan.decode and self.runner.packs_rows and not self.drafter.hidden_layers
                                  and not any(c.seq.prompt_logprobs is not None for c in plan.prefill)) else []
        if plan.prefill and not joined:
            self.prefill(plan)
        if not plan.decode:
            return []
        t0 = time.perf_counter()
        proposal = self.steps.propose(plan)
        result = self.steps.verify(plan, proposal, joined)
        if joined:
            self._prefilled(plan, None, time.perf_counter() - t0)
        t1 = time.perf_counter()
        launched_next = self.steps.launched is not None
        self.accept(plan.decode, proposal, result)
        done = self.postprocess(plan.decode)
        self.observe_step(plan, result, proposal, t1 - t0, time.perf_counter() - t1, launched_next)
        return done

    def prefill(self, plan: StepPlan) -> None:
        """A forward of prompt chunks alone (no sequence decodes, or the runner pads its rows),
        with their logits where a chunk's request asks for its prompt's logprobs."""
        t0 = time.perf_counter()
        chunks = plan.prefill
        scored = [i for i, c in enumerate(chunks) if c.seq.prompt_logprobs is not None]
        logits, hidden = self.runner.forward(chunk_rows(chunks), logits="all" if scored else "none",
                                             hidden_layers=self.drafter.hidden_layers)
        if scored:
            self._prompt_logprobs([chunks[i] for i in scored], logits[scored])
        self._prefilled(plan, hidden, time.perf_counter() - t0)

    @staticmethod
    def _prompt_logprobs(chunks: list[PrefillChunk], logits: torch.Tensor) -> None:
        """Each chunk's prompt logprobs (logits [chunks, S, V]): position j's logits score the
        prompt token after it, the chunk's end included (a chunk ends before the prompt's last
        token, whose forward is the first decode step)."""
        nexts = [c.seq.token_ids[c.start + 1:c.end + 1] for c in chunks]
        tokens = torch.tensor([t + [0] * (logits.shape[1] - len(t)) for t in nexts], device=logits.device)
        scores = StepLogprobs(list(range(len(chunks))), [c.seq.params.prompt_logprobs for c in chunks], logits, tokens)
        for c, entries in zip(chunks, scores.host(nexts)):
            c.seq.prompt_logprobs += entries

    def _prefilled(self, plan: StepPlan, hidden, elapsed: float) -> None:
        chunks = plan.prefill
        for c in chunks:
            c.seq.num_cached = c.end
            c.seq.prefill_s += elapsed
        # a plain request (speculate=False: a baseline in the same engine) costs a drafter with a
        # cache of its own nothing: that drafter never drafts for it
        mine = [i for i, c in enumerate(chunks) if c.seq.speculate]
        if not mine:
            return
        if len(mine) < len(chunks):
            chunks, hidden = [chunks[i] for i in mine], None if hidden is None else hidden[mine]
        # a sequence's first chunk: whether its drafting is expected to repay the drafter's setup
        # for its prompt at the present load, the sequences running (StepPlan.load; the later
        # chunks follow it: the drafter caches a chunk only after the one before it)
        setup = self.drafter.setup_seconds([c.seq.seq_id for c in chunks])
        defer = None if setup is None else [
            c.start == c.seq.num_reused and not self.controller.pays_setup(seconds, c.seq.params.max_tokens, plan.load, c.seq.seq_id)
            for c, seconds in zip(chunks, setup)]
        self.drafter.prefilled(Prefilled([c.seq.seq_id for c in chunks], [c.seq.slot for c in chunks],
                                         [c.start for c in chunks], [c.seq.token_ids[c.start:c.end] for c in chunks],
                                         hidden, defer))

    def observe_step(self, plan: StepPlan, result: StepResult, proposal: Proposal, elapsed: float, host: float,
                     launched_next: bool) -> None:
        """What the step cost, for the controller's fit (an uncalibrated controller learns nothing
        from times), its proposal's paid tokens priced by the drafter: `elapsed` seconds to its
        tokens, then `host` seconds accepting them. A launched step is timed by the period between
        two reads, host work and all; a step that also cached prompt chunks says nothing about
        decode cost, nor one that launched its successor (its time holds that launch).
        Where steps are launched ahead, a step that is not (one drafted outside the graph, or the
        one before it) leaves the device idle while the host accepts its tokens, which a launched
        step hides: that host work is its own cost. Elsewhere the host's work is a cost per token
        that every step pays alike (observe_tokens). A drafting step's tokens over its seconds,
        host work included, weigh its shape, trees or chains (observe_shape)."""
        if not self.controller.is_timed:
            return
        overlap = self.steps.overlap
        if result.period is not None:
            self.controller.observe_step(result.step_rows, result.step_tokens, result.period, proposal.paid_tokens,
                                         proposal.draft_s)
        elif not plan.prefill and not launched_next:
            seconds = elapsed + (host if overlap else 0.0)
            self.controller.observe_step(result.step_rows, result.step_tokens, seconds, proposal.paid_tokens,
                                         proposal.draft_s)
            if any(proposal.budget):        # trees against chains: what a drafting step yields a second
                self.controller.observe_shape(result.step_rows, proposal.tree_width, sum(result.counts),
                                              elapsed + host)
        self.controller.observe_tokens(sum(result.counts), 0.0 if result.period is not None or overlap else host)

    def accept(self, seqs: list[Sequence], proposal: Proposal, result: StepResult) -> None:
        """Append each row's verified tokens (up to a stop) and tell the controller and drafter."""
        now = time.perf_counter()
        logprobs = result.logprobs or [None] * len(seqs)
        for seq, budget, num_draft, new, match_len, scores in zip(seqs, proposal.budget, result.num_draft,
                                                                  result.tokens, proposal.match_len, logprobs):
            seq.stats.record(num_draft, len(new) - 1)
            if seq.speculate:       # the controller never drafts for (nor reads) a plain sequence
                self.controller.observe(seq.seq_id, budget, num_draft, len(new) - 1, match_len)
            # the last token and the accepted drafts are now cached; the new last token is not
            seq.num_cached = len(seq.token_ids) + len(new) - 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            appended = seq.stopper.append(seq, new)
            if seq.logprobs is not None:
                seq.logprobs += scores[:len(appended)]
            self.drafter.accept(seq.seq_id, appended)

    def postprocess(self, seqs: list[Sequence]) -> list[Sequence]:
        for seq in seqs:
            if seq.finish_reason is not None and not seq.is_finished:
                self._finish(seq)
        self.steps.drop_launched()
        return seqs

    def _finish(self, seq: Sequence) -> None:
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)
        self.drafter.end(seq.seq_id)
        self.controller.end(seq.seq_id, seq.num_output_tokens if seq.finish_reason != "abort" else 0,
                            cut=seq.finish_reason == "length")
        self.stats.add(seq.stats)
        self.sequences.pop(seq.seq_id, None)
