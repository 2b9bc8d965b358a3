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

Across requests (SpecConfig.lookup_memory > 0; on the CPU, factory.py): a finished sequence's
tokens join a memory shared by the requests of its cache salt (LookupMemory), the most recent
`lookup_memory` tokens kept. The memory matches tails of MEMORY_NGRAMS tokens, longest first (the
longer ones tell one document's answer from another's where they share a chat template's
tokens); where its match agrees with the tail further back than the sequence's own match does,
the draft is the memory's continuation, as a chain, and its match length the tokens it agrees
on. A request that repeats or resembles an earlier one (a retry, an agent's next call of the
same template) then drafts the earlier answer. Drafts stay drafts: the target verifies them, so
output is unchanged. The device twin (ngram_gpu.py) looks up the sequence's own tokens alone.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import replace
from typing import Sequence

import numpy as np

from outpace.config import SpecConfig
from outpace.speculative.drafter import DraftBatch, Drafter, Drafts

MAX_CONTINUATIONS = 16      # a tree merges the matched suffix's most recent continuations, this many at most
# a node's score is the continuations through it times this per depth: a deeper node is reached
# only where every node above it was accepted (n-gram drafts are accepted about half the time)
DEPTH_DECAY = 0.5
# the tail lengths the memory matches (from min_ngram): from 3, since another request's text that
# agrees on 2 tokens drafts a right first token about half as often as the sequence's own lookup
# (27% against 58%, offline over 52 Spec-Bench answers in turn) and on 3-5 as often; up to 16, past
# the sequence's own max_ngram, since a shared chat template's last tokens precede every answer
MEMORY_NGRAMS = (3, 4, 8, 16)
# how far back a memory match and the sequence's own are compared
EXTEND_LIMIT = 32


def _agree(a: list[int], a_end: int, b: list[int], b_end: int) -> int:
    """How many tokens a[:a_end] and b[:b_end] end with alike, EXTEND_LIMIT at most."""
    k, top = 0, min(a_end, b_end, EXTEND_LIMIT)
    while k < top and a[a_end - 1 - k] == b[b_end - 1 - k]:
        k += 1
    return k


# the n-gram keys of LookupMemory: a multiplicative hash over 64-bit words, seeded by the salt
_MASK = (1 << 64) - 1
_MULT = 0x9E3779B97F4A7C15


class LookupMemory:
    """Finished sequences' tokens (documents), for lookups across requests of one cache salt.

    Per n, a table key(salt, n-gram) -> document << 32 | c of the latest document holding the
    n-gram with a token after it (c: that token's position); a hit is checked against the document's
    tokens, so a key collision drafts nothing. Beyond `capacity` tokens the oldest documents go,
    with the table entries that still point at them. A document's keys are computed for all its
    positions at once (numpy): a request of 1,000 tokens joins in 1.5-3 ms."""

    def __init__(self, ns: Sequence[int], capacity: int):
        self.ns, self.capacity = ns, capacity
        self.tables: list[dict[int, int]] = [{} for _ in ns]
        self.docs: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()
        self.size = 0
        self._next = 0

    def add(self, salt: str, tokens: list[int]) -> None:
        tokens = tokens[-self.capacity:]
        doc, self._next = self._next, self._next + 1
        self.docs[doc] = salt, tokens
        self.size += len(tokens)
        for table, keys, values in self._entries(doc, salt, tokens):
            table.update(zip(keys, values))       # c increasing: the latest occurrence wins
        while self.size > self.capacity:
            old, (old_salt, old_tokens) = self.docs.popitem(last=False)
            self.size -= len(old_tokens)
            for table, keys, values in self._entries(old, old_salt, old_tokens):
                for key, value, now in zip(keys, values, map(table.get, keys)):
                    if now == value:
                        del table[key]

    def _entries(self, doc: int, salt: str, tokens: list[int]):
        """Per n: (its table, the keys of tokens[c - n:c], doc << 32 | c) for c = n .. len - 1."""
        words = np.asarray(tokens, dtype=np.uint64) + np.uint64(1)
        seed = np.uint64(hash(salt) & _MASK)
        for n, table in zip(self.ns, self.tables):
            count = len(tokens) - n
            if count <= 0:
                continue
            keys = np.full(count, seed, dtype=np.uint64)
            for j in range(n):                     # wraps modulo 2^64, as _key does
                keys = keys * np.uint64(_MULT) + words[j:j + count]
            yield table, keys.tolist(), range(doc << 32 | n, doc << 32 | len(tokens))

    @staticmethod
    def _key(salt: str, tail: list[int]) -> int:
        key = hash(salt) & _MASK
        for token in tail:
            key = (key * _MULT + token + 1) & _MASK
        return key

    def find(self, salt: str, tokens: list[int]) -> tuple[list[int], int] | None:
        """(document tokens, c) of the longest n whose tail n-gram the memory holds (for salt), c
        the position after it in the document; None where none."""
        for n, table in zip(reversed(self.ns), reversed(self.tables)):
            if n > len(tokens):
                continue
            tail = tokens[-n:]
            found = table.get(self._key(salt, tail))
            if found is not None:
                doc_tokens = self.docs[found >> 32][1]
                c = found & 0xFFFFFFFF
                if doc_tokens[c - n:c] == tail:
                    return doc_tokens, c
        return None


class _SeqIndex:
    """One sequence: its tokens and, for each n, a table n-gram -> continuation start c (trees:
    every continuation start, in increasing order)."""

    __slots__ = ("tokens", "tables", "salt")

    def __init__(self, num_tables: int, salt: str = ""):
        self.tokens: list[int] = []
        self.tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(num_tables)]
        self.salt = salt            # the request's cache salt: the memory it reads and joins


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
        memory_ns = [n for n in MEMORY_NGRAMS if n >= self.min_ngram]
        self.memory = LookupMemory(memory_ns, config.lookup_memory) if config.lookup_memory and memory_ns else None
        self._salt = lambda seq_id: ""

    def bind(self, context) -> None:
        self._salt = context.salt

    def begin(self, seq_id: int, token_ids: Sequence[int]) -> None:
        self._seqs[seq_id] = _SeqIndex(len(self._ns), self._salt(seq_id))
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
        recalled = self._recall(seq, starts[-1] if starts else None)
        if recalled is not None:          # the memory's continuation, as a chain
            doc, at, n = recalled
            draft = doc[at:at + max_nodes]
            return draft, list(range(-1, len(draft) - 1)), n
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
        recalled = self._recall(seq, c)
        if recalled is not None:
            doc, at, agreed = recalled
            return doc[at:at + max_tokens], agreed
        return ([], 0) if c is None else (seq.tokens[c:c + max_tokens], n)

    def _recall(self, seq: _SeqIndex, c: int | None) -> tuple[list[int], int, int] | None:
        """(a document, the position its continuation starts at, the tail tokens it agrees on)
        where the memory's match agrees with the tail further back than the sequence's own match
        (continuation start c; None: none) does, else None."""
        if self.memory is None:
            return None
        found = self.memory.find(seq.salt, seq.tokens)
        if found is None:
            return None
        doc, at = found
        tokens = seq.tokens
        agreed = _agree(doc, at, tokens, len(tokens))
        if c is not None and agreed <= _agree(tokens, c, tokens, len(tokens)):
            return None
        return doc, at, agreed

    def end(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None and self.memory is not None:
            self.memory.add(seq.salt, seq.tokens)
