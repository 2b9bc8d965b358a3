"""HeadGraphs: a head drafter's catch-up and chain drafting as CUDA graphs (head_drafter.py).

Run eagerly, each forward of a one-layer head is some thirty launches from the host, with an
attention over a key length that changes every step; on a GPU that cost more than the target's
whole graph step, and a head that merely caught up left plain decoding at a third of its speed.
Here the head's two jobs of every step replay graphs captured once per batch bucket:

  catch-up (b, S): the verified rows' S pairs (the target's hidden states there and the tokens
    after them) written to the head's cache; each row's stored output taken at its last accepted
    pair;
  draft (b, K): a chain of K tokens: the stored output's argmax, then K - 1 forwards, each fed
    the one before's output and token.

Graph row r is slot r, as in the target's graphs (runner/cuda_graphs.py). A slot without a row in
the step is inactive: it writes its entries in the spare region past max_len, attends to key 0
alone and keeps its stored output. A query attends to keys j <= its position (decode_attention
reads no key past its row's last, so the graph's static key length, the whole cache, costs
nothing); off CUDA, and for a dtype or head size the kernel does not take, the same bodies run
through a mask over the whole cache (the tests run them so on the CPU).

Inputs: starts, active and num_draft per graph row come from the host in one copy; the verified
tokens, hidden states and last accepted pairs are copied on the device from the step's result.
Token trees (tree_width > 1) of greedy rows draft inside the target's graph step (tree,
HeadTreeGraphStep), sampled rows' eagerly; their catch-up replays these graphs all the same.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import sys
import time

import torch
from tqdm import tqdm

from outpace.kernels import fused
from outpace.kernels.fused import cuda_compiled
from outpace.model.draft_head import attend
from outpace.runner.calibrate import batch_buckets
from outpace.runner.staging import HostSide, slot_rows
from outpace.sampling.rejection import verify_greedy
from outpace.sampling.tree import tree_ancestors, verify_tree_paths
from outpace.speculative.drafter import DraftBatch, Drafts, Verified


HOST_SIDES = 4


class HeadGraphs:
    def __init__(self, drafter, num_slots: int, spare: int, max_verify: int, max_draft: int, chains: bool,
                 progress: bool = True):
        """drafter: the bound HeadDrafter (its head, caches and stored outputs); spare: the first
        position past every real one (max_len), where inactive rows write; max_verify: the most
        pairs a catch-up holds (1 + num_draft_tokens); max_draft: the longest chain; chains:
        whether propose drafts through graphs (tree_width 1)."""
        self.drafter = d = drafter
        cfg = d.head.cfg
        self.buckets = batch_buckets(num_slots)
        R, device = self.buckets[-1], d.device
        self.inputs = torch.zeros(3 * R, dtype=torch.long, device=device)      # [starts | active | num_draft]
        self.starts, self.active, self.num_draft = self.inputs[:R], self.inputs[R:2 * R], self.inputs[2 * R:]
        # host sides in turn: a copy queued behind a step launched ahead is waited for only
        # HOST_SIDES copies later (HostSide waits for its last copy before a write)
        self.hosts = [HostSide(self.inputs) for _ in range(HOST_SIDES)]
        self._turn = 0
        self.last = torch.zeros(R, dtype=torch.long, device=device)           # each row's last accepted pair
        self.tokens = torch.zeros(R, max_verify, dtype=torch.long, device=device)
        self.hidden = torch.zeros(R, max_verify, len(cfg.target_layers), cfg.target_hidden_size,
                                  dtype=d.last_out.dtype, device=device)
        self.drafts = torch.zeros(R, max(max_draft, 1), dtype=torch.long, device=device)
        self.rows = torch.arange(R, device=device)
        self._arange = torch.arange(max(max_verify, max_draft), device=device)
        self.keys = torch.arange(d.cache_len, device=device)
        self.spare_positions = spare + self._arange
        self.spare = spare
        self.catch_up_shapes = [(b, s) for b in self.buckets for s in range(1, max_verify + 1)]
        self.draft_shapes = [(b, k) for b in self.buckets for k in range(1, max_draft + 1)] if chains else []
        self.graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}
        self.use_graphs = device.type == "cuda"
        if self.use_graphs:
            self.capture(progress)

    # ---- the bodies ---------------------------------------------------------------------------
    def _forward(self, feature, tokens, positions, active) -> torch.Tensor:
        """Pairs of graph rows [0, b) at positions [b, S] (active [b, 1]: whether the row is
        real): their entries written, their outputs [b, S, H] returned."""
        d = self.drafter
        b, S = tokens.shape
        write, seen = _write_and_seen(positions, active, self.spare_positions[:S])
        residual, q = d.project_store(feature, tokens, self.rows[:b], write, write)
        cfg = d.head.cfg
        if fused.graph_attention(q.dtype, cfg.head_dim, q.device, cfg.num_heads // cfg.num_kv_heads * S):
            out = fused.decode_attention(q.transpose(1, 2), d.k_cache, d.v_cache, seen, d.cache_len, 0, None)
        else:
            mask = self.keys[None, None, None, :] <= seen[:, None, :, None]         # [b, 1, S, L]
            out = attend(q, d.k_cache[:b], d.v_cache[:b], mask)
        return d.head.finish(residual, out)

    def _catch_up(self, b: int, S: int) -> None:
        d = self.drafter
        active = self.active[:b, None].bool()
        positions = self.starts[:b, None] + self._arange[:S]
        out = self._forward(d.head.features(self.hidden[:b, :S]), self.tokens[:b, :S], positions, active)
        # an inactive row's last pair is stale, perhaps past this graph's S: clamped, and unused
        last = out[self.rows[:b], self.last[:b].clamp(max=S - 1)]
        d.last_out[:b] = torch.where(active, last, d.last_out[:b])

    def _draft(self, b: int, K: int) -> None:
        self.chain(b, K, self.starts[:b], self.active[:b, None].bool(), self.drafts[:b])

    def chain(self, b: int, K: int, starts: torch.Tensor, active: torch.Tensor, drafts: torch.Tensor,
              rooms: torch.Tensor | None = None) -> None:
        """Chains of K tokens into drafts [b, >= K] for graph rows [0, b) whose last tokens sit at
        starts [b] (active [b, 1]: a real row), from their stored outputs. rooms [b]: the tokens
        each row verifies, where they vary by row: a graph being captured then drafts a depth only
        where an active row's room reaches it (fused.only_if); past its room a row's drafts are
        unused, and stale where a depth did not run."""
        head = self.drafter.head
        out = self.drafter.last_out[:b, None]                                       # [b, 1, H]
        for depth in range(K):
            needed = None if rooms is None else lambda d=depth: (active[:, 0] & (rooms > d)).any()
            with fused.only_if(needed):
                if depth:       # the token drafted last, at the position after the one before it
                    out = self._forward(out, drafts[:, depth - 1:depth], starts[:, None] + depth - 1, active)
                # the greedy draft: its argmax and the map to target ids one kernel inside graphs
                drafts[:, depth] = _argmax_to_target(head.logits(out[:, 0], wide=False), head.d2t)

    def tree(self, b: int, N: int, k: int, starts: torch.Tensor, active: torch.Tensor, rooms: torch.Tensor):
        """Token trees of N nodes and width k for graph rows [0, b) whose last tokens sit at starts
        [b] (active [b, 1]: a real row that drafts), as HeadDrafter._candidates drafts them eagerly,
        at static shapes: the frontier's k best nodes by cumulative log-probability fed a depth at
        a time, each node's entry at its own place past the row's start (the spare region's for a
        row not active), attending to the row's entries before its start, its ancestors' and its
        own; then the N best candidates in creation order. A row keeps its best rooms [b] of them
        (a child never scores above its parent, and ties keep the parent first, so they form a
        tree). Returns tokens (the target's ids), parents (-1: the root's children), depths (1
        below the root) and whether each is a node of the row's tree, each [b, N], and the trees'
        depth."""
        d = self.drafter
        head = d.head
        device = starts.device
        depth = frontier_depth(N, k)
        T = max((depth - 1) * k, 1)                                 # entries past each row's start
        wide = torch.arange(k, device=device)
        out = d.last_out[:b]                                                                # [b, H]
        score, ids = torch.log_softmax(head.logits(out), -1).topk(k)                        # [b, k]
        frontier = wide.expand(b, k)                                                        # candidate indices
        feature = out[:, None].expand(b, k, out.shape[-1])
        tokens, scores, parents = [head.to_target(ids)], [score], [torch.full_like(frontier, -1)]
        fed = tokens[0]
        seen = torch.zeros(b, k, T, dtype=torch.bool, device=device)                       # ancestors' entries
        cfg = head.cfg
        kernel = fused.graph_tree_attention(d.last_out.dtype, cfg.head_dim, device,
                                            cfg.num_heads // cfg.num_kv_heads * k)
        for level in range(1, depth):
            own = (level - 1) * k + wide                                                    # the frontier's entries
            seen[:, :, own] |= torch.eye(k, dtype=torch.bool, device=device)
            write = torch.where(active, starts[:, None] + own, self.spare + own)
            residual, q = d.project_store(feature, fed, self.rows[:b], (starts[:, None] + level - 1).expand(b, k), write)
            # a row not active writes in the spare region and attends to key 0 alone
            if kernel:      # keys before the start, then the entries whose bits are set
                last = torch.where(active, starts[:, None] - 1, 0).expand(b, k)
                words = torch.where(active, fused.tree_words(seen), 0)
                out = fused.decode_attention(q.transpose(1, 2), d.k_cache, d.v_cache, last, d.cache_len, 0, None,
                                             words)
            else:
                mask = torch.where(active[:, :, None], frontier_mask(seen, self.keys[None, :] - starts[:, None]),
                                   self.keys == 0)
                out = attend(q, d.k_cache[:b], d.v_cache[:b], mask[:, None])
            out = head.finish(residual, out)                                                # [b, k, H]
            score, frontier, fed, feature, seen = grow_frontier(head, out, score, frontier, tokens, scores,
                                                                parents, seen)
        levels = torch.cat([torch.full((t.shape[1],), i + 1, device=device) for i, t in enumerate(tokens)])
        tokens, scores, parents = torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1)   # [b, C]
        best = torch.sort(-scores, dim=1, stable=True).indices[:, :N]                       # ties: parents first
        chosen = best.sort(dim=1).values                                                    # creation order
        rank = torch.full_like(scores, N, dtype=torch.long).scatter_(1, best, self._arange[:N].expand(b, N))
        node = torch.full_like(rank, -1).scatter_(1, chosen, self._arange[:N].expand(b, N))
        parent = parents.gather(1, chosen)
        parent = torch.where(parent < 0, -1, node.gather(1, parent.clamp(min=0)))
        is_node = active & (rank.gather(1, chosen) < rooms[:, None])
        return tokens.gather(1, chosen), parent, levels.expand(b, -1).gather(1, chosen), is_node, depth

    def _run(self, kind: str, b: int, n: int) -> None:
        graph = self.graphs.get((kind, b, n))
        if graph is not None:
            graph.replay()
            return
        with torch.inference_mode():
            (self._catch_up if kind == "catch_up" else self._draft)(b, n)

    # ---- a step -------------------------------------------------------------------------------
    def _bucket(self, slots: list[int]) -> int:
        return self.buckets[bisect.bisect_right(self.buckets, max(slots))]

    def _send(self, slots: list[int], starts: list[int], num_draft: list[int] | None = None) -> None:
        """The graph rows' starts and active flags (and drafts' lengths) in one copy. A catch-up
        leaves the lengths alone: the step's host read, queued after it, still reads them."""
        R = len(self.rows)
        end = 3 * R if num_draft is not None else 2 * R
        self._turn = (self._turn + 1) % len(self.hosts)
        side = self.hosts[self._turn]
        host = side.writable()
        host[:end] = 0
        for i, (slot, start) in enumerate(zip(slots, starts)):
            host[slot], host[R + slot] = start, 1
            if num_draft is not None:
                host[2 * R + slot] = num_draft[i]
        side.send(0, end)

    def catch_up(self, result: Verified) -> bool:
        """The step's verified pairs through the catch-up graph; False where no graph holds them."""
        batch, S = result.batch, result.out_tokens.shape[1]
        if S > self.tokens.shape[1]:
            return False
        self._send(batch.slots, batch.positions)
        index = slot_rows(batch.slots, self.rows.device)
        self.tokens[index, :S] = result.out_tokens
        self.last[index] = result.num_out - 1
        self.hidden[index, :S] = result.hidden[:, :S]
        self._run("catch_up", self._bucket(batch.slots), S)
        return True

    def propose(self, batch: DraftBatch, rows: list[int]) -> Drafts:
        """Chains for batch rows `rows` (each drafts its budget), through the draft graph; the
        drafts and their lengths stay on the device until the step's synchronisation."""
        slots = [batch.slots[i] for i in rows]
        budget = [batch.budget[i] for i in rows]
        self._send(slots, [batch.positions[i] for i in rows], budget)
        self._run("draft", self._bucket(slots), max(budget))
        index = slot_rows(batch.slots, self.rows.device)
        return Drafts(self.drafts[index, :max(budget)], self.num_draft[index])

    # ---- capture and prices -------------------------------------------------------------------
    def capture(self, progress: bool) -> None:
        """Every shape, largest first so that smaller graphs reuse the pool; every row inactive, so
        the warm-up and capture write the spare region alone."""
        shapes = [("draft", *s) for s in reversed(self.draft_shapes)]
        shapes += [("catch_up", *s) for s in reversed(self.catch_up_shapes)]
        device = self.rows.device
        torch.cuda.synchronize(device)
        started, pool = time.perf_counter(), torch.cuda.graph_pool_handle()
        self.inputs.zero_()
        with torch.inference_mode(), fused.for_graphs():
            for shape in tqdm(shapes, desc="outpace: capturing the head's CUDA graphs", unit="graph",
                              file=sys.stderr, disable=None if progress else True):
                body = self._catch_up if shape[0] == "catch_up" else self._draft
                body(*shape[1:])                        # warm-up: kernels chosen and compiled eagerly
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    body(*shape[1:])
                self.graphs[shape] = graph
        torch.cuda.synchronize(device)
        if progress:
            print(f"outpace: captured {len(self.graphs)} CUDA graphs of the head in "
                  f"{time.perf_counter() - started:.1f} s", file=sys.stderr)

    def measure(self) -> dict[int, float]:
        """Seconds per drafted token by batch bucket: a chain's forwards past its first token (a
        depth of b rows costs one forward and its logits), over b rows. Every row inactive."""
        K = max(k for _, k in self.draft_shapes)
        self.inputs.zero_()
        per_token = {}
        for b in self.buckets:
            times = []
            for k in sorted({1, K}):
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    self._run("draft", b, k)
                    if self.use_graphs:
                        torch.cuda.synchronize(self.rows.device)
                    best = min(best, time.perf_counter() - t0)
                times.append(best)
            # a depth's cost; where timing noise hides it, the chain's mean
            depth = times[-1] - times[0] if K > 1 and times[-1] > times[0] else times[-1] / K
            per_token[b] = depth / b
        return per_token


