"""32 streaming clients for a bounded time, a third of them leaving mid-stream: nothing is lost.

Every request finishes or is aborted, /metrics' counters add up to what the clients saw, no slot,
stream or sequence is left behind, and the process' memory comes back to within 10% of its size
before the load. One server: the default model in float32, 8 slots, n-gram speculation, greedy and
seeded sampled requests mixed; torch on one thread.
"""
from __future__ import annotations

import gc
import json
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from live_server import MODEL, NUM_SLOTS, Server

NUM_CLIENTS = 32
DURATION_S = 30.0
WARM_S = 10.0
PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colours are", "Water boils at",
           "My favourite book is", "1, 2, 3, 4,", "The quick brown fox", "In the beginning"]


def rss_bytes() -> int:
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("reads the resident set size from /proc")
    line = next(line for line in status.read_text().splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    s = Server()
    yield s
    s.close()
    torch.set_num_threads(threads)


class Tally:
    """What the clients saw, added up under a lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sent = self.completed = self.left = self.errors = 0
        self.completion_tokens = 0

    def add(self, **counts) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


def client_loop(url: str, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=120) as http:
        while time.monotonic() < until:
            sampled = rng.random() < 0.5
            body = {"model": MODEL, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, 40), "stream": True,
                    "temperature": 0.8 if sampled else 0, "seed": rng.randrange(1000) if sampled else None,
                    "ignore_eos": rng.random() < 0.5}
            leave_after = rng.randint(1, 6) if rng.random() < 0.35 else None
            tally.add(sent=1)
            with http.stream("POST", "/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    tally.add(errors=1)
                    continue
                events, usage = 0, None
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    events += 1
                    chunk = json.loads(line[6:])
                    if chunk["choices"][0]["finish_reason"] is not None:
                        usage = chunk["usage"]
                    if leave_after is not None and events >= leave_after and usage is None:
                        break                       # closing the stream disconnects: the server aborts it
            if usage is not None:
                tally.add(completed=1, completion_tokens=usage["completion_tokens"])
            else:
                tally.add(left=1)


def load(url: str, seconds: float, tally: Tally, seed: int = 0) -> None:
    """NUM_CLIENTS client threads for `seconds`."""
    until = time.monotonic() + seconds
    clients = [threading.Thread(target=client_loop, args=(url, seed + i, until, tally)) for i in range(NUM_CLIENTS)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(timeout=seconds + 120)
    assert not any(client.is_alive() for client in clients), "a client hung"


def test_streaming_clients_with_disconnects_lose_nothing(server):
    # warm up first under the same load: allocator caches and lazily built state count as the
    # start's memory (what stays after one load and grows after the next is lost)
    load(server.url, WARM_S, Tally(), seed=NUM_CLIENTS)
    server.wait_health(timeout=30, num_running=0, num_waiting=0)
    gc.collect()
    memory_before = rss_bytes()
    before = {s: server.metric("requests_total", status=s) for s in ("stop", "length", "abort", "error", "rejected")}
    tokens_before = server.metric("generation_tokens_total")

    tally = Tally()
    load(server.url, DURATION_S, tally)
    server.wait_health(timeout=30, num_running=0, num_waiting=0)

    after = {s: server.metric("requests_total", status=s) - n for s, n in before.items()}
    assert tally.errors == 0 and after["error"] == 0 and after["rejected"] == 0
    assert tally.sent == tally.completed + tally.left and tally.left > NUM_CLIENTS // 2 and tally.completed > NUM_CLIENTS
    # each request ends once: finished (what a client read to the end, and some that finished
    # before their client left) or aborted (only clients that left)
    assert after["stop"] + after["length"] + after["abort"] == tally.sent
    assert after["stop"] + after["length"] >= tally.completed and after["abort"] <= tally.left
    assert server.metric("generation_tokens_total") - tokens_before >= tally.completion_tokens

    engine, runner = server.engine, server.app.state.engine
    assert sorted(engine.scheduler.free_slots) == list(range(NUM_SLOTS))
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.sequences
    assert not runner.streams
    gc.collect()
    assert abs(rss_bytes() - memory_before) <= 0.1 * memory_before, (memory_before, rss_bytes())
