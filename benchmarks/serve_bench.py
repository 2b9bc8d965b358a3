"""Serving benchmark: drive `outpace serve` over HTTP at several concurrencies, with and without
speculation, in one run.

    python benchmarks/serve_bench.py --dataset ../shared/data/spec_bench_question.jsonl \
        --concurrency 1 4 16 32 --out bench-out/serve

One server (n-gram speculation on) is started for the run; each request asks for speculation or
not through the request field `speculate` (outpace's extension), so both modes share the process,
the weights and the calibrated controller. At each concurrency the same prompts (Spec-Bench first
turns, categories interleaved) run once per mode, the mode that goes first alternating between
levels; `concurrency` clients each keep one streaming chat request in flight. With --rounds 2 (the
default) each level runs the modes in the order A B B A, so drift of the machine's speed during a
level weighs on both alike. Greedy; a request ends at EOS or at --max-tokens, as a client's
request does, and since speculative greedy output equals plain greedy output both modes do the
same work (the script counts the requests whose texts differ between the modes). --ignore-eos
makes every request produce its max_tokens tokens (all --max-tokens, or with --min-tokens a
length per request drawn from the range, the same in both modes): then plain requests of one
length run in lockstep, starting and ending in the same steps, which real traffic never does.

Reported per level and mode: output tokens/s (all output tokens / wall time of the level), output
tokens/s while every client had a request in flight (the server's generated-token counter, read
when the level starts and when the first client finds no request left: the level's end, where
fewer requests remain, is left out), time to first token and time per output token after the
first (median and p99). The first figure is the issue's: all the level's work over its wall time.
The second is shown, not checked, because the two modes' busy phases hold different shares of
the work: with one length for every request, plain requests end in the same step, so a plain
level's busy phase runs to its end, while speculative requests end apart and the busy phase stops
when the last request is taken, holding every prompt's prefill but only part of the decoding
(at 16 clients in the tenth session, 62% of the speculative level's tokens against 99% of the
plain level's), so it reads low for speculation wherever prefill is a large part of the work.
Each round's speedup (its speculative run's tokens/s over its plain run's) is reported beside the
level's: the machine's speed drifts by up to 15% between runs, which at 32 clients is more than
speculation's effect, and the spread says how far one level's figure can be trusted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from outpace.bench.dataset import load_spec_bench


def first_turns(path: str) -> list[str]:
    """Spec-Bench first turns, round-robin over categories so any prefix mixes them."""
    by_category: dict[str, list[str]] = {}
    for record in load_spec_bench(path):
        by_category.setdefault(record.category, []).append(record.turns[0])
    queues = list(by_category.values())
    out = []
    for i in range(max(len(q) for q in queues)):
        out += [q[i] for q in queues if i < len(q)]
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def one_request(client: httpx.AsyncClient, index: int, prompt: str, max_tokens: int, args,
                      speculate: bool) -> dict:
    body = {"model": args.model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": args.ignore_eos, "speculate": speculate,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    usage = None
    text = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            content = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if content:
                first = first or time.perf_counter()
                text.append(content)
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    tokens = usage["completion_tokens"]
    first = first or end
    return {"index": index, "text": "".join(text), "tokens": tokens, "ttft_s": first - started,
            "tpot_s": (end - first) / (tokens - 1) if tokens > 1 else 0.0, "latency_s": end - started}


async def generated_tokens(client: httpx.AsyncClient) -> tuple[float, int]:
    """(now, the server's count of output tokens generated so far)."""
    text = (await client.get("/metrics")).text
    return time.perf_counter(), next(int(float(line.split()[-1])) for line in text.splitlines()
                                     if line.split("{")[0].endswith("generation_tokens_total"))


async def run_level(args, prompts: list[tuple[str, int]], concurrency: int, speculate: bool) -> tuple[list[dict], dict]:
    """Each request's figures and the level's times: wall (the whole level), busy_s and busy_tokens
    (until the first client found no request left); prompts: (text, max_tokens)."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(prompts):
        queue.put_nowait((i, *p))
    results: list[dict] = []
    drained = asyncio.Event()

    async def client_loop(client):
        while not queue.empty():
            results.append(await one_request(client, *queue.get_nowait(), args, speculate))
        drained.set()

    timeout = httpx.Timeout(None)
    async with httpx.AsyncClient(base_url=args.url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        started, tokens_before = await generated_tokens(client)
        clients = asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        await drained.wait()
        busy_until, tokens_busy = await generated_tokens(client)
        await clients
        wall = time.perf_counter() - started
    return results, {"wall_s": wall, "busy_s": busy_until - started, "busy_tokens": tokens_busy - tokens_before}


def round_speedups(level: dict) -> str:
    return ", ".join(f"{x:.2f}x" for x in level["round_speedups"])


def summarize(results: list[dict], times: dict) -> dict:
    ttft = [r["ttft_s"] for r in results]
    tpot = [r["tpot_s"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "output_tokens": tokens, **times, "tokens_per_s": tokens / times["wall_s"],
            "busy_tokens_per_s": times["busy_tokens"] / times["busy_s"], "busy_share": times["busy_tokens"] / tokens,
            "ttft_median_s": statistics.median(ttft), "ttft_p99_s": percentile(ttft, 0.99),
            "tpot_median_s": statistics.median(tpot), "tpot_p99_s": percentile(tpot, 0.99)}


def start_server(args) -> subprocess.Popen:
    try:
        httpx.get(f"{args.url}/health", timeout=2)
        raise SystemExit(f"serve_bench: something already listens on port {args.port}; stop it or pass --port")
    except httpx.HTTPError:
        pass
    cmd = [sys.executable, "-m", "outpace.cli", "serve", "--model", args.model, "--port", str(args.port),
           "--max-num-seqs", str(max(args.concurrency)), "--spec", "ngram", "--log-interval", "60",
           "--no-prefix-caching"]      # each round sends the same prompts: a later one would find them cached
    cmd += args.server_args
    log = open(Path(args.out) / "server.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    deadline = time.time() + args.start_timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"serve_bench: the server exited (code {server.returncode}); see {log.name}")
        try:
            if httpx.get(f"{args.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.terminate()
    raise SystemExit(f"serve_bench: the server did not come up in {args.start_timeout} s; see {log.name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", required=True, help="Spec-Bench JSONL (question_id, category, turns)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level and mode (default: max(8, 2 x concurrency))")
    p.add_argument("--rounds", type=int, default=2, help="times each level runs each mode, the order alternating")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request produces its max_tokens tokens (default: requests end at EOS, as "
                        "clients' do)")
    p.add_argument("--min-tokens", type=int, default=None,
                   help="draw each request's max_tokens from [min-tokens, max-tokens] (default: all max-tokens)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--start-timeout", type=float, default=600, help="seconds to wait for the server (first start "
                   "may convert the model and calibrate)")
    p.add_argument("--out", default="bench-out/serve")
    p.add_argument("server_args", nargs="*", help="extra `outpace serve` options, after --")
    args = p.parse_args()
    if args.min_tokens is not None and not 1 <= args.min_tokens <= args.max_tokens:
        p.error(f"--min-tokens must be in [1, --max-tokens = {args.max_tokens}], got {args.min_tokens}")
    args.url = f"http://127.0.0.1:{args.port}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    prompts = first_turns(args.dataset)
    server = start_server(args)
    levels: list[dict] = []
    try:
        asyncio.run(run_level(args, [(p, args.max_tokens) for p in prompts[:2]], 2, True))   # warm-up, untimed
        for index, c in enumerate(args.concurrency):
            n = args.requests or max(8, 2 * c)
            # each request's length: max_tokens, or drawn from [min_tokens, max_tokens] by its place
            # in the level (the same in both modes)
            lengths = random.Random(index)
            batch = [(prompts[(index * 7 + i) % len(prompts)],
                      lengths.randint(args.min_tokens or args.max_tokens, args.max_tokens)) for i in range(n)]
            level = {"concurrency": c}
            runs = {mode: ([], dict.fromkeys(("wall_s", "busy_s", "busy_tokens"), 0)) for mode in (False, True)}
            per_round = {"plain": [], "spec": []}       # each round's output tokens/s: the spread drift makes
            for round_ in range(args.rounds):
                for speculate in ((False, True) if (index + round_) % 2 == 0 else (True, False)):
                    results, times = asyncio.run(run_level(args, batch, c, speculate))
                    per_round["spec" if speculate else "plain"].append(sum(r["tokens"] for r in results) / times["wall_s"])
                    runs[speculate][0].extend(dict(r, round=round_) for r in results)
                    for key, value in times.items():
                        runs[speculate][1][key] += value
            for speculate, (results, times) in runs.items():
                level["spec" if speculate else "plain"] = summarize(results, times)
            texts = {mode: {(r["round"], r["index"]): r["text"] for r in runs[mode][0]} for mode in runs}
            level["round_tokens_per_s"] = per_round
            level["round_speedups"] = [s / p for p, s in zip(per_round["plain"], per_round["spec"])]
            level["differing_outputs"] = sum(texts[True][key] != text for key, text in texts[False].items())
            for key in ("tokens_per_s", "busy_tokens_per_s"):
                level[key.replace("tokens_per_s", "speedup")] = level["spec"][key] / level["plain"][key]
            levels.append(level)
            print(f"concurrency {c}: plain {level['plain']['tokens_per_s']:.1f} tok/s, "
                  f"speculative {level['spec']['tokens_per_s']:.1f} tok/s ({level['speedup']:.2f}x); while "
                  f"all {c} clients were busy: {level['plain']['busy_tokens_per_s']:.1f} / "
                  f"{level['spec']['busy_tokens_per_s']:.1f} tok/s ({level['busy_speedup']:.2f}x); each round's "
                  f"speedup: {round_speedups(level)}; outputs "
                  f"differing between the modes: {level['differing_outputs']}", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    report(args, levels)


def report(args, levels: list[dict]) -> None:
    ms = 1000
    lines = ["| concurrency | mode | requests | output tokens | output tok/s | speedup | tok/s, all clients busy "
             "| speedup | tokens in that phase | TTFT median / p99 (ms) | TPOT median / p99 (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for level in levels:
        for mode in ("plain", "spec"):
            r = level[mode]
            speedups = [f"{level[key]:.2f}x" if mode == "spec" else "" for key in ("speedup", "busy_speedup")]
            lines.append(f"| {level['concurrency']} | {'speculative' if mode == 'spec' else 'plain'} | {r['requests']} | "
                         f"{r['output_tokens']} | {r['tokens_per_s']:.1f} | {speedups[0]} | {r['busy_tokens_per_s']:.1f} | {speedups[1]} | "
                         f"{r['busy_share']:.0%} | "
                         f"{r['ttft_median_s'] * ms:.0f} / {r['ttft_p99_s'] * ms:.0f} | "
                         f"{r['tpot_median_s'] * ms:.1f} / {r['tpot_p99_s'] * ms:.1f} |")
    by_c = {level["concurrency"]: level for level in levels}
    checks = {}
    for c in by_c:
        checks[f"speculative >= plain at concurrency {c}"] = by_c[c]["speedup"] >= 1.0
    if 1 in by_c:
        checks["speculative >= 1.3x plain at concurrency 1"] = by_c[1]["speedup"] >= 1.3
        if 16 in by_c:
            scale = max(by_c[16]["plain"]["tokens_per_s"], by_c[16]["spec"]["tokens_per_s"]) / by_c[1]["plain"]["tokens_per_s"]
            checks[f"concurrency 16 total >= 4x concurrency 1 plain ({scale:.2f}x)"] = scale >= 4.0
    differing = sum(level["differing_outputs"] for level in levels)
    rounds = "\n".join(f"- concurrency {level['concurrency']}, each round's speedup: {round_speedups(level)}"
                       for level in levels)
    table = "\n".join(lines) + (f"\n\n{rounds}\n\nOutputs differing between the modes: {differing} of "
                                f"{sum(level['plain']['requests'] for level in levels)} requests.")
    targets = "\n".join(f"- {name}: {'met' if ok else 'MISSED'}" for name, ok in checks.items())
    print(f"\n{table}\n\n{targets}")
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps({"config": {k: v for k, v in vars(args).items()}, "levels": levels,
                                                   "checks": checks}, indent=1))
    (out / "results.md").write_text(f"{table}\n\n{targets}\n")
    print(f"written: {out / 'results.json'}, {out / 'results.md'}")


if __name__ == "__main__":
    main()
