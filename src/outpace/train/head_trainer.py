"""train_head: an EAGLE-3 head for a target, trained by self-distillation (`outpace train-head`).

Steps, each resumable in the output folder:
  1. With `self_prompts` > 0 the target first writes that many prompts itself (self_prompts.py,
     kept in self_prompts.jsonl), added to the file's (to `file_prompts` of them, drawn with the
     seed, where that is set: the mix's share of each). The prompts are shuffled with the seed;
     the first `held_out` are held back (acceptance is measured on them while training, never
     trained on), the next `num_prompts` train.
  2. The target answers both sets (head_data.py: greedy, its chat template, batched through the
     engine); data/ holds the answers' tokens. With `task_prompts` > 0 that many prompts are then
     built from the training answers (task_prompts.py: texts to summarize, passages to answer
     from, translations there and back) and answered too; they train with the rest. Each batch's
     hidden states at the head's three layers and at its last layer (whose final norm and LM head
     give the target's distributions) are computed from them as it trains (answers.py).
  3. The draft vocabulary: the `draft_vocab` target tokens most frequent in the training answers;
     with `init_head` the head starts from that head's weights and keeps its draft vocabulary and
     layers (a head trained further on new prompts: data need not outlive a session), or, given
     a larger `draft_vocab`, its vocabulary widens by the answers' most frequent tokens it lacks
     (widen_vocab: their LM head rows start from the target's).
  4. Training (unroll.py): batches of like lengths (epoch_batches), `ttt_steps` unrolled steps a
     batch, AdamW, linear warm-up then cosine decay to a tenth, gradients clipped at 0.5. The
     head's LM head starts from the target's rows of the draft vocabulary (a new head's); its
     embedding is the target's, frozen and not saved. Every `eval_every` steps (and before the
     first) the held-back answers give the mean number of drafts accepted in a row at each answer
     position with chains of `ttt_steps` drafts.
  5. checkpoint.pt every `checkpoint_every` steps (head, optimizer, step); a run finds it and
     continues. A batch's sequences are a function of (seed, step) alone and the head's start of
     the seed, so a fixed seed gives the same head, resumed or not (on one device and thread
     count). head/ holds the result in the published EAGLE-3 layout; summary.json and log.jsonl
     what it took and how acceptance rose. With `lm_head_int8` the head's LM head is saved as int8
     (save_eagle3_head), and the saved head's acceptance is measured again after the last step.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from outpace.config import SpecConfig
from outpace.engine.llm_engine import resolve_device
from outpace.errors import InvalidParameterError
from outpace.llm import LLM
from outpace.model.draft_head import HeadConfig
from outpace.model.eagle3 import Eagle3Head, default_layers, load_eagle3_head, save_eagle3_head
from outpace.train.draft_vocab import answer_counts, coverage, draft_vocab
from outpace.train.answers import Answers, lm_head_rows
from outpace.train.head_data import generate_shards, load_shards, read_prompts
from outpace.train.self_prompts import self_prompts
from outpace.train.task_prompts import task_prompts
from outpace.weights.hub import shipped_head

DEFAULT_DRAFT_VOCAB = 8192
GRAD_CLIP = 0.5
GROUP_BATCHES = 64      # batches whose sequences are sorted by length together (epoch_batches)
MIN_LR_FRACTION = 0.1
# settings a resumed run must share with the checkpoint it continues
SAME_RUN = ("model", "self_prompts", "file_prompts", "num_prompts", "task_prompts", "held_out", "max_tokens", "max_prompt_tokens", "draft_vocab",
            "ttt_steps", "epochs", "batch_size", "lr", "warmup_steps", "seed", "init_head")


@dataclass
class TrainConfig:
    model: str
    prompts: str | None             # a JSONL file of prompts, or None for the target's own alone
    out: str
    self_prompts: int = 0           # prompts the target writes itself, added to the file's
    file_prompts: int | None = None # the file's prompts used at most (drawn with the seed); None: all
    num_prompts: int = 4000         # prompts answered for training
    task_prompts: int = 0           # prompts built from the training answers (task_prompts.py), trained on too
    held_out: int = 64              # prompts answered for measuring acceptance, never trained on
    max_tokens: int = 256           # answer tokens at most
    max_prompt_tokens: int = 512    # longer chat-formatted prompts are skipped
    # 8192 of the default model's 49152 ids: on the training prompts' own text (a proxy for the
    # answers) the 8192 most frequent ids of one half cover 88% of the other half's tokens (4096:
    # 83%, 16384: 93%), and the LM head, the head's largest matrix, is 6x smaller than the full
    # vocabulary's. The default model's head is then 9.8M parameters, 19.6 MB in bfloat16; 4096
    # makes it 14.9 MB, and so does 8192 with lm_head_int8. None: 8192 for a new head, init_head's own
    draft_vocab: int | None = None
    init_head: str | None = None    # start from this head's folder ("shipped": the model's shipped head)
    ttt_steps: int = 7              # unrolled steps (EAGLE-3's training-time test; SpecForge's default)
    epochs: int = 2                 # the learning rate's schedule spans them
    max_steps: int | None = None    # stop (or pause: a later run resumes) after this many steps; default: the epochs'
    batch_size: int = 16            # sequences a step
    lr: float = 3e-4
    warmup_steps: int = 50
    seed: int = 0
    eval_every: int = 100
    checkpoint_every: int = 100
    device: str = "auto"
    dtype: str = "auto"             # the target's dtype while it answers; the head trains in float32
    max_num_seqs: int = 64          # prompts answered at once
    shard_size: int = 256
    save_dtype: str = "bfloat16"
    lm_head_int8: bool = False      # the saved LM head in int8, a float32 scale a row (save_eagle3_head)

    def __post_init__(self) -> None:
        for name in ("num_prompts", "held_out", "max_tokens", "max_prompt_tokens", "draft_vocab", "ttt_steps",
                     "epochs", "batch_size", "eval_every", "checkpoint_every", "max_num_seqs", "shard_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidParameterError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.file_prompts is not None and self.file_prompts < 0:
            raise InvalidParameterError(f"file-prompts must be >= 0, got {self.file_prompts}")
        if self.task_prompts < 0:
            raise InvalidParameterError(f"task-prompts must be >= 0, got {self.task_prompts}")
        if self.self_prompts < 0:
            raise InvalidParameterError(f"self-prompts must be >= 0, got {self.self_prompts}")
        if self.prompts is None and self.self_prompts == 0:
            raise InvalidParameterError("no prompts to answer: give --prompts FILE, --self-prompts N, or both")
        if self.max_steps is not None and self.max_steps < 0:
            raise InvalidParameterError(f"max-steps must be >= 0, got {self.max_steps}")
        if not 0 < self.lr < 1:
            raise InvalidParameterError(f"lr must be in (0, 1), got {self.lr}")
        if self.save_dtype not in ("bfloat16", "float16", "float32"):
            raise InvalidParameterError(f"save-dtype must be bfloat16, float16 or float32, got {self.save_dtype}")


def train_head(config: TrainConfig) -> dict:
    """Run (or resume) the whole recipe; returns the summary also written to out/summary.json."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    checkpoint = _load_checkpoint(out, config)
    prompts = read_prompts(Path(config.prompts)) if config.prompts is not None else []
    if config.file_prompts is not None and config.file_prompts < len(prompts):
        prompts = random.Random(config.seed).sample(prompts, config.file_prompts)

    # ---- the target's answers -------------------------------------------------------------------
    t0 = time.perf_counter()
    llm = LLM(config.model, spec=SpecConfig(method="none"), device=device, dtype=config.dtype,
              max_num_seqs=config.max_num_seqs, max_model_len=config.max_prompt_tokens + config.max_tokens + 1,
              calibrate=False)
    target = llm.engine.model
    start = None                                        # a head to train further, checked before the answers
    if config.init_head is not None:
        folder = shipped_head(config.model) if config.init_head == "shipped" else Path(config.init_head)
        start = _loaded_head(folder, target, config.max_prompt_tokens + config.max_tokens + config.ttt_steps + 1)
        if config.draft_vocab is not None and config.draft_vocab < start.cfg.draft_vocab_size:
            raise InvalidParameterError(f"the head in {folder} drafts {start.cfg.draft_vocab_size} ids; a vocabulary "
                                        f"only widens: give --draft-vocab {start.cfg.draft_vocab_size} or more, or "
                                        "leave it out")
    if config.self_prompts:
        prompts = prompts + self_prompts(llm, config.self_prompts, config.seed, out / "self_prompts.jsonl")
    order = list(range(len(prompts)))
    random.Random(config.seed).shuffle(order)
    held = [prompts[i] for i in order[:config.held_out]]
    train = [prompts[i] for i in order[config.held_out:config.held_out + config.num_prompts]]
    if not train:
        raise InvalidParameterError(f"{len(prompts)} prompts, all held out: lower --held-out or give more prompts")
    for name, part in (("heldout", held), ("train", train)):
        generate_shards(llm, part, out / "data", name, config.max_tokens, config.max_prompt_tokens, config.shard_size)
    train_seqs, task_seqs, tasks_answered = load_shards(out / "data", "train"), [], 0
    if config.task_prompts:
        tasks = task_prompts(_answered_pairs(llm, train, train_seqs), config.task_prompts, config.seed)
        generate_shards(llm, tasks, out / "data", "task", config.max_tokens, config.max_prompt_tokens, config.shard_size)
        task_seqs = load_shards(out / "data", "task")
        train_seqs = train_seqs + task_seqs
        tasks_answered = len({s.source for s in task_seqs})
        if tasks_answered < len(tasks):
            tqdm.write(f"{len(tasks) - tasks_answered} of {len(tasks)} task prompts were over --max-prompt-tokens "
                       f"({config.max_prompt_tokens}) and were skipped")
    data_s = time.perf_counter() - t0
    held_seqs = sorted(load_shards(out / "data", "heldout"), key=lambda s: len(s.tokens))  # batches of like lengths

    # ---- the head -------------------------------------------------------------------------------
    counts = answer_counts(train_seqs, target.cfg.vocab_size)
    longest = max(len(s.tokens) for s in train_seqs + held_seqs)
    if start is not None:
        head = start if config.draft_vocab is None else widen_vocab(start, target, counts, config.draft_vocab)
        ids, layers = head.to_target(torch.arange(head.cfg.draft_vocab_size)), head.cfg.target_layers
    else:
        ids = draft_vocab(counts, DEFAULT_DRAFT_VOCAB if config.draft_vocab is None else config.draft_vocab)
        layers = default_layers(target.cfg.num_layers)
        head = _new_head(target, layers, ids, longest + config.ttt_steps + 1, config.seed)
    head = head.to(device)
    answers = Answers(target, layers, ids, config.ttt_steps, device, longest, config.batch_size)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    per_epoch = -(-len(train_seqs) // config.batch_size)
    schedule = config.epochs * per_epoch                # the steps the learning rate's schedule spans
    total = config.max_steps if config.max_steps is not None else schedule
    step, log = 0, []
    if checkpoint is not None:
        head.load_state_dict(checkpoint["head"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        step, log = checkpoint["step"], checkpoint["log"]

    def evaluate(model: Eagle3Head = head) -> dict:
        model.eval()
        per_seq = answers.accepted(model, held_seqs, config.batch_size, lambda: _autocast(device))
        model.train()
        accepted, _, positions = (sum(column) for column in zip(*per_seq)) if per_seq else (0, 0, 0)
        return {"step": step, "mean_accepted": accepted / max(positions, 1), "positions": positions}

    # ---- training -------------------------------------------------------------------------------
    t1 = time.perf_counter()
    bar = tqdm(total=total, initial=step, desc="training", unit="step")
    if not log:                                         # the untrained head's acceptance first
        log.append(evaluate())
        tqdm.write(f"step {step}: {log[-1]['mean_accepted']:.3f} drafts accepted a position (held back)")
    head.train()
    lengths = [len(s.tokens) for s in train_seqs]
    batches_epoch, batches = -1, []                     # the current epoch's epoch_batches
    while step < total:
        epoch, i = divmod(step, per_epoch)
        if epoch != batches_epoch:
            batches_epoch, batches = epoch, epoch_batches(lengths, config.batch_size, config.seed, epoch)
        seqs = [train_seqs[j] for j in batches[i]]
        for group in optimizer.param_groups:
            group["lr"] = _lr(config, step, schedule)
        with _autocast(device):
            loss = answers.loss(head, seqs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), GRAD_CLIP)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % config.eval_every == 0 or step == total:
            log.append(evaluate())
            tqdm.write(f"step {step}: {log[-1]['mean_accepted']:.3f} drafts accepted a position (held back)")
        if step % config.checkpoint_every == 0 or step == total:
            _save_checkpoint(out, head, optimizer, step, log, config)
    bar.close()
    train_s = time.perf_counter() - t1

    # ---- the result -----------------------------------------------------------------------------
    save_eagle3_head(head.float(), out / "head", getattr(torch, config.save_dtype), config.model, config.lm_head_int8)
    saved_accepted = log[-1]["mean_accepted"]
    if config.lm_head_int8:             # what the rounding of the LM head costs, as the saved head drafts
        saved_accepted = evaluate(_loaded_head(out / "head", target, longest + config.ttt_steps + 1).to(device))[
            "mean_accepted"]
        tqdm.write(f"the saved head (int8 LM head): {saved_accepted:.3f} drafts accepted a position")
    summary = {
        "target": config.model, "device": str(device), "seed": config.seed, "init_head": config.init_head,
        "train_sequences": len(train_seqs), "task_prompts_answered": tasks_answered,
        "task_sequences": len(task_seqs),
        "train_tokens": sum(len(s.tokens) for s in train_seqs),
        "train_answer_tokens": sum(len(s.tokens) - s.prompt_len for s in train_seqs),
        "held_out_sequences": len(held_seqs), "steps": step, "ttt_steps": config.ttt_steps,
        "saved_head_mean_accepted": saved_accepted,
        "draft_vocab": len(ids), "draft_vocab_coverage_train": coverage(counts, ids),
        "draft_vocab_coverage_held_out": coverage(answer_counts(held_seqs, target.cfg.vocab_size), ids),
        "head_parameters": sum(p.numel() for p in head.parameters()),
        "head_bytes": (out / "head" / "model.safetensors").stat().st_size,
        "data_seconds_this_run": data_s, "train_seconds_this_run": train_s, "acceptance": log,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out / "log.jsonl", "w") as f:
        f.writelines(json.dumps(entry) + "\n" for entry in log)
    return summary


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's batches of sequence indices, a function of (seed, epoch) alone: the sequences
    shuffled, sorted by length within runs of GROUP_BATCHES batches, cut into batches, and the
    batches shuffled. A batch is padded to its longest sequence and the unrolled attention costs
    the square of that; on the default model's data, whose lengths run from about 40 to 770
    tokens, a random batch of 32 is mostly padding (on an H200 about a tenth of a step's time:
    most of a step lies elsewhere)."""
    generator = torch.Generator().manual_seed(seed * 1000003 + epoch)
    perm = torch.randperm(len(lengths), generator=generator).tolist()
    run = batch_size * GROUP_BATCHES
    ordered = [j for r in range(0, len(perm), run) for j in sorted(perm[r:r + run], key=lengths.__getitem__)]
    out = [ordered[b:b + batch_size] for b in range(0, len(ordered), batch_size)]
    return [out[b] for b in torch.randperm(len(out), generator=generator).tolist()]


def _answered_pairs(llm: LLM, prompts: list[str | list[str]], answers: list) -> list[tuple[str, str]]:
    """(question, answer text) of each answer to a first turn: the task prompts' material."""
    pairs = []
    for a in answers:
        if a.turn == 0:
            prompt = prompts[a.source]
            question = prompt if isinstance(prompt, str) else prompt[0]
            pairs.append((question, llm.tokenizer.decode(a.tokens[a.prompt_len:].tolist())))
    return pairs


def _new_head(target, layers: tuple[int, ...], ids: torch.Tensor, max_len: int, seed: int) -> Eagle3Head:
    """A head of the target's layer shape (random weights from the seed), its LM head the target's
    rows of the draft vocabulary, its d2t the vocabulary's offsets."""
    c = target.cfg
    cfg = HeadConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_heads=c.num_heads,
                     num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                     rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, vocab_size=c.vocab_size,
                     draft_vocab_size=len(ids), target_hidden_size=c.hidden_size, target_layers=layers)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, max_len)
    with torch.no_grad():
        head.lm_head.weight.copy_(lm_head_rows(target, ids.to(target.norm.weight.device)).float().cpu())
        head.d2t.copy_(ids - torch.arange(len(ids)))
    return head


