"""A small random-weight GGUF writer for tests: llama, qwen2 or qwen3 layout, as llama.cpp lays it out."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import gguf
import gguf.quants
import numpy as np

from outpace.weights.gguf import hf_tensor_name, llama3_rope_factors, rotary_permute
from gguf_blocks import quantize


TEST_CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                      "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_test_gguf(path: str | Path, arch: str = "llama", config_overrides: dict | None = None, *,
                    dtype: str = "f32", tokenizer: str = "gpt2", seed: int = 0,
                    quantized: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Writes a tiny random-weight GGUF laid out as llama.cpp writes one; returns the Hugging Face
    tensors (float32, HF names and row order) that converting it must give back.

    arch: "llama", "qwen2" or "qwen3"; any other name writes llama's tensors under that name.
    config_overrides: Hugging Face config keys (hidden_size, num_key_value_heads, head_dim,
        tie_word_embeddings, vocab_size (>= the test vocabulary), rope_scaling={"rope_type": "llama3",
        "factor": 8.0} ...).
    dtype: "f32" or "f16" matrices (norms and biases stay f32, as llama.cpp writes them).
    tokenizer: "gpt2" (byte-level BPE with ChatML specials) or "llama" (sentencepiece, byte fallback).
    quantized: a matrix's role (attn_q, ffn_down, token_embd, output ...) -> the GGUF type it is
        quantized to (Q4_1, Q8_0, Q4_K ...: gguf_blocks.quantize); the expected tensor is its dequantized value.
    """
    tokens, types, extra = _test_vocab(tokenizer)
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 256, "tie_word_embeddings": True, "rope_scaling": None,
           "vocab_size": len(tokens), **(config_overrides or {})}
    types += [5] * (cfg["vocab_size"] - len(tokens))  # 5: unused
    tokens += [f"[PAD{i}]" for i in range(cfg["vocab_size"] - len(tokens))]
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", "num_hidden_layers"), ("context_length", "max_position_embeddings"),
                       ("embedding_length", "hidden_size"), ("feed_forward_length", "intermediate_size"),
                       ("attention.head_count", "num_attention_heads"), ("rope.dimension_count", "head_dim"),
                       ("attention.head_count_kv", "num_key_value_heads"), ("attention.key_length", "head_dim"),
                       ("attention.value_length", "head_dim")):
        writer.add_uint32(f"{arch}.{key}", cfg[value])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", cfg["rope_theta"])
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for key, value in extra.items():
        writer.add_array(key, value) if isinstance(value, list) else writer.add_string(key, value)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(tokenizer == "llama")  # as llama.cpp's converters write these vocabularies
    writer.add_chat_template(TEST_CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)
    stored = np.float16 if dtype == "f16" else np.float32
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    expected = {}
    for name, shape in _test_shapes(cfg, arch):
        if len(shape) == 1:
            value = (1.0 if name.endswith("norm.weight") else 0.0) + 0.1 * rng.standard_normal(shape, np.float32)
        else:  # rounded as stored, so the expected tensor is exactly what comes back
            value = (0.02 * rng.standard_normal(shape, np.float32)).astype(stored)
        expected[hf_tensor_name(name)] = value.astype(np.float32)
        role = name.split(".")[-2]
        qtype = (quantized or {}).get(role) if len(shape) == 2 else None      # biases stay float, as llama.cpp's
        if qtype is not None:
            qtype = gguf.GGMLQuantizationType[qtype]
            expected[hf_tensor_name(name)] = gguf.quants.dequantize(quantize(value, qtype.name), qtype)
        if arch not in ("qwen2", "qwen3") and role in heads:
            value = rotary_permute(value, heads[role])
        if qtype is None:
            writer.add_tensor(name, value)
        else:       # quantized after the permutation, as llama.cpp's files are: each row's blocks move whole
            writer.add_tensor(name, quantize(value, qtype.name), raw_dtype=qtype)
    if (cfg["rope_scaling"] or {}).get("rope_type") == "llama3":
        factors = llama3_rope_factors(cfg["head_dim"], cfg["rope_theta"], cfg["rope_scaling"]["factor"])
        writer.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _test_shapes(cfg: dict, arch: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    hidden, ffn, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    yield "token_embd.weight", (cfg["vocab_size"], hidden)
    for i in range(cfg["num_hidden_layers"]):
        yield from ((f"blk.{i}.{part}", shape) for part, shape in (
            ("attn_norm.weight", (hidden,)), ("attn_q.weight", (q, hidden)), ("attn_k.weight", (kv, hidden)),
            ("attn_v.weight", (kv, hidden)), ("attn_output.weight", (hidden, q)), ("ffn_norm.weight", (hidden,)),
            ("ffn_gate.weight", (ffn, hidden)), ("ffn_up.weight", (ffn, hidden)), ("ffn_down.weight", (hidden, ffn)),
            *((("attn_q.bias", (q,)), ("attn_k.bias", (kv,)), ("attn_v.bias", (kv,))) if arch == "qwen2" else ()),
            *((("attn_q_norm.weight", (head_dim,)), ("attn_k_norm.weight", (head_dim,))) if arch == "qwen3" else ())))
    yield "output_norm.weight", (hidden,)
    if not cfg["tie_word_embeddings"]:
        yield "output.weight", (cfg["vocab_size"], hidden)


def _test_vocab(kind: str) -> tuple[list[str], list[int], dict[str, Any]]:
    """(tokens, token types, extra metadata) of a small vocabulary that still tokenizes any text."""
    words = ["\u2581h", "ll", "ell", "\u2581hell", "\u2581hello", "\u2581t", "he", "\u2581the", "in", "\u2581a", "er",
             "\u2581w", "or", "ld", "\u2581wor", "\u2581world"]  # in merge order
    if kind == "llama":  # sentencepiece: words score by merge order, then single characters, bytes last
        chars = ["\u2581", *"abcdefghijklmnopqrstuvwxyz"]
        tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *words, *chars]
        types = [2, 3, 3] + [6] * 256 + [1] * (len(words) + len(chars))
        scores = [0.0] * 259 + [-float(i) for i in range(len(words) + len(chars))]
        return tokens, types, {"tokenizer.ggml.scores": scores}
    # byte-level BPE: GPT-2's printable stand-ins for the 256 bytes, then the merged words
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    others = iter(range(256, 512))
    alphabet = [chr(b) if b in printable else chr(next(others)) for b in range(256)]
    merges, merged = [], set(alphabet)
    for word in (w.replace("\u2581", "\u0120") for w in words):
        cut = next(i for i in range(len(word) - 1, 0, -1) if word[:i] in merged and word[i:] in merged)
        merges.append(f"{word[:cut]} {word[cut:]}")
        merged.add(word)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, *(m.replace(" ", "") for m in merges)]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, types, {"tokenizer.ggml.merges": merges, "tokenizer.ggml.pre": "gpt2"}
