"""A head's training data: the target's own greedy answers to prompts.

The target answers through the engine (batched, greedy, its chat template). Only the tokens are
kept: the hidden states a head reads are computed again from them, a batch at a time, when it
trains (answers.py), so the data's size does not grow with the target's width and depth: kept,
the four layers the default model's head learns from would take 4.6 kB a token (30 GB for 6.8M
tokens), a 1.5B model's 12 kB, where the tokens take a few bytes.

A prompt may be a conversation (a list of user turns): each turn is answered with the
conversation so far in its context, the target's own earlier answers included, as Spec-Bench
runs its multi-turn questions, and each answer is kept with its context.

Prompts are answered in shards of `shard_size`, each saved to <dir>/<name>-<index>.pt once
complete (written to a temporary file, then renamed), so an interrupted run resumes at the first
missing shard. A shard holds, one entry an answer, tensors: tokens (int32, the answers' context
then answer one after another), lengths, prompt_lens, the index of its prompt in the list
answered (sources) and its turn (turns). Tensors save and load as blocks, where pickled lists of
ints took about a tenth of the answering's time on a GPU (shards holding such lists are still
read).
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

GROUP_SEQS = 2          # prompts handed to the engine at once, in multiples of its slots (generate_shards)


@dataclass
class Answer:
    """One answered turn: tokens [T] (its context, then the answer)."""

    tokens: torch.Tensor
    prompt_len: int
    source: int = 0         # the index of its prompt in the list answered
    turn: int = 0           # which of the prompt's user turns it answers


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


def generate_shards(llm: LLM, prompts: list[str | list[str]], folder: Path, name: str, max_tokens: int,
                    max_prompt_tokens: int, shard_size: int) -> None:
    """Answer `prompts` (each one user turn, or a conversation's user turns) in shards, skipping
    shards already on disk. A turn whose chat-formatted context is over max_prompt_tokens is
    skipped with the rest of its conversation. The engine answers the missing shards a group at
    a time (GROUP_SEQS times its slots' worth of prompts, whole shards), so its slots stay full
    where shards are smaller than its batch and a shard's longest answers finish beside the next
    shard's; each shard is saved as the group ends."""
    folder.mkdir(parents=True, exist_ok=True)
    # an answer's text is needed only where its conversation goes on (the next turn's context)
    params = {more: SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=more) for more in (False, True)}
    conversations = [[p] if isinstance(p, str) else list(p) for p in prompts]
    num_shards = -(-len(conversations) // shard_size)
    todo = [s for s in range(num_shards) if not _shard_path(folder, name, s).exists()]
    bar = tqdm(total=sum(len(c) for s in todo for c in conversations[s * shard_size:(s + 1) * shard_size]),
               desc=f"answering ({name})", unit="turn")
    group = max(1, GROUP_SEQS * llm.engine.config.max_num_seqs // shard_size)
    for g in range(0, len(todo), group):
        shards = todo[g:g + group]
        sources = [i for s in shards for i in range(s * shard_size, min((s + 1) * shard_size, len(conversations)))]
        answered = {s: {"tokens": [], "prompt_lens": [], "sources": [], "turns": []} for s in shards}
        history: dict[int, list[dict] | None] = {i: [] for i in sources}        # None: dropped (a context too long)
        for turn in range(max(len(conversations[i]) for i in sources)):
            kept, ids = [], []
            for i in sources:
                turns = conversations[i]
                if turn >= len(turns) or history[i] is None:
                    continue
                history[i].append({"role": "user", "content": turns[turn]})
                context = llm.tokenizer.encode_chat(history[i], add_generation_prompt=True)
                if len(context) > max_prompt_tokens:
                    bar.update(len(turns) - turn)
                    history[i] = None
                    continue
                kept.append(i)
                ids.append(context)
            outputs = llm.generate(ids, [params[turn + 1 < len(conversations[i])] for i in kept],
                                   on_tokens=lambda seq: bar.update(1) if seq.is_finished else None,
                                   speculate=False) if ids else []
            for i, context, out in zip(kept, ids, outputs):
                history[i].append({"role": "assistant", "content": out.text})
                shard = answered[i // shard_size]
                shard["tokens"].append(context + out.token_ids)
                shard["prompt_lens"].append(len(context))
                shard["sources"].append(i)
                shard["turns"].append(turn)
        for s, shard in answered.items():
            _save_shard(_shard_path(folder, name, s), shard)
    bar.close()


def _save_shard(path: Path, shard: dict) -> None:
    """A shard's lists as tensors, written whole (a temporary file, then renamed)."""
    lengths = [len(t) for t in shard["tokens"]]
    tensors = {"tokens": torch.tensor([t for tokens in shard["tokens"] for t in tokens], dtype=torch.int32),
               "lengths": torch.tensor(lengths)} | {k: torch.tensor(shard[k]) for k in ("prompt_lens", "sources", "turns")}
    torch.save(tensors, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def load_shards(folder: Path, name: str) -> list[Answer]:
    """Every answer of the shards named `name`, in shard order."""
    answers = []
    for path in sorted(folder.glob(f"{name}-*.pt")):
        shard = torch.load(path, weights_only=True)
        tokens = shard["tokens"]
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.long().split(shard["lengths"].tolist())
        else:
            tokens = [torch.tensor(t) for t in tokens]
        n = len(tokens)
        columns = [torch.as_tensor(shard.get(k, [0] * n)).tolist() for k in ("prompt_lens", "sources", "turns")]
        answers += [Answer(t, prompt_len, source, turn) for t, prompt_len, source, turn in zip(tokens, *columns)]
    return answers


def _shard_path(folder: Path, name: str, index: int) -> Path:
    return folder / f"{name}-{index:05d}.pt"
