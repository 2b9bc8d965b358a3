"""A live OpenAI-compatible server on loopback, in a thread of the test process (so a test can
also reach into its engine), for the server tests."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from outpace.config import EngineConfig
from outpace.engine.llm_engine import LLMEngine
from outpace.server.app import build_app
from outpace.server.config import ServerConfig
from outpace.server.listener import uvicorn_config

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 256
NUM_SLOTS = 8


class Server:
    def __init__(self, num_slots: int = NUM_SLOTS, engine_thread: bool = True, config: ServerConfig | None = None,
                 engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(EngineConfig(model=MODEL, dtype="float32", device="cpu", max_num_seqs=num_slots,
                                                       max_model_len=MAX_MODEL_LEN, calibrate=False))
        self.config = config or ServerConfig(log_interval_s=30.0)
        self.app = build_app(self.engine, MODEL, self.config, engine_thread=engine_thread)
        # without an engine thread of the app's, the caller runs the loop (`outpace serve`: its main thread)
        self.loop = None if engine_thread else threading.Thread(target=self.app.state.engine.run, daemon=True)
        if self.loop is not None:
            self.loop.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))     # a free port, held from now on: no race with other processes
        self.port = sock.getsockname()[1]
        self.url = "http://127.0.0.1:%d" % self.port
        self.server = uvicorn.Server(uvicorn_config(self.app, self.config, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        self.http = httpx.Client(base_url=self.url, timeout=120, headers=headers)

    def client(self, **options):
        import openai
        options.setdefault("api_key", self.config.api_key or "none")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **options)

    def health(self) -> dict:
        return self.http.get("/health").json()

    def wait_health(self, timeout: float = 60, **want) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if all(health[k] == v for k, v in want.items()):
                return health
            assert time.monotonic() < deadline, f"health stayed {health}, wanted {want}"
            time.sleep(0.05)

    def metric(self, name: str, **labels) -> float:
        text = self.http.get("/metrics").text
        want = [f'{k}="{v}"' for k, v in labels.items()]
        for line in text.splitlines():
            if line.startswith(f"outpace:{name}{{") and all(w in line for w in want):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no metric outpace:{name} {labels} in /metrics")

    def close(self):
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)