def frontier_depth(nodes: int, width: int) -> int:
    """How deep a head's tree of `nodes` nodes and `width` candidates a node is drafted: a depth
    for each frontier of `width` nodes, and one for their children."""
    return nodes if width == 1 else min(nodes, math.ceil(nodes / width) + 1)


def frontier_mask(seen: torch.Tensor, place: torch.Tensor) -> torch.Tensor:
    """The keys [R, k, L] a head's tree frontier attends to: its row's entries before the row's
    start (place [R, L]: each key's position less the start, negative there) and the tree's
    entries past it that seen [R, k, T] marks (each node's ancestors' and its own)."""
    R, k, T = seen.shape
    inside = (place >= 0) & (place < T)
    return (place < 0)[:, None, :] | (seen.gather(2, place.clamp(0, T - 1)[:, None, :].expand(R, k, -1))
                                      & inside[:, None, :])


def grow_frontier(head, out: torch.Tensor, score: torch.Tensor, frontier: torch.Tensor, tokens: list, scores: list,
                  parents: list, seen: torch.Tensor):
    """One depth of a head's token trees (HeadDrafter._candidates, HeadGraphs.tree): the k frontier
    nodes' outputs out [R, k, H] give each node's k best children, appended as candidates to
    tokens (the target's ids), scores (cumulative log-probabilities; score [R, k]: the frontier's)
    and parents (frontier [R, k]: the frontier's candidate indices); the k best children are the
    next frontier. Returns its scores, candidate indices, tokens, features (their parents'
    outputs) and ancestors' entries (seen [R, k, T], the parents')."""
    R, k = score.shape
    child_score, child_ids = torch.log_softmax(head.logits(out), -1).topk(k)               # [R, k, k]
    child_score = (score[:, :, None] + child_score).flatten(1)                            # [R, k * k]
    first = sum(t.shape[1] for t in tokens)
    tokens.append(head.to_target(child_ids.flatten(1)))
    scores.append(child_score)
    parents.append(frontier[:, :, None].expand(R, k, k).flatten(1))
    score, pick = child_score.topk(k)
    parent = pick[:, :, None] // k
    return (score, first + pick, tokens[-1].gather(1, pick), out.gather(1, parent.expand(R, k, out.shape[-1])),
            seen.gather(1, parent.expand(R, k, seen.shape[-1])))


