"""Engines compared in benchmarks/, behind one call: generate(prompt_ids, max_tokens, ignore_eos).

Every engine gets the same prompt token ids (outpace's tokenizer and chat template) and decodes
greedily, so tokens/s compare the same work and outputs can be compared token for token. Times
are split at the first new token: prefill_s until it, decode_s from it to the last one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from outpace.config import SamplingParams
from outpace.llm import LLM


@dataclass
class Generation:
    token_ids: list[int]        # new tokens, a stopping EOS included (as outpace reports them)
    prefill_s: float
    decode_s: float

    def as_dict(self) -> dict:
        return {"num_tokens": len(self.token_ids), "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "token_ids": self.token_ids}


class OutpaceEngine:
    def __init__(self, llm: LLM, speculate: bool):
        self.llm, self.speculate = llm, speculate

    def generate(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool) -> Generation:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        out = self.llm.generate(prompt_ids, params, speculate=self.speculate)[0]
        return Generation(out.token_ids, out.timing["prefill_s"], out.timing["decode_s"])


def load_transformers(model: str | Path, dtype: torch.dtype, device: str):
    """A transformers model from a Hugging Face folder or from a .gguf file (dequantized by
    transformers itself, as `from_pretrained(folder, gguf_file=...)` does)."""
    from transformers import AutoModelForCausalLM
    path = Path(model)
    if path.suffix.lower() == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, device_map=device)
    return hf.to(device=device, dtype=dtype).eval()


class _Clock:
    """A transformers streamer that only notes when the first new token arrives."""

    def __init__(self):
        self.has_prompt, self.first = False, None

    def put(self, value):
        if self.has_prompt and self.first is None:
            self.first = time.perf_counter()
        self.has_prompt = True

    def end(self):
        pass


class TransformersEngine:
    """transformers' `generate`, greedy; prompt_lookup > 0 turns on its prompt lookup decoding,
    an assistant (a draft model of the same vocabulary) its assisted generation."""

    def __init__(self, model, eos_ids: list[int], prompt_lookup: int = 0, assistant=None):
        self.model, self.eos_ids, self.prompt_lookup = model, sorted(eos_ids), prompt_lookup
        self.assistant = assistant
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool) -> Generation:
        ids = torch.tensor([prompt_ids], device=self.device)
        options = dict(do_sample=False, max_new_tokens=max_tokens, eos_token_id=self.eos_ids,
                       pad_token_id=self.eos_ids[0], attention_mask=torch.ones_like(ids))
        if ignore_eos:
            options["min_new_tokens"] = max_tokens
        if self.prompt_lookup:
            options["prompt_lookup_num_tokens"] = self.prompt_lookup
        if self.assistant is not None:
            options["assistant_model"] = self.assistant
        clock = _Clock()
        _sync(self.device)
        started = time.perf_counter()
        out = self.model.generate(ids, streamer=clock, **options)
        _sync(self.device)
        finished = time.perf_counter()
        first = clock.first or finished
        return Generation(out[0, len(prompt_ids):].tolist(), first - started, finished - first)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_llamacpp(gguf: str | Path, n_ctx: int, threads: int, draft_tokens: int = 0,
                  draft_gguf: str | Path | None = None):
    """llama.cpp on the GGUF file itself, through llama-cpp-python; draft_tokens > 0 attaches its
    prompt lookup draft model, or with draft_gguf a draft model of that GGUF (LlamaCppModelDraft).
    None (with a message) when llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        print(f"llama.cpp skipped: llama-cpp-python is not importable ({e}); "
              "pip install 'outpace[llamacpp]' to include it")
        return None
    draft = None
    if draft_tokens and draft_gguf is not None:
        draft = LlamaCppModelDraft(Llama(model_path=str(draft_gguf), n_ctx=n_ctx, n_threads=threads,
                                         n_threads_batch=threads, verbose=False), draft_tokens)
    elif draft_tokens:
        draft = LlamaPromptLookupDecoding(num_pred_tokens=draft_tokens)
    # logits_all: with a draft model llama-cpp-python keeps every position's logits, but sizes that
    # buffer from this argument; left False, prompts longer than n_batch fail in eval()
    return Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                 draft_model=draft, logits_all=draft is not None, verbose=False)


class LlamaCppModelDraft:
    """A draft model for llama-cpp-python's draft_model hook (its LlamaDraftModel interface: the
    sequence's token ids in, drafted ids out), which the binding fills only with prompt lookup: a
    second Llama on the draft GGUF drafts num_tokens tokens greedily a call. Its generate(reset=True)
    keeps the longest prefix its cache shares with the sequence, so a call reads the tokens the
    target accepted since the last one, then drafts one forward a token."""

    def __init__(self, llama, num_tokens: int):
        self.llama, self.num_tokens = llama, num_tokens

    def __call__(self, input_ids, /, **kwargs):
        drafted = []
        for token in self.llama.generate(input_ids.tolist(), temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                         repeat_penalty=1.0, reset=True):
            drafted.append(token)
            if len(drafted) == self.num_tokens:
                break
        return np.array(drafted, dtype=np.intc)


class LlamaCppEngine:
    """llama-cpp-python's token generator, greedy (temperature 0), its prompt cache reset each call
    so that every prompt is processed whole, as in the other engines."""

    def __init__(self, llama, eos_ids: list[int]):
        self.llama, self.eos_ids = llama, set(eos_ids) | {llama.token_eos()}

    def generate(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool) -> Generation:
        self.llama.reset()
        tokens: list[int] = []
        started = time.perf_counter()
        first = None
        for token in self.llama.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                         repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            tokens.append(token)
            if len(tokens) >= max_tokens or (not ignore_eos and token in self.eos_ids):
                break
        finished = time.perf_counter()
        first = first or finished
        return Generation(tokens, first - started, finished - first)
