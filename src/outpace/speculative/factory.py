"""Build the drafter a SpecConfig names: adding a drafter is its file plus one line here."""
from __future__ import annotations

from dataclasses import replace

from outpace.config import SpecConfig
from outpace.speculative.chain import DrafterChain
from outpace.speculative.draft_model import DraftModelDrafter
from outpace.speculative.drafter import Drafter
from outpace.speculative.head_drafter import HEADS, HeadDrafter
from outpace.speculative.ngram import NgramDrafter
from outpace.speculative.ngram_device import DeviceNgramDrafter
from outpace.weights.hub import shipped_head


def make_drafter(spec: SpecConfig, model: str, device: str, max_seqs: int, max_len: int, cuda_graphs: bool) -> Drafter:
    """The drafter for `spec` on the target `model` (its name or path: an EAGLE-3 head without
    draft_head is the one that ships for a known model)."""
    if device.startswith("cuda"):
        # lookups draft inside the CUDA graphs from each sequence's own tokens; a memory of ended
        # requests would cost the host's loop, which bounds a GPU step, for drafts it seldom makes
        spec = replace(spec, lookup_memory=0)
    if spec.method == "ngram" and device.startswith("cuda") and spec.tree_width == 1:
        # prompt lookup over a device token buffer: no host round trip per step (trees: on the host)
        return DeviceNgramDrafter(spec, max_seqs, max_len, device, use_graph=cuda_graphs)
    if spec.method == "ngram":
        return NgramDrafter(spec)
    if spec.method == "draft":
        model = DraftModelDrafter(spec.draft_model, spec.p_min, spec.draft_vocab, spec.draft_window,
                                  spec.draft_weights)
        return _after_lookup(model, spec, device, max_seqs, max_len, cuda_graphs) if spec.ngram_first else model
    if spec.method in HEADS:
        folder = spec.draft_head or str(shipped_head(model))
        head = HeadDrafter(HEADS[spec.method](folder), spec.tree_width, spec.p_min)
        return _after_lookup(head, spec, device, max_seqs, max_len, cuda_graphs) if spec.ngram_first else head
    return Drafter()


def _after_lookup(drafter: Drafter, spec: SpecConfig, device: str, max_seqs: int, max_len: int,
                  cuda_graphs: bool) -> DrafterChain:
    """n-gram lookup first, then `drafter`; on a GPU with the lookup's device twin (lookup_twin)."""
    lookup = lookup_twin(spec, max_seqs, max_len, device, cuda_graphs) if device.startswith("cuda") else None
    return DrafterChain([NgramDrafter(spec), drafter], lookup)


def lookup_twin(spec: SpecConfig, max_seqs: int, max_len: int, device: str, use_graph: bool) -> DeviceNgramDrafter:
    """A chain's lookup on the device (DrafterChain.lookup), which drafts inside the graph step
    where the paying drafter (a draft model, a head) drafts nowhere, as n-gram lookup alone does:
    from a 1-token match up (the host lookup ahead of the model keeps the chain's min_ngram)."""
    return DeviceNgramDrafter(replace(spec, min_ngram=1), max_seqs, max_len, device, use_graph=use_graph)
