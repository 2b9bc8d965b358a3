"""The drafter interface: every drafter (n-gram, draft model, EAGLE/MTP head, trees) implements it.

The step calls begin / propose / accept / verified / end and nothing else, whatever the drafter is
or where its state lives; what a drafter needs from the engine it says once, at construction
(`hidden_layers`, `bind`). Sequences are named by an integer id that the engine owns.

A step's drafts travel as one record, `Drafts`, for every drafter: tensors on the drafter's device
(a host drafter's are CPU tensors, which the host reads for free), whose lengths the host learns at
the step's one synchronisation unless the drafter knew them when it drafted (`num_draft_host`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

import torch


@dataclass
class DraftBatch:
    """What propose drafts for: one row per decoding sequence.

    budget[i]: the most tokens row i may draft (0: none; the controller's choice within the row's
    room in the context and in max_tokens). slots[i], positions[i]: the row's KV slot and the
    position of its last token (a drafter with a cache of its own keeps it in the same slots,
    valid up to that position: positions past it hold rejected tokens and are overwritten).
    params[i], seeds[i], num_output[i]: how the row samples, and how many tokens it has output:
    a drafter that samples couples through the target's noise, u(seed, num_output + j) for its
    j-th drafted token (sampling/sampler.py). Empty where the caller gives none (all greedy).
    room[i]: the most tokens row i could draft (its room in the context and in max_tokens), where
    budget is the controller's length decided before drafting: what a drafter that uses the room
    (Drafter.uses_room) drafts its free rows up to. Empty: budget.
    tree_width: for a drafter of token trees, this step's candidates per node (the controller's
    choice between its trees and chains, 1: a chain); 0: the drafter's own.
    """

    seq_ids: list[int]
    budget: list[int]
    slots: list[int]
    positions: list[int]
    params: list = field(default_factory=list)
    seeds: list = field(default_factory=list)
    num_output: list[int] = field(default_factory=list)
    room: list[int] = field(default_factory=list)
    tree_width: int = 0

    def __len__(self) -> int:
        return len(self.seq_ids)

    def subset(self, rows: Sequence[int]) -> "DraftBatch":
        """The batch of these rows only, in this order."""
        def part(value):
            return [value[i] for i in rows] if isinstance(value, list) and value else value
        return DraftBatch(*(part(getattr(self, name)) for name in _DRAFT_BATCH_FIELDS))


_DRAFT_BATCH_FIELDS = [f.name for f in fields(DraftBatch)]      # dataclasses.fields() at every subset cost more


@dataclass
class Drafts:
    """One step's drafts for the B rows of a DraftBatch.

    tokens [B, K] int64, num_draft [B] int64 on the drafter's device: row i's draft is
        tokens[i, :num_draft[i]] (num_draft[i] <= budget[i]); entries past it are padding (valid
        ids, never accepted). K may be 0.
    parents [B, K] int64 or None: a token tree, parents[i, j] the index of node j's parent
        (< j) or -1 for a child of the row's last token; None: every row is a chain.
    num_draft_host: num_draft as host ints when the drafter knew them while drafting (host
        drafters); None when they stay on the device until the step's synchronisation.
    match_len: per row, how many tail tokens the draft's match rested on (0: not a matching
        drafter); longer matches are accepted far more often and the controller learns by how much.
    free: per row, whether its draft cost no drafter forward (a lookup) although the drafter pays
        for others (Drafter.uses_room): the controller cuts those rows after drafting, at no
        drafting cost. None: no such row.
    """

    tokens: torch.Tensor
    num_draft: torch.Tensor
    parents: torch.Tensor | None = None
    num_draft_host: list[int] | None = None
    match_len: list[int] | None = None
    free: list[bool] | None = None

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int] | None], match_len: Sequence[int] | None = None,
                   device: torch.device | str = "cpu", free: Sequence[bool] | None = None,
                   parents: Sequence[Sequence[int]] | None = None) -> "Drafts":
        """Chains given as host lists (None or [] for no draft), padded with zeros; with parents
        (each row's nodes' parents), trees, their parents padded with -1."""
        lengths = [len(r) if r else 0 for r in rows]
        width = max(lengths, default=0)
        padded = [list(r or ()) + [0] * (width - n) for r, n in zip(rows, lengths)]
        tokens = torch.tensor(padded, dtype=torch.long).view(len(rows), width)
        tree = None if parents is None else torch.tensor(
            [list(p) + [-1] * (width - len(p)) for p in parents], dtype=torch.long).view(len(rows), width).to(device)
        return cls(tokens.to(device), torch.tensor(lengths, dtype=torch.long).to(device), tree,
                   num_draft_host=lengths, match_len=list(match_len) if match_len is not None else None,
                   free=list(free) if free is not None else None)

    @classmethod
    def empty(cls, num_rows: int, device: torch.device | str = "cpu") -> "Drafts":
        return cls.from_lists([None] * num_rows, device=device)

    def truncated(self, lengths: Sequence[int]) -> "Drafts":
        """Each row cut to its first lengths[i] tokens (host lengths known: num_draft_host). A
        tree keeps its first nodes, whose parents come before them."""
        kept = [min(n, m) for n, m in zip(lengths, self.num_draft_host)]
        width = max(kept, default=0)
        return Drafts(self.tokens[:, :width], torch.tensor(kept, dtype=torch.long, device=self.tokens.device),
                      None if self.parents is None else self.parents[:, :width], kept, self.match_len, self.free)

    def host_rows(self) -> list[list[int]]:
        """The drafts as host lists (drafts on the CPU, lengths known: no synchronisation; drafts
        on a device: one)."""
        lengths = self.num_draft_host if self.num_draft_host is not None else self.num_draft.tolist()
        return [row[:n] for row, n in zip(self.tokens.tolist(), lengths)]


@dataclass
class Verified:
    """What verification gave a step's rows, still on the device, for drafters that keep device
    state (a token buffer, a draft model's cache, a head's features): out_tokens[i, :num_out[i]]
    were appended to row i (accepted drafts then the target's own token), positions starting at
    positions[i] + 1. hidden [B, S, len(hidden_layers), H]: the target's hidden states of the
    layers the drafter asked for at the verified inputs (the row's last token and its drafts); the
    first num_out[i] of row i are those of accepted positions. None when nobody asked."""

    batch: DraftBatch
    out_tokens: torch.Tensor
    num_out: torch.Tensor
    hidden: torch.Tensor | None = None


@dataclass
class Prefilled:
    """Prompt chunks the target cached in one forward: chunk i holds positions starts[i] ..
    starts[i] + lengths[i] - 1 of sequence seq_ids[i] (KV slot slots[i]), token_ids[i] its
    tokens. hidden [C, S, len(hidden_layers), H]: the target's hidden states of the asked layers
    at those positions (chunk i's first lengths[i] entries), None when nobody asked.
    defer[i]: the controller does not expect chunk i's sequence to draft soon (its setup would not
    pay, DraftController.pays_setup), so a drafter with a cache of its own may leave the chunk to
    its catch-up; None: no chunk is deferred.
    A sequence's first chunk starts past 0 where the target reused a prefix its slot kept (prefix
    caching, engine/scheduler.py): a drafter with a cache of its own keeps its slots' keys likewise
    and catches up (draft_model.py), or bounds the reuse (Drafter.reusable_prefix, head_drafter.py)."""

    seq_ids: list[int]
    slots: list[int]
    starts: list[int]
    token_ids: list[list[int]]
    hidden: torch.Tensor | None = None
    defer: list[bool] | None = None

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.token_ids]


@dataclass
class DraftContext:
    """What the engine lends a drafter at construction (Drafter.bind): the target's slots and
    context length, its device, dtype and weight format, and how to run a model of its own beside
    the target.
    make_runner(model) gives a runner of the target's kind (CUDA graphs on a GPU) whose KV cache
    has the target's slots and length: a sequence's rows sit in the same slot in both, and a
    drafter rolls its cache back as the target's is, by the sequence's length (entries past it
    are overwritten)."""

    num_slots: int
    max_len: int
    max_step_tokens: int            # the most tokens a row's verify forward holds (1 + num_draft_tokens)
    device: torch.device
    dtype: torch.dtype
    target: torch.nn.Module         # the target model (its config, embedding and LM head may be shared)
    tokenizer: object               # the target's Tokenizer (a draft model's vocabulary is checked against it)
    make_runner: object             # (model) -> ModelRunner with the target's slots and length
    weights: str = "auto"           # how the target's GGUF matrices are held (EngineConfig.weights); a draft model's alike
    graphs: bool = False            # the target replays CUDA graphs: a drafter's own forwards may as well
    # (seq_id) -> the request's cache_salt where it may start from a kept prefix (prefix caching,
    # engine/scheduler.py), else None: a drafter's own kept keys serve only requests of the same salt
    prefix_key: object = lambda seq_id: None
    # (seq_id) -> the request's cache_salt: n-gram lookup's memory of finished requests serves only
    # requests of the same salt
    salt: object = lambda seq_id: ""


class KeptKeys:
    """Prefix caching for a drafter's own cache in the target's slots: when a sequence ends, its
    slot keeps what the drafter cached there for it, as the tokens those entries belong to; a later
    sequence of the same salt starts from them when the drafter first writes that slot for it."""

    def __init__(self, prefix_key):
        self.prefix_key = prefix_key                            # DraftContext.prefix_key
        self.kept: dict[int, tuple[str, list[int]]] = {}        # slot -> (salt, tokens) of a sequence that ended
        self.owner: dict[int, tuple[int, str | None]] = {}      # seq_id -> (its slot, prefix key) once written

    def matching(self, seq_id: int, slot: int) -> list[int]:
        """The tokens the slot kept, where the sequence may reuse them (the same salt); else []."""
        key, kept = self.prefix_key(seq_id), self.kept.get(slot)
        return kept[1] if key is not None and kept is not None and kept[0] == key else []

    def adopt(self, seq_id: int, slot: int) -> list[int] | None:
        """Before the drafter first writes the sequence's slot: the kept tokens it may start from
        (matching), the slot's record now the sequence's; None where it was adopted already."""
        if seq_id in self.owner:
            return None
        tokens = self.matching(seq_id, slot)
        self.owner[seq_id] = slot, self.prefix_key(seq_id)
        self.kept.pop(slot, None)
        return tokens

    def end(self, seq_id: int, tokens: list[int]) -> None:
        """The sequence ended holding entries for these tokens in the slot it was adopted in."""
        slot, key = self.owner.pop(seq_id, (None, None))
        if key is not None:
            self.kept[slot] = key, tokens


class Drafter:
    """Base class. Subclasses override what they need; the defaults keep no state.

    Class attributes a drafter may set:
      hidden_layers: target layers whose hidden states `verified` receives (empty: none, at no cost).
      priced_after_drafting: whether drafting at a row's whole room costs next to nothing (a
        lookup), so propose drafts at the full budget and the draft controller prices the drafts
        that exist (their lengths and match lengths) and cuts them; otherwise (a model that pays
        per drafted token, drafts that stay on the device) the budget is the controller's length,
        decided before drafting.
      uses_room: whether propose, given the controller's length as budget, drafts some rows past
        it up to batch.room at no cost (a chain whose lookup drafts first) and marks them in
        Drafts.free; the step lets the controller cut those after drafting. Only with
        priced_after_drafting False.
      lookup_yields_below: in a chain behind n-gram lookup (chain.py), the match length below
        which the lookup's draft of a row gives way to this drafter's where it drafts the row: a
        shorter match's drafts are accepted less often than this drafter's (0: never).
    """

    name = "drafter"
    hidden_layers: tuple[int, ...] = ()
    priced_after_drafting = True
    uses_room = False
    lookup_yields_below = 0

    def bind(self, context: DraftContext) -> None:
        """Called once before the first request: allocate device state here."""

    def begin(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """A sequence starts with these tokens (the prompt)."""

    def propose(self, batch: DraftBatch) -> Drafts:
        """Drafts of at most batch.budget[i] tokens for each row."""
        return Drafts.empty(len(batch))

    def prefilled(self, chunks: Prefilled) -> None:
        """After the target cached prompt chunks (a drafter with a cache of its own caches the
        same chunks here)."""

    def verified(self, result: Verified) -> None:
        """After verification, before the step's host synchronisation: the step's outcome on the
        device (for drafters whose state lives there). Host drafters wait for accept."""

    def verified_in_graph(self, result: Verified) -> None:
        """verified, for a step that the runner's captured graph verified itself (its graph
        step's state, a device lookup's tokens, already holds the outcome): what drafters
        keeping other device state (a head's cache) need of it."""
        self.verified(result)

    def accept(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Tokens appended to a sequence after verification (accepted drafts plus the target's
        token), on the host, tokens past a stop already dropped."""

    def end(self, seq_id: int) -> None:
        """The sequence finished or was cancelled: drop its state."""

    def reusable_prefix(self, seq_id: int, slot: int) -> int | None:
        """Prefix caching: how many of the sequence's first positions this drafter's own cache in
        `slot` holds for it, which bounds the prefix the target reuses there (a drafter that reads
        the target's hidden states cannot catch up on positions the target does not recompute).
        None: no bound (no cache of its own, or one that catches up by itself)."""
        return None

    def shareable_prefix(self, source_id: int, seq_id: int) -> int | None:
        """Prefix sharing: how many of the sequence's first positions this drafter's own cache
        holds for source_id (a running sequence whose tokens begin as the sequence's do), which
        bounds the prefix the target copies from source_id's slot (reusable_prefix's rule). None:
        no bound."""
        return None

    def copy_prefix(self, source_id: int, source_slot: int, seq_id: int, slot: int, length: int) -> None:
        """The target copied the first `length` positions of source_id's slot into the sequence's
        (within shareable_prefix): a drafter with a cache of its own copies what it holds of them."""

    def setup_seconds(self, seq_ids: Sequence[int]) -> list[float] | None:
        """Per sequence, the seconds drafting for it costs before its first drafted token (a draft
        model reading the tokens it has not read yet); the controller drafts for a row only where
        drafting repays that. None: drafting costs no setup."""
        return None

    def cost_per_token(self, batch_size: int) -> float:
        """Seconds one drafted token costs in a step of batch_size rows, beyond the verify
        forward's share (a draft model's forward): the controller charges it. 0: drafting is free
        next to the target (lookups)."""
        return 0.0

    def step_cost(self, batch_size: int) -> float:
        """Seconds a step of batch_size rows that drafts costs the drafter once, beside each
        drafted token's cost_per_token (a head's catch-up of the pairs the last step accepted, one
        forward for every row whatever the draft's length): the controller charges it."""
        return 0.0

    def graph_step(self, max_rows: int, max_tokens: int):
        """A part of the runner's captured CUDA graph step that drafts into each row's input
        tokens and verifies greedy rows itself (speculative/ngram_device.py's GraphStep), or None."""
        return None
