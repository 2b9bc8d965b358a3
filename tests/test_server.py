"""The OpenAI-compatible server, live on loopback, driven by the official `openai` client.

One module-scoped server (float32, 8 slots, n-gram speculation) runs in a thread of this process,
so a test can also inject a fault into its engine. torch runs on one thread here: the CPU is shared
and these tests check behaviour, not speed.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from outpace.cli import build_parser, serve_config  # noqa: E402
from live_server import MAX_MODEL_LEN, MODEL, NUM_SLOTS, Server  # noqa: E402


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    s = Server()
    yield s
    s.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def greedy(**extra) -> dict:
    return dict(model=MODEL, temperature=0, **extra)


# ---- the happy paths --------------------------------------------------------------------------

def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert server.health() == {"status": "ok", "model": MODEL, "num_running": 0, "num_waiting": 0}


def test_completion_streamed_equals_unstreamed(server, client):
    prompt = "The capital of France is"
    whole = client.completions.create(prompt=prompt, max_tokens=10, **greedy())
    choice = whole.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    usage = whole.usage
    assert usage.prompt_tokens == len(server.engine.tokenizer.encode(prompt))
    assert 1 <= usage.completion_tokens <= 10
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.model_extra["speculation"]
    assert {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length"} <= spec.keys()
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]

    chunks = list(client.completions.create(prompt=prompt, max_tokens=10, stream=True, **greedy()))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id


def test_chat_streamed_equals_unstreamed(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(messages=messages, max_completion_tokens=12, **greedy())
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert whole.usage.completion_tokens <= 12 and "speculation" in whole.usage.model_extra

    chunks = list(client.chat.completions.create(messages=messages, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    # include_usage: OpenAI's layout, a last chunk with no choices carrying usage
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def test_content_parts_format_like_a_string(client):
    as_text = client.chat.completions.create(messages=[{"role": "user", "content": "Hi there"}], max_tokens=4,
                                             **greedy())
    as_parts = client.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
        max_tokens=4, **greedy())
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content


def test_a_conversations_next_turn_reports_its_cached_prompt(server, client):
    """The second turn starts from the keys the first left in its slot: usage says how many, and
    /metrics counts them; another cache_salt finds none of them."""
    before = server.metric("prompt_tokens_cached_total")
    messages = [{"role": "user", "content": "Count from one to five."}]
    first = client.chat.completions.create(messages=messages, max_tokens=8, extra_body={"cache_salt": "t"}, **greedy())
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And back down?"}]
    cached = {salt: client.chat.completions.create(messages=messages, max_tokens=4, extra_body={"cache_salt": salt},
                                                   **greedy()).usage.prompt_tokens_details.cached_tokens
              for salt in ("other", "t")}
    assert cached["other"] == 0 and first.usage.prompt_tokens < cached["t"] < first.usage.prompt_tokens + 8
    deadline = time.monotonic() + 5          # a request is counted as it leaves the engine, after its reply
    while server.metric("prompt_tokens_cached_total") - before < cached["t"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("prompt_tokens_cached_total") - before >= cached["t"]


def test_stop_string_cuts_the_text(client):
    prompt = "Count: one, two, three, four,"
    free = client.completions.create(prompt=prompt, max_tokens=16, **greedy()).choices[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = words[2]
    expected = free[:free.index(stop)]
    for stream in (False, True):
        out = client.completions.create(prompt=prompt, max_tokens=16, stop=[stop, "\u2603"], stream=stream, **greedy())
        if stream:
            chunks = list(out)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (text, reason) == (expected, "stop")


def test_tiny_temperature_is_greedy(client):
    """Guards: temperature 1e-38 returned empty text with completion_tokens == max_tokens (NaN
    probabilities). A tiny temperature gives its limit: the greedy text."""
    prompt = dict(prompt="The capital of France is", max_tokens=8, model=MODEL)
    expected = client.completions.create(temperature=0, **prompt).choices[0].text
    for temperature in (1e-38, 1e-300, 5e-324):
        assert client.completions.create(temperature=temperature, **prompt).choices[0].text == expected


def test_completion_logprobs(server, client):
    """Each token's logprob and its alternatives in the legacy layout, streamed as unstreamed, a
    speculative request's as a plain one's (the same forwards but for the rows beside them)."""
    prompt = "The capital of France is"
    runs = {}
    for name, extra in (("spec", {}), ("plain", {"speculate": False})):
        whole = client.completions.create(prompt=prompt, max_tokens=12, logprobs=3, extra_body=extra, **greedy())
        runs[name] = whole.choices[0].logprobs
    logprobs, text = runs["spec"], whole.choices[0].text
    assert len(logprobs.tokens) == whole.usage.completion_tokens == len(logprobs.token_logprobs)
    assert "".join(logprobs.tokens) == text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0 and top[token] == value and 1 <= len(top) <= 4
        assert value == max(top.values()), "greedy: the emitted token is the likeliest"
    assert runs["plain"].tokens == logprobs.tokens
    assert runs["plain"].token_logprobs == pytest.approx(logprobs.token_logprobs, abs=1e-4)

    chunks = list(client.completions.create(prompt=prompt, max_tokens=12, logprobs=3, stream=True, **greedy()))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == logprobs.tokens
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == logprobs.text_offset


def test_chat_logprobs(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(messages=messages, max_tokens=12, logprobs=True, top_logprobs=2,
                                           **greedy())
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert bytes(b for t in content for b in t.bytes).decode() == whole.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 2 and token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.top_logprobs[0].token == token.token and token.top_logprobs[0].logprob == token.logprob
    chunks = list(client.chat.completions.create(messages=messages, max_tokens=12, logprobs=True, stream=True,
                                                 **greedy()))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert all(t.top_logprobs == [] for t in streamed)
    plain = client.chat.completions.create(messages=messages, max_tokens=12, **greedy())
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == whole.choices[0].message.content


def test_echo_scores_the_prompt(server, client):
    """echo with logprobs, as lm-evaluation-harness scores a text: the prompt's tokens come first
    (the first without a logprob), each scored as the model predicts it; a token the model
    generated after a prompt scores as it does when echoed at the end of that prompt."""
    tokenizer = server.engine.tokenizer
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = tokenizer.encode(prompt)
    whole = client.completions.create(prompt=prompt, max_tokens=1, logprobs=1, echo=True, **greedy())
    choice = whole.choices[0]
    generated = client.completions.create(prompt=prompt, max_tokens=1, logprobs=1, **greedy()).choices[0]
    assert choice.text == prompt + generated.text
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.token_text(t) for t in ids] + generated.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert lp.token_logprobs[-1] == pytest.approx(generated.logprobs.token_logprobs[0], abs=1e-4)
    token = tokenizer.encode(generated.text)
    assert len(token) == 1, generated.text
    longer = client.completions.create(prompt=ids + token, max_tokens=1, logprobs=0, echo=True,
                                       **greedy()).choices[0]
    assert longer.logprobs.token_logprobs[len(ids)] == pytest.approx(generated.logprobs.token_logprobs[0], abs=1e-3)
    chunks = list(client.completions.create(prompt=prompt, max_tokens=1, logprobs=1, echo=True, stream=True,
                                            **greedy()))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] == \
        pytest.approx(lp.token_logprobs, abs=1e-4)
    plain = client.completions.create(prompt=ids, max_tokens=3, echo=True, **greedy()).choices[0]
    assert plain.text.startswith(tokenizer.decode(ids)) and plain.logprobs is None


def test_n_choices(client):
    """n choices sample apart, choice i as a request with seed s + i would; streamed, each
    choice's chunks carry its index, and usage counts the prompt once and every choice's tokens."""
    ask = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=50)
    whole = client.completions.create(n=3, **ask)
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert [c.index for c in whole.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [client.completions.create(**{**ask, "seed": 50 + i}).choices[0].text for i in range(3)]
    alone = client.completions.create(**ask).usage
    assert whole.usage.prompt_tokens == alone.prompt_tokens
    assert whole.usage.completion_tokens == whole.usage.total_tokens - alone.prompt_tokens <= 30
    spec = whole.usage.model_extra["speculation"]
    assert spec["num_verify_steps"] >= 1 and 1 <= spec["mean_acceptance_length"]

    chunks = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **ask))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2,
                                          logprobs=True, **greedy())
    assert chat.choices[0].message.content == chat.choices[1].message.content
    assert all(len(c.logprobs.content) == chat.usage.completion_tokens // 2 for c in chat.choices)


def test_a_batch_of_prompts(server, client):
    """Several prompts in one request (texts or token ids): choice index prompt * n + j, each as the
    prompt alone gives it, echoed where asked; usage counts each prompt once."""
    tokenizer = server.engine.tokenizer
    prompts = ["The capital of France is", "One, two, three,", "Water boils at"]
    alone = [client.completions.create(prompt=p, max_tokens=6, **greedy()) for p in prompts]
    batch = client.completions.create(prompt=[tokenizer.encode(p) for p in prompts], max_tokens=6, n=2, echo=True,
                                      **greedy())
    assert [c.index for c in batch.choices] == list(range(6))
    for c in batch.choices:
        i = c.index // 2
        assert c.text == tokenizer.decode(tokenizer.encode(prompts[i])) + alone[i].choices[0].text
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    chunks = list(client.completions.create(prompt=prompts, max_tokens=6, logprobs=1, stream=True, **greedy()))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert texts == [a.choices[0].text for a in alone]


def test_penalties_change_a_repetitive_answer(client):
    prompt = "Hello hello hello hello hello hello"
    free = client.completions.create(prompt=prompt, max_tokens=12, **greedy()).choices[0].text
    assert free.count("hello") >= 6, free
    for penalty in (dict(frequency_penalty=2.0), dict(extra_body={"repetition_penalty": 3.0})):
        text = client.completions.create(prompt=prompt, max_tokens=12, **penalty, **greedy()).choices[0].text
        assert text.count("hello") < free.count("hello"), (penalty, text)


def test_logit_bias_and_min_tokens(server, client):
    """-100 bars the token a greedy answer starts with (in chat too); min_tokens keeps a chat answer
    going past the end-of-turn token it stopped on, and its usage counts them."""
    tokenizer = server.engine.tokenizer
    prompt = "The capital of France is"
    free = client.completions.create(prompt=prompt, max_tokens=6, logprobs=0, **greedy()).choices[0]
    first = tokenizer.encode(free.logprobs.tokens[0])[0]
    barred = client.completions.create(prompt=prompt, max_tokens=6, logit_bias={str(first): -100}, logprobs=0,
                                       **greedy()).choices[0]
    assert barred.logprobs.tokens[0] != free.logprobs.tokens[0] and barred.text != free.text
    messages = [{"role": "user", "content": "Say yes."}]
    short = client.chat.completions.create(messages=messages, max_tokens=200, **greedy())
    assert short.choices[0].finish_reason == "stop", "the answer must end on its own"
    done = short.usage.completion_tokens
    longer = client.chat.completions.create(messages=messages, max_tokens=done + 10,
                                            extra_body={"min_tokens": done + 5}, **greedy())
    assert longer.usage.completion_tokens >= done + 5
    assert longer.choices[0].message.content.startswith(short.choices[0].message.content)
    first = tokenizer.encode(short.choices[0].message.content)[0]
    chat_barred = client.chat.completions.create(messages=messages, max_tokens=8, logit_bias={str(first): -100},
                                                 **greedy())
    assert tokenizer.encode(chat_barred.choices[0].message.content)[0] != first


def test_a_request_without_model_means_the_served_one(server):
    reply = server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["model"] == MODEL


def test_same_seed_same_sample(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0,
                                         top_p=0.95, seed=seed, extra_body={"top_k": 50}).choices[0].text
    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2)), "three seeds gave one text: is the seed ignored?"


# ---- bad input --------------------------------------------------------------------------------

LONG_PROMPT = "word " * (2 * MAX_MODEL_LEN)
BAD_COMPLETIONS = [
    ("malformed JSON", b'{"model": "smollm2-135m", "prompt": ', 400, None),
    ("not an object", [1, 2], 400, None),
    ("missing prompt", {"model": MODEL}, 400, "prompt"),
    ("prompt wrong type", {"model": MODEL, "prompt": 12}, 400, "prompt"),
    ("empty prompt", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("too many prompts", {"model": MODEL, "prompt": ["a"] * 65}, 400, "prompt"),
    ("prompts times n too many", {"model": MODEL, "prompt": ["a"] * 9, "n": 8}, 400, "n"),
    ("a prompt of the batch empty", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt"),
    ("a prompt of the batch wrong type", {"model": MODEL, "prompt": [[1, 2], [3, "x"]]}, 400, "prompt"),
    ("max_tokens wrong type", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens zero", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens beyond context", {"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("prompt beyond context", {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
    ("token id out of vocabulary", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt"),
    ("temperature negative", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("temperature above 2", {"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("temperature 1e308", {"model": MODEL, "prompt": "hi", "temperature": 1e308}, 400, "temperature"),
    ("too many stop strings", {"model": MODEL, "prompt": "hi", "stop": ["a"] * 17}, 400, "stop"),
    ("stop string too long", {"model": MODEL, "prompt": "hi", "stop": ["a" * 257]}, 400, "stop"),
    ("top_p zero", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p bool", {"model": MODEL, "prompt": "hi", "top_p": True}, 400, "top_p"),
    ("seed wrong type", {"model": MODEL, "prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("stop empty", {"model": MODEL, "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("stream wrong type", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("n above 16", {"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
    ("n zero", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("logprobs above 20", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("logprobs negative", {"model": MODEL, "prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("logprobs wrong type", {"model": MODEL, "prompt": "hi", "logprobs": "3"}, 400, "logprobs"),
    ("echo wrong type", {"model": MODEL, "prompt": "hi", "echo": 1}, 400, "echo"),
    ("presence_penalty above 2", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency_penalty wrong type", {"model": MODEL, "prompt": "hi", "frequency_penalty": "x"}, 400,
     "frequency_penalty"),
    ("repetition_penalty zero", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logit_bias key not a token id", {"model": MODEL, "prompt": "hi", "logit_bias": {"a": 5}}, 400, "logit_bias"),
    ("logit_bias above 100", {"model": MODEL, "prompt": "hi", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ("logit_bias value a string", {"model": MODEL, "prompt": "hi", "logit_bias": {"1": "5"}}, 400, "logit_bias"),
    ("logit_bias past the vocabulary", {"model": MODEL, "prompt": "hi", "logit_bias": {"49152": 1}}, 400,
     "logit_bias"),
    ("min_tokens above max_tokens", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400,
     "min_tokens"),
    ("min_tokens negative", {"model": MODEL, "prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ("cache_salt wrong type", {"model": MODEL, "prompt": "hi", "cache_salt": 7}, 400, "cache_salt"),
    ("unknown model", {"model": "gpt-5", "prompt": "hi"}, 404, "model"),
]
BAD_CHATS = [
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages"),
    ("message not an object", {"model": MODEL, "messages": ["hi"]}, 400, "messages[0]"),
    ("message without role", {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("content wrong type", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("image part", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ("max_completion_tokens zero", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                    "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("conversation beyond context", {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 400,
     "messages"),
    ("logprobs wrong type", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, 400,
     "logprobs"),
    ("top_logprobs without logprobs", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs above 20", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                               "top_logprobs": 21}, 400, "top_logprobs"),
    ("unknown model", {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
]


@pytest.mark.parametrize("route,case", [("/v1/completions", c) for c in BAD_COMPLETIONS] +
                         [("/v1/chat/completions", c) for c in BAD_CHATS], ids=lambda x: x[0] if isinstance(x, tuple) else x)
def test_bad_input_gets_openai_error(server, route, case):
    _, body, status, param = case
    contents = [body] if isinstance(body, bytes) else [json.dumps(body).encode()]
    if isinstance(body, dict) and "stream" not in body:     # a streamed request is refused before it streams
        contents.append(json.dumps({**body, "stream": True}).encode())
    for content in contents:
        reply = server.http.post(route, content=content, headers={"content-type": "application/json"})
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param and len(error["message"]) > 10


def test_bad_input_through_the_client(client):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-5", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="n must be"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=30)
    with pytest.raises(openai.BadRequestError, match="ask for at most"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10 * MAX_MODEL_LEN)


def test_unknown_route_gets_openai_error(server):
    reply = server.http.get("/v1/engines")
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"


# ---- cancellation and faults ------------------------------------------------------------------

def test_disconnect_frees_the_slot_and_the_queue(server):
    """Guards: a client that goes away (mid-stream, or while queued, or waiting for a whole
    response) must not keep its slot or its place in the queue."""
    client = server.client()
    aborted = server.metric("requests_total", status="abort")
    long = dict(model=MODEL, max_tokens=MAX_MODEL_LEN - 32, temperature=0, extra_body={"ignore_eos": True})
    streams = [client.completions.create(prompt=f"Story number {i}:", stream=True, **long)
               for i in range(NUM_SLOTS + 1)]
    server.wait_health(num_running=NUM_SLOTS, num_waiting=1)
    streams[-1].close()                                   # the queued one leaves before it starts
    server.wait_health(timeout=10, num_running=NUM_SLOTS, num_waiting=0)
    first = next(iter(streams[0]))                        # mid-stream: tokens are flowing
    assert first.choices[0].finish_reason is None
    for stream in streams[:-1]:
        stream.close()
    server.wait_health(timeout=10, num_running=0, num_waiting=0)

    # a non-streamed request whose client gives up: steps slowed to 0.1 s, so that its 224 tokens
    # (at most 9 a step) take 2.5 s at least, past the client's 1.5 s on any machine
    engine = server.engine
    real_step = engine.step

    def slow_step():
        time.sleep(0.1)
        return real_step()

    engine.step = slow_step
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", timeout=1.5, json={
                "model": MODEL, "prompt": "Once", "max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True})
    finally:
        del engine.step
    server.wait_health(timeout=10, num_running=0, num_waiting=0)
    assert server.metric("requests_total", status="abort") == aborted + NUM_SLOTS + 2
    # and the server still serves
    assert client.completions.create(prompt="Hello", max_tokens=2, **greedy()).usage.completion_tokens >= 1


def test_failed_step_fails_only_its_requests(server, client):
    """Guards: an exception inside a step must fail that step's requests with a 500 and leave
    the engine serving the next ones."""
    poison = [7, 7, 7, 7]
    engine = server.engine
    real_prefill = engine.prefill

    def prefill(plan):
        if any(chunk.seq.prompt_ids[:4] == poison for chunk in plan.prefill):
            raise RuntimeError("injected fault")
        return real_prefill(plan)

    engine.prefill = prefill
    try:
        with pytest.raises(openai.InternalServerError, match="injected fault"):
            client.completions.create(prompt=poison + [42], max_tokens=4, **greedy())
        with pytest.raises(openai.APIError, match="injected fault"):
            list(client.completions.create(prompt=poison + [43], max_tokens=4, stream=True, **greedy()))
    finally:
        del engine.prefill
    server.wait_health(timeout=10, num_running=0, num_waiting=0)
    assert server.metric("requests_total", status="error") == 2
    assert client.completions.create(prompt="Hello", max_tokens=3, **greedy()).choices[0].text


def test_a_chunk_that_fails_to_build_ends_its_stream(server, client, monkeypatch):
    """Guards: a fault while a streamed choice's chunk is built (here its logprobs' token text)
    must end that stream with a 500 error event, not leave it waiting for a choice that will not
    come, and the server serves on."""
    def broken(token_id):
        raise RuntimeError("injected chunk fault")
    monkeypatch.setattr(server.engine.tokenizer, "token_text", broken)
    with pytest.raises(openai.APIError, match="injected chunk fault"):
        list(client.completions.create(prompt="Hello", max_tokens=4, logprobs=1, n=2, stream=True, **greedy()))
    monkeypatch.undo()
    server.wait_health(timeout=10, num_running=0, num_waiting=0)
    assert client.completions.create(prompt="Hello", max_tokens=3, logprobs=1, **greedy()).choices[0].logprobs


def test_engine_loop_run_by_the_caller_serves_and_ends_with_the_server():
    """`outpace serve` runs the engine loop in the thread that built the engine, the HTTP server
    beside it: requests are served, and the server's shutdown ends the loop."""
    s = Server(num_slots=2, engine_thread=False)
    try:
        text = s.client().completions.create(prompt="Hello", max_tokens=3, **greedy()).choices[0].text
        assert text and s.health()["status"] == "ok"
    finally:
        s.close()
    s.loop.join(timeout=10)
    assert not s.loop.is_alive()


