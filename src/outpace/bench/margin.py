"""Where a speculative and a plain greedy output part: the target's own view of that position.

Speculative greedy output can differ from plain greedy output without a bug: a forward over k+1
tokens may round differently from a forward over one, and a near-tie between the top two logits
then flips. The target's top-2 logit margin at the first differing position tells the two apart:
a margin near the dtype's resolution is a near-tie; a large one, with the speculative token far
down the ranking, is a bug.
"""
from __future__ import annotations

import math

import torch

from outpace.engine.llm_engine import LLMEngine
from outpace.runner.model_runner import Row


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (the shorter length if one is a prefix of
    the other and they differ in length); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def next_token_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """The target's float32 logits [V] for the token after `token_ids`, from a fresh prefill on a
    free cache slot (chunked like the engine's own prefill). Call only between steps: the slot's
    scratch keys are overwritten by the next request that takes it."""
    slot = engine.scheduler.take_scratch_slot()
    chunk = engine.config.max_prefill_tokens
    starts = range(0, len(token_ids), chunk)
    for start in starts[:-1]:
        engine.runner.forward([Row(slot, token_ids[start:start + chunk], start)], logits="none")
    last = starts[-1]
    logits, _ = engine.runner.forward([Row(slot, token_ids[last:], last)])    # [1, S, V]
    return logits[0, -1].float()


def divergence(engine: LLMEngine, prompt_ids: list[int], spec_ids: list[int], base_ids: list[int]) -> dict | None:
    """None when the outputs are equal; else where they part and how close the target's choice was
    there, given the prompt and the common prefix."""
    i = first_difference(spec_ids, base_ids)
    if i is None:
        return None
    spec_token = spec_ids[i] if i < len(spec_ids) else None     # None: that run stopped here
    base_token = base_ids[i] if i < len(base_ids) else None
    logits = next_token_logits(engine, prompt_ids + base_ids[:i])
    top = torch.topk(logits, 2)
    (v1, v2), (t1, t2) = top.values.tolist(), top.indices.tolist()

    def rank(token):
        return None if token is None else int((logits > logits[token]).sum()) + 1

    def logit(token):
        return None if token is None else float(logits[token])

    # spacing of the model dtype's numbers at the top logit's magnitude: margins of a few of these
    # are rounding-level near-ties
    resolution = torch.finfo(engine.dtype).eps * 2.0 ** math.floor(math.log2(max(abs(v1), 1e-30)))
    return {
        "position": i,                      # index into the generated tokens
        "spec_token": spec_token, "baseline_token": base_token,
        "top1_token": t1, "top2_token": t2,
        "top2_margin": v1 - v2,             # logit gap between the target's two best tokens
        "logit_resolution": resolution,
        "spec_token_rank": rank(spec_token), "baseline_token_rank": rank(base_token),
        "spec_logit": logit(spec_token), "baseline_logit": logit(base_token),
    }
