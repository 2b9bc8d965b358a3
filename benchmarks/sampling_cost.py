"""What sampled verification costs on this machine: sampling.rejection.verify_sampling at 1 and 32
rows and 1 and 9 positions over the default model's vocabulary, against a baseline's (--baseline:
a git revision of this repository, or a folder holding its sampling/sampler.py and rejection.py),
interleaved round by round so a shared machine disturbs both alike. Reports the median
milliseconds of: shaping (logits_to_probs), the whole verification (building the step's sampling
state included), and the rest, the noise and the acceptance rule (verification given the shaped
probabilities).

    python benchmarks/sampling_cost.py --baseline main~1 [--rounds 30] [--threads 2] [--device cuda]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from outpace.config import SamplingParams
from outpace.sampling import rejection, sampler

REPO = Path(__file__).resolve().parents[1]
VOCAB = 49152


def load_baseline(baseline: str):
    """The baseline's (sampler, rejection) modules, from a folder or `git show`, under other names."""
    folder = Path(tempfile.mkdtemp())
    modules = []
    for name in ("sampler", "rejection"):
        if Path(baseline).is_dir():
            source = (Path(baseline) / f"{name}.py").read_text()
        else:
            source = subprocess.run(["git", "-C", str(REPO), "show", f"{baseline}:src/outpace/sampling/{name}.py"],
                                    check=True, capture_output=True, text=True).stdout
        source = source.replace("from outpace.sampling.sampler import", "from baseline_sampler import")
        path = folder / f"baseline_{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"baseline_{name}"] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


def make_state(module, params, device):
    """A module's state for seeded rows: a generator per row (make_generator) where it has one,
    else a seed and a position per row."""
    rows = len(params)
    if hasattr(module, "make_generator"):
        return module.SamplingState.from_params(params, [module.make_generator(i, device) for i in range(rows)],
                                                device)
    return module.SamplingState.from_params(params, list(range(rows)), [100] * rows, device)


def timed(fn, device: str, repeats: int = 3) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision (e.g. main~1) or folder to compare with")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base_sampler, base_rejection = load_baseline(args.baseline)
    device = args.device
    torch.manual_seed(0)
    configs = {"temperature 0.8": SamplingParams(temperature=0.8), "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9)}
    results: dict[tuple, list[float]] = {}
    cases = []
    for label, params in configs.items():
        for rows in (1, 32):
            for positions in (1, 9):
                logits = torch.randn(rows, positions, VOCAB, device=device) * 3
                drafts = torch.randint(0, VOCAB, (rows, positions - 1), device=device)
                num_draft = torch.full((rows,), positions - 1, device=device)
                cases.append((label, params, rows, positions, logits, drafts, num_draft))
    for _ in range(args.rounds):
        for label, params, rows, positions, logits, drafts, num_draft in cases:
            for name, smp, rej in (("baseline", base_sampler, base_rejection), ("new", sampler, rejection)):
                state = make_state(smp, [params] * rows, device)
                shaping = timed(lambda: smp.logits_to_probs(logits, state), device)
                whole = timed(lambda: rej.verify_sampling(logits, drafts, num_draft,
                                                          make_state(smp, [params] * rows, device)), device)
                # the rest alone: verification with shaping replaced by its result
                probs = smp.logits_to_probs(logits, state)
                shape = rej.logits_to_probs
                rej.logits_to_probs = lambda *_: probs
                try:
                    rest = timed(lambda: rej.verify_sampling(logits, drafts, num_draft,
                                                             make_state(smp, [params] * rows, device)), device)
                finally:
                    rej.logits_to_probs = shape
                for part, value in (("shaping", shaping), ("verify", whole), ("noise+accept", rest)):
                    results.setdefault((label, rows, positions, name, part), []).append(value)
    print(f"{device}, torch threads {torch.get_num_threads()}, vocabulary {VOCAB}, {args.rounds} interleaved rounds; "
          "median ms")
    print(f"{'config':<16} {'rows':>4} {'pos':>3} {'part':<13} {'baseline':>9} {'new':>9}")
    for label, _, rows, positions, *_ in cases:
        for part in ("shaping", "verify", "noise+accept"):
            base = statistics.median(results[(label, rows, positions, "baseline", part)])
            new = statistics.median(results[(label, rows, positions, "new", part)])
            print(f"{label:<16} {rows:>4} {positions:>3} {part:<13} {base:>9.3f} {new:>9.3f}")


if __name__ == "__main__":
    main()