# ---- load -------------------------------------------------------------------------------------

LOAD_PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colours are",
                "Water boils at", "My favourite book is", "1, 2, 3, 4,", "The quick brown fox",
                "In the beginning"]


def test_concurrent_streams_match_solo_greedy(server):
    """32 concurrent streaming clients over 8 slots: every request completes exactly once and its
    greedy text equals the same prompt served alone (float32 keeps near-ties rare)."""
    client = server.client()
    params = dict(max_tokens=24, **greedy())
    solo = {p: client.completions.create(prompt=p, **params).choices[0].text for p in LOAD_PROMPTS}
    assert len(set(solo.values())) == len(LOAD_PROMPTS)   # distinct texts: a mix-up would show
    finished = server.metric("requests_total", status="length") + server.metric("requests_total", status="stop")

    def run(i):
        prompt = LOAD_PROMPTS[i % len(LOAD_PROMPTS)]
        chunks = list(client.completions.create(prompt=prompt, stream=True, **params))
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        return i, prompt, {c.id for c in chunks}, reasons, "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, range(32)))
    assert sorted(r[0] for r in results) == list(range(32))
    ids = [r[2] for r in results]
    assert all(len(i) == 1 for i in ids) and len(set.union(*ids)) == 32
    assert all(len(r[3]) == 1 for r in results)
    mismatched = [(prompt, text, solo[prompt]) for _, prompt, _, _, text in results if text != solo[prompt]]
    assert not mismatched
    server.wait_health(timeout=10, num_running=0, num_waiting=0)
    done = server.metric("requests_total", status="length") + server.metric("requests_total", status="stop")
    assert done == finished + 32


