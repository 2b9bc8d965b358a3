"""Measure the verify cost curve T(batch, tokens per row) that the draft controller trades off.

The curve depends only on the model's shapes, the dtype, the device (a GPU by its name), the thread
count and the build of the CPU kernels, so it is measured once and kept in `<outpace
home>/calibration/`; delete that folder to measure again. A CPU is named by its flags, which
machines of other speeds may share (a home folder shared by a cluster's nodes): there, delete the
folder after moving to another machine.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from outpace.runner.model_runner import ModelRunner, Row
from outpace.kernels import cpu_kernels
from outpace.kernels.cpu_linear import QuantizedLinear
from outpace.paths import outpace_home

CONTEXT = 128   # positions the timing rows sit at: a typical short context
# part of the key a measurement is kept under: raised when what a forward runs changes outside the
# CPU kernels' source (2: decode and verify forwards of more than 64 tokens moved onto the kernels)
# or how it is measured (4: shapes in rounds; 5: rounds until each shape's least time is settled)
VERSION = 5
# a shape's least time is settled once a second round came within this factor of it; one that no
# other round repeats was the one round a slow spell missed, or a fluke, and rounds past reps measure
# such shapes again (at most MAX_ROUNDS rounds in all). 1.05 left the default model's curve
# unsettled in 2 of 3 starts on a quiet 2-core machine; 1.10 settled 5 of 5 there
SETTLED = 1.10
MAX_ROUNDS = 8


def batch_buckets(max_seqs: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_seqs]
    return buckets + [max_seqs]


def measure_verify_cost(runner: ModelRunner, max_seqs: int, num_draft_tokens: int, reps: int = 3) -> dict[int, list]:
    """The forward's cost by batch-size bucket b, best of reps seconds. A runner that pads rows to
    the longest (CUDA graphs, exact mode): cost[b][s-1] for b rows of s tokens. A runner that
    packs rows: cost[b] = [[e, seconds], ...] for b rows holding e drafted tokens in all (drafts
    of num_draft_tokens tokens in as few rows as hold them: a step's extra tokens cost what they cost,
    plus what splitting attention costs), e = 0..num_draft_tokens (one row's draft), then doubling up
    to b*num_draft_tokens. Runs before
    any request is admitted: it writes scratch keys into the slots it uses, which later prefills
    overwrite."""
    # a graph step's drafter part (a head's chains, a lookup) and the hidden states it writes cost
    # time in every forward measured here: an engine with another drafter measures its own
    extension = getattr(runner, "extension", None)
    drafting = [extension.cost_key, list(runner.hidden_layers)] if extension is not None else list(
        getattr(runner, "hidden_layers", ()))
    return {int(b): never_falling(curve, runner.packs_rows) for b, curve in kept(
        runner, [max_seqs, num_draft_tokens + 1] + ([drafting] if drafting else []),
        lambda: _measure(runner, max_seqs, num_draft_tokens, reps)).items()}


def never_falling(curve: list, packed: bool) -> list:
    """A bucket's curve with each point at most any later point's seconds: a step of fewer tokens
    never has to cost more than one of more (it could be padded to it), so a point above a later
    one was measured in a slow spell that every round met, and would be kept as the machine's
    price of drafting that deep. Applied as a kept measure is read, so curves kept before benefit
    too."""
    seconds = [point[1] for point in curve] if packed else list(curve)
    for i in range(len(seconds) - 2, -1, -1):
        seconds[i] = min(seconds[i], seconds[i + 1])
    return [[point[0], t] for point, t in zip(curve, seconds)] if packed else seconds


def kept(runner: ModelRunner, key: list, measure):
    """measure()'s result (JSON), kept in the calibration folder under what it depends on: the
    runner's model shapes, dtype, device (a GPU's name: an H100 and an H200 step at other speeds),
    threads, torch, kind of runner, kernels' build and weight types, and `key`; measured where no
    run on this machine kept it yet. measure() returns (result, settled): a result that is not
    settled (the machine too busy to time) serves this run and is measured again at the next."""
    kernels = cpu_kernels.build_key() if runner.device.type == "cpu" and cpu_kernels.has_library() else None
    card = torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else None
    quantized = sorted({m.qtype for m in runner.model.modules() if isinstance(m, QuantizedLinear)})
    whole = json.dumps([dataclasses.asdict(runner.model.cfg), str(runner.dtype), str(runner.device),
                        torch.get_num_threads(), torch.__version__, type(runner).__name__, runner.packs_rows, kernels,
                        VERSION] + ([quantized] if quantized else []) + ([card] if card else []) + key,
                       sort_keys=True, default=str)
    path = outpace_home() / "calibration" / f"{hashlib.sha256(whole.encode()).hexdigest()[:16]}.json"
    if path.exists():
        return json.loads(path.read_text())
    result, settled = measure()
    if settled:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
    else:
        # on stderr, with the progress bar: stdout may be the command's output (generate --json)
        tqdm.write("outpace: this machine was too busy to time its forwards steadily; the costs measured "
                   "serve this run and are measured again at the next start", file=sys.stderr)
    return result


def _measure(runner: ModelRunner, max_seqs: int, num_draft_tokens: int, reps: int) -> tuple[dict[int, list], bool]:
    """(the forward's cost by shape, whether every shape's best is settled): at least reps rounds
    of every shape, then, where reps >= 2, rounds of the shapes whose best no other round repeated
    (SETTLED), up to MAX_ROUNDS."""
    draft = num_draft_tokens
    if runner.packs_rows:
        shapes = [(b, e) for b in batch_buckets(max_seqs)
                  for e in sorted(set(range(draft + 1)) | {b * draft} | {2 ** i for i in range(16) if 2 ** i < b * draft})]
    else:
        shapes = [(b, b * (s - 1)) for b in batch_buckets(max_seqs) for s in range(1, num_draft_tokens + 2)]
    runner.forward([Row(0, [0] * (num_draft_tokens + 1), CONTEXT)])          # warm-up: first calls allocate
    runner.cache.commit([0], [0])
    if runner.packs_rows:
        layouts = [[Row(slot, [0] * (1 + min(draft, max(0, extra - slot * draft))), CONTEXT) for slot in range(b)]
                   for b, extra in shapes]
    else:
        layouts = [[Row(slot, [0] * (1 + extra // b), CONTEXT) for slot in range(b)] for b, extra in shapes]
    # every shape once a round, rounds one after another: a slow spell of a shared machine then
    # raises one round's times, which the best of the rounds leaves out, rather than every time of
    # the few shapes measured during it, which skews the curve the draft controller reads (shape
    # after shape, a Qwen2.5-Coder-1.5B verify of 3 drafts read 1.29 and 1.77 plain forwards in
    # two calibrations on a 2-core machine). A spell that spans every round but one still skews it:
    # a kept default-model curve read 5.3 ms at 4 drafted tokens against 7.7-8.4 ms at 0 to 3, which
    # never_falling then read at 5.3, so drafting up to 4 tokens looked free on that machine for
    # good; rounds past reps measure such shapes again until a second time repeats their least
    times: list[list[float]] = [[] for _ in shapes]
    todo = list(range(len(shapes)))
    with tqdm(total=reps * len(shapes), desc="outpace: measuring verify cost (once per model and machine)",
              leave=False) as progress:
        for round_ in range(MAX_ROUNDS):
            if round_ >= reps:
                todo = [i for i in todo if not settled(times[i])]
                if reps < 2 or not todo:
                    break
                progress.total += len(todo)
            for i in todo:
                rows = layouts[i]
                t0 = time.perf_counter()
                runner.forward(rows)
                runner.cache.commit([r.slot for r in rows], [0] * len(rows))     # a recurrent model's rollback
                if runner.device.type == "cuda":
                    torch.cuda.synchronize(runner.device)
                times[i].append(time.perf_counter() - t0)
                progress.update()
    cost: dict[int, list] = {}
    for (b, extra), seconds in zip(shapes, times):
        seconds = best(seconds)
        cost.setdefault(b, []).append([extra, seconds] if runner.packs_rows else seconds)
    return cost, reps < 2 or all(settled(t) for t in times)


def settle(time_once: Callable[[], float], reps: int) -> tuple[float, bool]:
    """One shape's seconds, as _measure reads a shape: at least reps timings (time_once()), then
    more, up to MAX_ROUNDS, until a second repeats the least; (best's reading, whether it settled).
    Where reps < 2 the one timing is taken as settled."""
    times = [time_once() for _ in range(reps)]
    while reps >= 2 and len(times) < MAX_ROUNDS and not settled(times):
        times.append(time_once())
    return best(times), reps < 2 or settled(times)


def settled(times: list[float]) -> bool:
    """Whether a second time lies within SETTLED of the least one."""
    return len(times) > 1 and sorted(times)[1] <= SETTLED * min(times)


def best(times: list[float]) -> float:
    """A shape's seconds: its least time where settled (or measured once), else the least that two
    rounds reached, the level the other shapes were measured at in the same spell: a lone fast
    time set against the others' slow ones would price this shape's drafts below theirs."""
    return min(times) if len(times) < 2 or settled(times) else sorted(times)[1]
