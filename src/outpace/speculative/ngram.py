"""Prompt-lookup drafting: continue the sequence the way it went after an earlier copy of its tail.

Semantics (shared, token for token, with the batched tensor version in ngram_gpu.py). A sequence
is one buffer T[0:L] of prompt plus generated tokens; matches may come from either part.
For n = max_ngram down to min_ngram (longest first), the suffix T[L-n:L] is looked up among the
earlier occurrences T[p:p+n] == T[L-n:L] with p < L-n, i.e. whose continuation start c = p+n is
at most L-1 (so at least one token follows it and the suffix never matches itself; a match needs
L >= n+1). The first n with an occurrence wins; match='recent' takes the largest c, 'first' the
smallest. The draft is T[c : min(c+K, L)]: fewer than K tokens when the buffer ends sooner. Only
tokens that exist are drafted, even when the most recent occurrence sits right at the end (in the
run 'a a a a', the suffix 'a a a' matches at c=3 and drafts a single 'a').

Trees (tree_width > 1, host only): the matched suffix's earlier occurrences (the most recent
MAX_CONTINUATIONS, with the same longest-n rule) each give a continuation T[c : c+K]; they are
merged into a trie whose nodes count the continuations through them, and the draft is its best
nodes, taken best first (the continuations through a node times DEPTH_DECAY per depth, then the
most recent) from the children of the nodes taken, at most tree_width children a node: a parent
always before its children. With one
occurrence the tree is the chain above; where a suffix went several ways, the tree holds them
all, and one verify forward keeps whichever the target took (SGLang's n-gram trie does the same).
"""
from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Sequence

from outpace.config import SpecConfig
from outpace.speculative.drafter import DraftBatch, Drafter, Drafts

MAX_CONTINUATIONS = 16      # a tree merges the matched suffix's most recent continuations, this many at most
# a node's score is the continuations through it times this per depth: a deeper node is reached
# only where every node above it was accepted (n-gram drafts are accepted about half the time)
DEPTH_DECAY = 0.5


class _SeqIndex:
    """One sequence: its tokens and, for each n, a table n-gram -> continuation start c (trees:
    every continuation start, in increasing order)."""

    __slots__ = ("tokens", "tables")

    def __init__(self, num_tables: int):
        self.tokens: list[int] = []
        self.tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(num_tables)]


