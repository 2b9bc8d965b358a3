"""The draft controller's host work per engine step, at a given number of rows, without a model.

    python benchmarks/controller_costs.py --rows 32 4 [--steps 400] [--repeats 5] [--baseline ../base/src]

Each step does what the engine asks of the controller for R speculating rows: their remaining
tokens, the paid lengths (with setups: some rows' drafter must first catch up) and the free ones (a
chain's lookup), one observation per row (random acceptance and match lengths), the step's cost and
its host work. Inputs come from a seeded generator before the clock starts. Prints the fastest
repeat's microseconds a step and a digest of every decision, which must be equal between two
revisions that claim to decide alike. --baseline SRC times another checkout's controller (its src
folder) in the same run, alternating with this one.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import random
import sys
import time
from pathlib import Path

DRAFT = 8           # positions a draft may have
BUCKETS = (1, 2, 4, 8, 16, 32)


def controller_class(src: Path | None):
    if src is None:
        from outpace.speculative.controller import DraftController
        return DraftController
    spec = importlib.util.spec_from_file_location("baseline_controller", Path(src) / "outpace/speculative/controller.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.DraftController


def run(cls, rows: int, steps: int, seed: int = 0) -> tuple[float, str]:
    """(seconds a step in the controller's calls, digest of its decisions)"""
    rng = random.Random(seed)
    buckets = [b for b in BUCKETS if b <= rows] or [1]
    cost = {b: [1e-3 * (1 + 0.02 * b + 0.01 * s * b) for s in range(DRAFT + 1)] for b in buckets}
    c = cls(DRAFT, cost, draft_cost=lambda b: 2e-4 / b)
    ids, spent, digest = list(range(rows)), 0.0, hashlib.sha256()
    for _ in range(steps):
        setup = [rng.choice([0.0, 0.0, 0.002, 0.05]) for _ in ids]
        outputs = [rng.randrange(0, 100) for _ in ids]
        u = [rng.random() for _ in ids]
        match = [rng.choice([0, 0, 1, 2, 3]) for _ in ids]
        seconds, ends = 1e-3 * (1 + rng.random()), rng.random() < 0.02
        t0 = time.perf_counter()
        remaining = [c.remaining(n, 200) for n in outputs]
        paid = c.row_lengths(ids, rows, setup, remaining, True)
        free = c.row_lengths(ids, rows, None, None, False)
        for i, s in enumerate(ids):
            k = max(paid[i], free[i])
            c.observe(s, k, k, int(u[i] * (k + 1)) if k else 0, match[i])
        c.observe_step(rows, rows * (1 + max(paid + free)), seconds, sum(paid))
        c.observe_tokens(rows + 3, 1e-4)
        spent += time.perf_counter() - t0
        if ends:                        # a sequence ends and a new one takes its row
            s = ids[int(u[0] * len(ids))]
            c.end(s, 10 + outputs[0])
            ids[ids.index(s)] = max(ids) + 1
        digest.update(repr((paid, free, c.pays_setup(0.01, 100, rows, ids[0]))).encode())
    return spent / steps, digest.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[32, 4])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline", type=Path, help="another checkout's src folder, timed alongside")
    args = p.parse_args()
    classes = {"this": controller_class(None)}
    if args.baseline:
        classes["baseline"] = controller_class(args.baseline)
    for rows in args.rows:
        best = {name: float("inf") for name in classes}
        digests = {}
        for _ in range(args.repeats):
            for name, cls in classes.items():
                seconds, digests[name] = run(cls, rows, args.steps)
                best[name] = min(best[name], seconds)
        print(f"{rows} rows: " + "; ".join(f"{name} {best[name] * 1e6:.1f} us a step (decisions {digests[name]})"
                                           for name in classes))


if __name__ == "__main__":
    main()
