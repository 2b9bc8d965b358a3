"""A head's training data: the target's own greedy answers to prompts.

The target answers through the engine (batched, greedy, its chat template). Only the tokens are
kept: the hidden states a head reads are computed again from them, a batch at a time, when it
trains (answers.py), so the data's size does not grow with the target's width and depth: kept,
the four layers the default model's head learns from would take 4.6 kB a token (30 GB for 6.8M
tokens), a 1.5B model's 12 kB, where the tokens take a few bytes.

Prompts are answered in shards of `shard_size`, each saved to <dir>/<name>-<index>.pt once
complete (written to a temporary file, then renamed), so an interrupted run resumes at the first
missing shard. A shard holds tokens (a list of lists, prompt then answer) and prompt_lens.
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from outpace.config import SamplingParams
from outpace.errors import InvalidParameterError
from outpace.llm import LLM


@dataclass
class Answer:
    """One answered prompt: tokens [T] (prompt then answer)."""

    tokens: torch.Tensor
    prompt_len: int


def read_prompts(path: Path) -> list[str]:
    """The `prompt` field of each line of a JSONL file (gzipped where it ends in .gz)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidParameterError(f"no prompts file at {path}: give a JSONL file of {{\"prompt\": ...}} lines")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    if not prompts:
        raise InvalidParameterError(f"{path} holds no prompts")
    return prompts


def generate_shards(llm: LLM, prompts: list[str], folder: Path, name: str, max_tokens: int, max_prompt_tokens: int,
                    shard_size: int) -> None:
    """Answer `prompts` (their chat-formatted ids over max_prompt_tokens are skipped) in shards,
    skipping shards already on disk."""
    folder.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tokenizer = llm.tokenizer
    num_shards = -(-len(prompts) // shard_size)
    todo = [s for s in range(num_shards) if not _shard_path(folder, name, s).exists()]
    bar = tqdm(total=sum(len(prompts[s * shard_size:(s + 1) * shard_size]) for s in todo), desc=f"answering ({name})",
               unit="prompt")
    for s in todo:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}])
                 for p in prompts[s * shard_size:(s + 1) * shard_size]]
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        kept = [i for i in ids if len(i) <= max_prompt_tokens]
        bar.update(len(ids) - len(kept))
        outputs = llm.generate(kept, params, on_tokens=lambda seq: bar.update(1) if seq.is_finished else None,
                               speculate=False)
        shard = {"tokens": [prompt + out.token_ids for prompt, out in zip(kept, outputs)],
                 "prompt_lens": [len(p) for p in kept]}
        path = _shard_path(folder, name, s)
        torch.save(shard, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    bar.close()


def load_shards(folder: Path, name: str) -> list[Answer]:
    """Every answer of the shards named `name`, in shard order."""
    answers = []
    for path in sorted(folder.glob(f"{name}-*.pt")):
        shard = torch.load(path, weights_only=True)
        answers += [Answer(torch.tensor(tokens), prompt_len)
                    for tokens, prompt_len in zip(shard["tokens"], shard["prompt_lens"])]
    return answers


def _shard_path(folder: Path, name: str, index: int) -> Path:
    return folder / f"{name}-{index:05d}.pt"