@cuda_compiled
def _write_and_seen(positions: torch.Tensor, active: torch.Tensor, spare: torch.Tensor):
    """Where graph rows' pairs at positions [b, S] write their entries (the spare region's [S]
    for a row not active) and the last key each of their queries sees (key 0 for such a row)."""
    return torch.where(active, positions, spare), torch.where(active, positions, 0)


@cuda_compiled
def _argmax_to_target(logits: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """The draft ids' argmax over the last dim, as target ids (DraftHead.to_target)."""
    ids = logits.argmax(-1)
    return ids + d2t[ids]


class HeadGraphStep:
    """The head's part of the target's captured step (CudaGraphRunner's extension), for greedy
    rows: before the forward, graph rows with room r > 0 (of t - 1 drafts at most) draft a chain
    of t - 1 tokens from their stored outputs into input tokens 1..t-1 (HeadGraphs.chain; r of
    them are verified); after it, greedy verification writes result[r] = [tokens out, tokens
    drafted, target tokens]. A step the head drafts for can then be launched before the host has
    read the one before it (GraphStep's overlap), as the lookup's device twin's steps are: the
    host's loop no longer sits between the head's catch-up (replayed at the read of each step,
    before its successor is launched) and the forward its drafts feed.

    A row's chain starts at its last token, the runner's start for the step (derived on the device
    for a step launched ahead); its stored output is that of the pair before it, which the last
    catch-up left. A row without room drafts too (static shapes), writing in the spare region.
    Host inputs: `inputs_view` [1, rows], the room, bound by the runner with its starts."""

    width = 1

    def __init__(self, graphs: HeadGraphs, max_rows: int, max_tokens: int):
        self.graphs = graphs
        device = graphs.rows.device
        # what its work in a step depends on (calibrate.measure_verify_cost's key)
        self.cost_key = f"head {sorted(dataclasses.asdict(graphs.drafter.head.cfg).items())}"
        self.inputs_view: torch.Tensor | None = None    # [1, rows]: room
        self.starts: torch.Tensor | None = None         # the runner's [rows]
        self.num_draft = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.drafts = torch.zeros(max_rows, max(max_tokens - 1, 1), dtype=torch.long, device=device)
        self.result = torch.zeros(max_rows, 2 + max_tokens, dtype=torch.long, device=device)

    def inputs(self, seq_ids, room, claim=None) -> list[tuple[int]]:
        """Each row's room, 0 where the head cannot draft for it yet (its prompt not caught up)."""
        return [(k if self.has_row(s) else 0,) for s, k in zip(seq_ids, room)]

    def has_row(self, seq_id: int) -> bool:
        return bool(self.graphs.drafter.ready.get(seq_id))

    def bind(self, inputs: torch.Tensor, starts: torch.Tensor) -> None:
        self.inputs_view, self.starts = inputs.view(1, -1), starts

    def neutral(self) -> tuple[int]:
        return (0,)

    def before(self, b: int, t: int, input_ids: torch.Tensor) -> None:
        room = self.inputs_view[0, :b]
        if t == 1:
            self.num_draft[:b].zero_()
            return
        active = room[:, None] > 0
        drafts = self.drafts[:b, :t - 1]
        self.graphs.chain(b, t - 1, self.starts[:b], active, drafts)
        input_ids[:, 1:] = torch.where(active, drafts, input_ids[:, 1:])
        torch.clamp(room, max=t - 1, out=self.num_draft[:b])

    def after(self, b: int, t: int, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        target, num_out = verify_greedy(logits, input_ids[:, 1:], self.num_draft[:b])
        result = self.result[:b]
        result[:, 0] = num_out
        result[:, 1] = self.num_draft[:b]
        result[:, 2:2 + t] = target


class HeadTreeGraphStep(HeadGraphStep):
    """HeadGraphStep for a head that drafts token trees (tree_width k > 1): before the forward,
    graph rows with room r > 0 draft a tree of t - 1 nodes (HeadGraphs.tree) into input tokens
    1..t-1, r of them its nodes; the runner then verifies the trees in the forward (each node
    rotated at its depth, attending to the row's cache and its ancestors: `depths` and
    `ancestors`, which a row without a tree in the graph gets as a chain's, so drafts written by
    the host verify as they would without trees). After it, greedy verification of the trees
    (sampling/tree.py verify_tree_paths) writes the result as a chain's would read: tokens out,
    nodes drafted, the target's tokens along the accepted path; `path` then says which row
    positions the path took, for the runner to move their keys, values and hidden states into
    place (CudaGraphRunner._compact), so the step reads back as a chain step."""

    trees = True

    def __init__(self, graphs: HeadGraphs, max_rows: int, max_tokens: int, width: int):
        super().__init__(graphs, max_rows, max_tokens)
        self.tree_width = width
        self.cost_key = f"{self.cost_key} trees of width {width}"      # its verify forwards draft trees
        device = graphs.rows.device
        K = max(max_tokens - 1, 1)
        self.chain = torch.arange(K, device=device)
        self.chain_parents = (self.chain - 1).expand(max_rows, K)
        self.chain_ancestors = torch.ones(K, K, dtype=torch.bool, device=device).tril()
        self.parents = torch.zeros(max_rows, K, dtype=torch.long, device=device)
        self.depths = torch.zeros(max_rows, max_tokens, dtype=torch.long, device=device)   # [rows, t]: 0, then nodes'
        self.ancestors = torch.zeros(max_rows, max_tokens, K, dtype=torch.bool, device=device)  # [rows, t, K]
        self.is_node = torch.zeros(max_rows, K, dtype=torch.bool, device=device)
        self.path = torch.zeros(max_rows, K, dtype=torch.long, device=device)

    def tree_depth(self, nodes: int) -> int:
        """How deep its tree of `nodes` nodes reaches (the controller's positions are depths)."""
        return frontier_depth(nodes, self.tree_width)

    def before(self, b: int, t: int, input_ids: torch.Tensor) -> None:
        if t == 1:                                      # a plain step: as a chain's
            return super().before(b, t, input_ids)
        room = self.inputs_view[0, :b]
        K = t - 1
        active = room[:, None] > 0
        tokens, parents, depth, is_node, levels = self.graphs.tree(b, K, self.tree_width, self.starts[:b], active,
                                                                  room)
        input_ids[:, 1:] = torch.where(active, tokens, input_ids[:, 1:])
        # a row without a tree verifies its tokens (the host's drafts, or padding) as a chain
        self.parents[:b, :K] = torch.where(active, parents, self.chain_parents[:b, :K])
        self.depths[:b, 1:t] = torch.where(active, depth, self.chain[:K] + 1)
        self.depths[:b, 0] = 0
        self.ancestors[:b, 1:t, :K] = torch.where(active[:, :, None], tree_ancestors(parents, levels),
                                                  self.chain_ancestors[:K, :K])
        self.ancestors[:b, 0] = False
        self.is_node[:b, :K] = is_node
        torch.clamp(room, max=K, out=self.num_draft[:b])

    def after(self, b: int, t: int, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        if t == 1:
            return super().after(b, t, input_ids, logits)
        K = t - 1
        result = self.result[:b]
        out, num_out, path = verify_tree_paths(logits.argmax(-1), input_ids[:, 1:], self.parents[:b, :K],
                                               self.ancestors[:b, 1:t, :K], self.depths[:b, 1:t], self.is_node[:b, :K])
        self.path[:b, :K] = path
        result[:, 0] = num_out
        result[:, 1] = self.num_draft[:b]
        result[:, 2:2 + t] = out