class NgramDrafter(Drafter):
    """Prompt lookup over prompt plus output, kept incrementally per sequence.

    Index invariant: when a sequence holds L tokens, the table for n holds exactly the n-grams
    T[c-n:c] with n <= c <= L-1, each mapped to its largest c ('recent') or smallest c ('first').
    An n-gram enters the index when the token after it arrives: appending the token at position c
    indexes the n-grams that end at c-1. The current suffix (c = L) is therefore never in the index,
    and one lookup per n answers propose. Cost: num_n dict updates per token appended (accept,
    begin), num_n lookups per propose; memory about L entries per n per sequence.
    """

    name = "ngram"

    def __init__(self, config: SpecConfig | None = None, *, min_ngram: int | None = None,
                 max_ngram: int | None = None, match: str | None = None):
        explicit = {"min_ngram": min_ngram, "max_ngram": max_ngram, "match": match}
        # replace() reruns SpecConfig's validation on the explicit values.
        config = replace(config or SpecConfig(), **{k: v for k, v in explicit.items() if v is not None})
        self.min_ngram = config.min_ngram
        self.max_ngram = config.max_ngram
        self.match = config.match
        self.tree_width = config.tree_width
        self._ns = range(self.min_ngram, self.max_ngram + 1)  # tables[i] is for n = min_ngram + i
        self._seqs: dict[int, _SeqIndex] = {}

    def begin(self, seq_id: int, token_ids: Sequence[int]) -> None:
        self._seqs[seq_id] = _SeqIndex(len(self._ns))
        self.accept(seq_id, token_ids)

    def accept(self, seq_id: int, token_ids: Sequence[int]) -> None:
        seq = self._seqs[seq_id]
        tokens, tables, keep_first, keep_all = seq.tokens, seq.tables, self.match == "first", self.tree_width > 1
        for token in token_ids:
            c = len(tokens)  # the arriving token's position: n-grams ending at c-1 gain a continuation
            for n, table in zip(self._ns, tables):
                if n > c:
                    break
                key = tuple(tokens[c - n:c])
                if keep_all:
                    table.setdefault(key, []).append(c)
                elif keep_first:
                    table.setdefault(key, c)
                else:
                    table[key] = c
            tokens.append(token)

    def propose(self, batch: DraftBatch) -> Drafts:
        width = batch.tree_width or self.tree_width      # the controller may ask chains of a tree drafter
        if width > 1:
            return self._propose_trees(batch, width)
        found = [self._propose_one(self._seqs[s], k) for s, k in zip(batch.seq_ids, batch.budget)]
        return Drafts.from_lists([tokens for tokens, _ in found], [n for _, n in found])

    def _propose_trees(self, batch: DraftBatch, width: int) -> Drafts:
        found = [self._tree_one(self._seqs[s], k, width) for s, k in zip(batch.seq_ids, batch.budget)]
        return Drafts.from_lists([tokens for tokens, _, _ in found], [n for _, _, n in found],
                                 parents=[parents for _, parents, _ in found])

    def _match(self, seq: _SeqIndex):
        """(the longest matching suffix's table entry, its length n); (None, 0) when none matches."""
        tokens = seq.tokens
        for n, table in zip(reversed(self._ns), reversed(seq.tables)):
            found = table.get(tuple(tokens[-n:])) if n < len(tokens) else None
            if found is not None:
                return found, n
        return None, 0

    def _tree_one(self, seq: _SeqIndex, max_nodes: int, width: int) -> tuple[list[int], list[int], int]:
        """(tokens, parents, match length) of a tree of at most max_nodes nodes, at most width
        children a node (module docstring)."""
        if max_nodes <= 0:
            return [], [], 0
        starts, n = self._match(seq)
        if starts is None:
            return [], [], 0
        tokens = seq.tokens
        # the trie: node i holds token[i] under parent[i]; count[i] continuations pass through it,
        # the most recent of them ranked first[i] (0: the most recent continuation)
        token, parent, count, first, children = [], [], [], [], {}
        for rank, c in enumerate(reversed(starts[-MAX_CONTINUATIONS:])):
            at = -1
            for t in tokens[c:c + max_nodes]:
                node = children.setdefault(at, {}).get(t)
                if node is None:
                    node = children[at][t] = len(token)
                    token.append(t), parent.append(at), count.append(0), first.append(rank)
                count[node] += 1
                at = node

        def best(of: int, depth: int) -> list[tuple[float, int, int, int]]:    # its width best children
            kids = [(-count[k] * DEPTH_DECAY ** depth, first[k], depth, k) for k in children.get(of, {}).values()]
            return heapq.nsmallest(width, kids)
        frontier, taken, index = best(-1, 0), [], {-1: -1}
        heapq.heapify(frontier)
        while frontier and len(taken) < max_nodes:
            _, _, depth, node = heapq.heappop(frontier)
            index[node] = len(taken)
            taken.append(node)
            for kid in best(node, depth + 1):
                heapq.heappush(frontier, kid)
        return [token[i] for i in taken], [index[parent[i]] for i in taken], n

    def _propose_one(self, seq: _SeqIndex, max_tokens: int) -> tuple[list[int], int]:
        """(draft, match length); ([], 0) when no suffix matches."""
        if max_tokens <= 0:
            return [], 0
        c, n = self._match(seq)
        if isinstance(c, list):         # a tree drafter's table (every start) asked for a chain
            c = c[0] if self.match == "first" else c[-1]
        return ([], 0) if c is None else (seq.tokens[c:c + max_tokens], n)

    def end(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