def test_metrics_names(server):
    text = server.http.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "requests_total", "prompt_tokens_total",
                 "prompt_tokens_cached_total",
                 "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_bucket", "spec_decode_num_drafts_total",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"):
        assert f"outpace:{name}{{" in text, name
    assert server.metric("generation_tokens_total") > 0 and server.metric("prompt_tokens_total") > 0


def test_serve_command_line(monkeypatch):
    args = build_parser().parse_args(["serve", "--port", "9001", "--spec", "none", "--max-num-seqs", "4",
                                      "--max-model-len", "512", "--dtype", "float32", "--device", "cpu"])
    assert (args.host, args.port, args.spec, args.max_num_seqs, args.max_model_len) == ("127.0.0.1", 9001, "none", 4, 512)
    assert args.func.__name__ == "cmd_serve"
    monkeypatch.delenv("OUTPACE_API_KEY", raising=False)
    config = serve_config(args)
    assert config.api_key is None and config.allowed_origins == [] and not config.special_tokens_in_content
    assert config.allowed_hosts == ["localhost", "127.0.0.1", "::1"]      # loopback: loopback names only
    monkeypatch.setenv("OUTPACE_API_KEY", "from-env")
    assert serve_config(args).api_key == "from-env"
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--api-key", "k", "--allowed-origins",
                                      "https://a.example", "--max-body-bytes", "4096", "--read-timeout", "2.5",
                                      "--special-tokens-in-content"])
    config = serve_config(args)
    assert (config.api_key, config.allowed_origins, config.allowed_hosts) == ("k", ["https://a.example"], None)
    assert (config.max_body_bytes, config.read_timeout_s, config.special_tokens_in_content) == (4096, 2.5, True)