def widen_vocab(head: Eagle3Head, target, counts: torch.Tensor, size: int) -> Eagle3Head:
    """The head with a draft vocabulary of `size`: its own ids and the most frequent of the rest by
    counts, in increasing order; its ids keep their LM head rows, the new ones start from the
    target's (as a new head's all do). Its other weights are the head's."""
    if size == head.cfg.draft_vocab_size:
        return head
    own = head.to_target(torch.arange(head.cfg.draft_vocab_size))
    first = counts.clone()
    first[own] = counts.max() + 1                       # the head's own ids ahead of any other
    ids = draft_vocab(first, size)
    widened = Eagle3Head(dataclasses.replace(head.cfg, draft_vocab_size=len(ids)), head.max_positions)
    state = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t")}
    widened.load_state_dict(state, strict=False)
    with torch.no_grad():
        rows = lm_head_rows(target, ids.to(target.norm.weight.device)).float().cpu()
        kept = torch.searchsorted(ids, own)             # where each of the head's ids sits among the new
        rows[kept] = head.lm_head.weight.detach().float()
        widened.lm_head.weight.copy_(rows)
        widened.d2t.copy_(ids - torch.arange(len(ids)))
    return widened.train().requires_grad_(True)


def _loaded_head(folder: Path, target, max_len: int) -> Eagle3Head:
    """The head in `folder`, checked against the target, in float32 and trainable."""
    head = load_eagle3_head(folder, target.cfg, torch.float32, "cpu", max_len)
    if head.embed is not None:      # the trainer reads the target's embedding, frozen and not saved
        raise InvalidParameterError(f"the head in {folder} has an embedding of its own; train-head continues only "
                                    "heads that share the target's")
    return head.train().requires_grad_(True)


def _lr(config: TrainConfig, step: int, schedule: int) -> float:
    """Linear warm-up, then cosine decay to MIN_LR_FRACTION at the schedule's end (and after it)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, schedule - config.warmup_steps)
    return config.lr * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _autocast(device: str):
    """bfloat16 products on CUDA (master weights stay float32); plain float32 elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))


def _save_checkpoint(out: Path, head, optimizer, step: int, log: list, config: TrainConfig) -> None:
    state = {"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "log": log,
             "config": dataclasses.asdict(config)}
    torch.save(state, out / "checkpoint.tmp")
    os.replace(out / "checkpoint.tmp", out / "checkpoint.pt")


def _load_checkpoint(out: Path, config: TrainConfig) -> dict | None:
    path = out / "checkpoint.pt"
    if not path.exists():
        return None
    state = torch.load(path, weights_only=True)
    ours = dataclasses.asdict(config)
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    differ = [k for k in SAME_RUN if state["config"].get(k, defaults[k]) != ours[k]]
    if differ:
        raise InvalidParameterError(f"{out} holds a run with other settings ({', '.join(differ)}): "
                                    f"give another --out, or the same settings to resume it")
    return state
