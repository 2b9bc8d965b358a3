"""A head's training data: the target's own greedy answers to prompts, with its hidden states.

The target answers through the engine (batched, greedy, its chat template) while a Recorder, a
drafter that drafts nothing, keeps the hidden states of the layers asked for at every position
the target is fed: the prompt's chunks, then each decode step's last token. A sequence of T tokens
(prompt, then answer) has hidden states at positions 0 .. T - 2 (its last token is never fed).

Prompts are answered in shards of `shard_size`, each saved to <dir>/<name>-<index>.pt once
complete (written to a temporary file, then renamed), so an interrupted run resumes at the first
missing shard. A shard holds: tokens (a list of lists), prompt_lens, layers (the target layers
recorded, in order), hidden ([sum of (T - 1)], layers, H] in the target's dtype, sequence after
sequence).
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
from outpace.model.eagle3 import default_layers
from outpace.speculative.drafter import DraftContext, Drafter, Prefilled, Verified


@dataclass
class Recorded:
    """One answered prompt: tokens [T] (prompt then answer), hidden [T - 1, layers, H]."""

    tokens: torch.Tensor
    prompt_len: int
    hidden: torch.Tensor


class Recorder(Drafter):
    """Drafts nothing; keeps the target's hidden states at each position it is fed (of plain
    requests: the trainer's answers decode plainly): the layers an EAGLE-3 head reads and the last
    one, learnt at bind, before the engine builds the CUDA graphs that write them. Sequences begun
    while `is_recording` is False (the target writing its own prompts) are not kept."""

    hears_plain = True

    def __init__(self):
        self.parts: dict[int, list[tuple[int, torch.Tensor]]] = {}      # seq_id -> (first position, [n, layers, H])
        self.is_recording = True

    def bind(self, context: DraftContext) -> None:
        L = context.target.cfg.num_layers
        self.head_layers = default_layers(L)
        self.hidden_layers = tuple(sorted(set(self.head_layers) | {L - 1}))

    def begin(self, seq_id, token_ids):
        if self.is_recording:
            self.parts[seq_id] = []

    def prefilled(self, chunks: Prefilled) -> None:
        for i, (seq_id, start, n) in enumerate(zip(chunks.seq_ids, chunks.starts, chunks.lengths)):
            if seq_id in self.parts:
                self.parts[seq_id].append((start, chunks.hidden[i, :n].to("cpu", copy=True)))

    def verified(self, result: Verified) -> None:
        # plain steps (no drafts): the hidden state of each row's last token, copied: on a graph
        # step's path it is a view of the step's buffer, which the next step overwrites (and on
        # the CPU .cpu() would keep the view)
        rows = [i for i, seq_id in enumerate(result.batch.seq_ids) if seq_id in self.parts]
        if not rows:
            return
        hidden = result.hidden[:, :1].to("cpu", copy=True)
        for i in rows:
            self.parts[result.batch.seq_ids[i]].append((result.batch.positions[i], hidden[i]))

    def take(self, seq_id: int) -> torch.Tensor:
        """The sequence's hidden states in position order [positions, layers, H], forgotten here."""
        parts = sorted(self.parts.pop(seq_id), key=lambda p: p[0])
        return torch.cat([h for _, h in parts])


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


def generate_shards(llm: LLM, recorder: Recorder, prompts: list[str], folder: Path, name: str, max_tokens: int,
                    max_prompt_tokens: int, shard_size: int) -> None:
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
        seq_ids = sorted(recorder.parts)            # the engine numbers sequences in the order they were added
        tokens, hidden = [], []
        for seq_id, prompt, out in zip(seq_ids, kept, outputs):
            tokens.append(prompt + out.token_ids)
            hidden.append(recorder.take(seq_id))
            assert len(hidden[-1]) == len(tokens[-1]) - 1, "a position's hidden state was not recorded"
        shard = {"tokens": tokens, "prompt_lens": [len(p) for p in kept], "layers": list(recorder.hidden_layers),
                 "hidden": torch.cat(hidden) if hidden else torch.empty(0)}
        path = _shard_path(folder, name, s)
        torch.save(shard, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    bar.close()


def load_shards(folder: Path, name: str) -> tuple[list[Recorded], list[int]]:
    """Every sequence of the shards named `name`, in shard order, and the layers recorded."""
    sequences, layers = [], []
    for path in sorted(folder.glob(f"{name}-*.pt")):
        shard = torch.load(path, weights_only=True)
        layers = shard["layers"]
        offset = 0
        for tokens, prompt_len in zip(shard["tokens"], shard["prompt_lens"]):
            n = len(tokens) - 1
            sequences.append(Recorded(torch.tensor(tokens), prompt_len, shard["hidden"][offset:offset + n]))
            offset += n
    return sequences, layers


def _shard_path(folder: Path, name: str, index: int) -> Path:
    return folder / f"{name}-{index:05d}.pt"
