"""One benchmark command run in two git revisions of outpace, alternately, in one session.

    python benchmarks/ab_revisions.py --base 4835aa5 --rounds 3 \
        --metric 'spec / plain: ([0-9.]+)x' -- \
        python benchmarks/engine_ab.py --dataset ../shared/data/spec_bench_question.jsonl --concurrency 32

Each revision is checked out once into a temporary git worktree (the working tree's own revision
is `--head`, default the working tree as it stands). Every round runs the command once in each,
the order alternating between rounds so the machine's drift weighs on both alike, each run a fresh
process with that revision's src/ first on PYTHONPATH and its folder as the working directory.
The metric is the first group of the regular expression in the run's stdout; the report gives
each round's pair, and the head's metric over the base's per round and over all rounds.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def checkout(revision: str, into: Path) -> Path:
    done = subprocess.run(["git", "worktree", "add", "--detach", str(into), revision], cwd=REPO,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"ab_revisions: cannot check out {revision}: {done.stderr.strip()}")
    return into


def run_once(folder: Path, command: list[str], metric: re.Pattern) -> float:
    env = os.environ | {"PYTHONPATH": str(folder / "src")}
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    found = metric.search(done.stdout)
    if done.returncode != 0 or found is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise SystemExit(f"ab_revisions: {' '.join(command)} in {folder} exited {done.returncode} "
                         f"without the metric: {' | '.join(tail)}")
    return float(found.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the git revision to compare against")
    p.add_argument("--head", help="the revision measured against it (default: the working tree)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--metric", required=True, help="a regular expression whose first group is the figure")
    p.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command to run in each revision")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.rounds < 1:
        p.error("give a command after -- and at least one round")
    metric = re.compile(args.metric)
    with tempfile.TemporaryDirectory(prefix="outpace-ab-") as scratch:
        folders = {"base": checkout(args.base, Path(scratch) / "base"),
                   "head": checkout(args.head, Path(scratch) / "head") if args.head else REPO}
        try:
            values: dict[str, list[float]] = {"base": [], "head": []}
            for r in range(args.rounds):
                for name in ("base", "head") if r % 2 == 0 else ("head", "base"):
                    values[name].append(run_once(folders[name], command, metric))
                print(f"round {r}: base {values['base'][-1]:.4g}, head {values['head'][-1]:.4g}, "
                      f"head / base {values['head'][-1] / values['base'][-1]:.3f}x", flush=True)
            ratio = sum(values["head"]) / sum(values["base"])
            print(f"head / base: {ratio:.3f}x over {args.rounds} rounds (base {args.base}, head "
                  f"{args.head or 'working tree'})")
        finally:
            for name in ("base", "head") if args.head else ("base",):
                subprocess.run(["git", "worktree", "remove", "--force", str(folders[name])], cwd=REPO,
                               capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
