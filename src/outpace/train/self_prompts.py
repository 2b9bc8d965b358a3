"""Prompts the target writes itself: its chat template opened at a user turn, the turn sampled.

An instruct model has learnt what its users ask, and given its template up to the start of a
user message it writes one (the idea of Magpie, Xu et al., 2024, "Alignment Data Synthesis from
Scratch by Prompting Aligned LLMs with Nothing"). A head trained on the target's answers to such
prompts sees the kinds of chat the target was tuned for (advice, writing, explanations), where a
file of prompts may hold mostly one kind (the training prompts' file is 84% chain-of-thought
questions). Sampled turns that end with the model's end of turn, not at the token limit, are
kept, each once; the same seed gives the same prompts.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tqdm import tqdm

from outpace.config import SamplingParams
from outpace.errors import InvalidParameterError
from outpace.llm import LLM
from outpace.train.head_data import read_prompts

SENTINEL = "\x00user-text\x00"
TEMPERATURE = 1.0
TOP_P = 0.95                # a 135M model's tail at temperature 1 is mostly noise
MAX_TOKENS = 192            # a turn still unfinished here is dropped
MIN_CHARS = 12
CHUNK = 2048                # requests handed to the engine at once
MAX_ROUNDS = 8              # rounds of sampling before giving up on the count (duplicates, unfinished turns)


def user_turn_prefix(tokenizer) -> list[int]:
    """The ids of the chat template up to where a user's first message begins."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], add_generation_prompt=False)
    if SENTINEL not in text:
        raise InvalidParameterError("the model's chat template does not show a user message as written, so it "
                                    "cannot be asked to write one: give --prompts instead of --self-prompts")
    return tokenizer.encode(text[:text.index(SENTINEL)], add_special_tokens=False)


def self_prompts(llm: LLM, count: int, seed: int, path: Path) -> list[str]:
    """`count` prompts written by the target, kept in `path` (JSONL) and read from there on a rerun."""
    path = Path(path)
    if path.exists() and len(prompts := read_prompts(path)) == count:
        return prompts
    prefix = user_turn_prefix(llm.tokenizer)
    prompts, seen, asked = [], set(), 0
    for _ in range(MAX_ROUNDS):
        need = count - len(prompts)
        if need == 0:
            break
        batch = need + need // 4 + 8
        params = [SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=MAX_TOKENS,
                                 seed=seed * 1_000_003 + asked + i) for i in range(batch)]
        asked += batch
        bar = tqdm(total=batch, desc=f"writing prompts ({len(prompts)} of {count} kept)", unit="prompt")
        outputs = []
        for i in range(0, batch, CHUNK):
            outputs += llm.generate([prefix] * len(params[i:i + CHUNK]), params[i:i + CHUNK], speculate=False,
                                    on_tokens=lambda seq: bar.update(1) if seq.is_finished else None)
        for out in outputs:                 # in request order, so the prompts kept depend on the seed alone
            text = out.text.strip()
            if out.finish_reason == "stop" and len(text) >= MIN_CHARS and text not in seen and len(prompts) < count:
                seen.add(text)
                prompts.append(text)
        bar.set_description(f"writing prompts ({len(prompts)} of {count} kept)")    # the round's own too
        bar.close()
    if len(prompts) < count:
        raise InvalidParameterError(f"the model wrote {len(prompts)} distinct finished prompts of {count} in "
                                    f"{asked} tries: ask for fewer --self-prompts")
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": f"self-{i}", "source": "self", "prompt": p}) + "\n"
                     for i, p in enumerate(prompts))
    os.replace(tmp, path)
    return prompts
