"""GGUF models with their quantized matrices kept quantized on the CPU (weights.quantized).

The default model's linears and tied LM head compute on the file's Q4_1 and Q8_0 blocks, hold about
the file's bytes, and keep speculation lossless (each token computes alike whatever shares its
forward); so do small GGUFs of every supported type, k-quants and fused layers of mixed types
included. Every type's products quantize the inputs to int8 (tests/test_cpu_quant.py), so a model
holding them has logits NOT the dequantized float32 model's bits but within the inputs'
quantization of them, which `close` states. Types without kernels, inputs that are not whole
blocks, CUDA and bad choices say so."""
import errno
import json
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from outpace import LLM, SamplingParams, SpecConfig
from outpace.config import EngineConfig
from outpace.errors import InvalidParameterError
from outpace.kernels import cpu_kernels
from outpace.kernels.cpu_linear import QuantizedEmbedding, QuantizedLinear, QuantizedParts
from outpace.model.decoder import DecoderLM
from outpace.runner.model_runner import ModelRunner, Row
from outpace.weights import gguf, quantized
from outpace.weights.gguf import QTYPES_KEY, GGUFFile, convert_gguf
from outpace.weights.loader import load_model
from gguf_writer import write_test_gguf
from tiny import make_tiny

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the quantized kernels cannot build here")


def close(got: torch.Tensor, expected: torch.Tensor, most: float) -> None:
    """Each row of logits [..., V] within `most` of the float32 model's, relative in the L2 norm:
    int8 inputs move logits by a few percent, a misplaced or misread weight by about 100%."""
    error = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert (error < most).all(), error.max()


PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Summarize: Paris is the capital of France. It is known for the Eiffel Tower. Summary:",
]


def test_default_model_holds_the_files_blocks(default_model_dir, default_gguf):
    """Every linear and the tied LM head are QuantizedLinear layers whose packed bytes are the
    GGUF's bytes of their tensors (the embedding's for the LM head), nothing more."""
    model = load_model(default_model_dir, torch.bfloat16, "cpu", max_len=64)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * model.cfg.num_layers + 1 and isinstance(model.lm_head, QuantizedLinear)
    assert {m.qtype for m in model.layers.modules() if isinstance(m, QuantizedLinear)} == {"Q4_1"}
    assert model.lm_head.qtype == "Q8_0"
    matrices = [t for t in GGUFFile(default_gguf).tensors if len(t.shape) == 2]
    assert sum(m.packed.numel() for m in layers) == sum(t.num_bytes for t in matrices)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_float32_forward_is_close_to_the_dequantized_models(default_model_dir):
    """In float32 the quantized model's logits are within 15% of the float32 (dequantized) model's
    (measured: up to 7%, over arbitrary token ids): a prompt and decode steps."""
    ids = list(range(1000, 1030))
    logits = []
    for weights in ("quantized", "fp32"):
        model = load_model(default_model_dir, torch.float32, "cpu", max_len=128, weights=weights)
        runner = ModelRunner(model, num_slots=1, max_len=128, max_step_tokens=64)
        prompt, _ = runner.forward([Row(0, ids[:-3], 0)])
        steps = [runner.forward([Row(0, [t], len(ids) - 3 + i)])[0][0, 0] for i, t in enumerate(ids[-3:])]
        logits.append(torch.cat([prompt[0], torch.stack(steps)]))
    close(logits[0], logits[1], 0.15)


@pytest.mark.parametrize("exact", [False, True])
def test_speculative_greedy_equals_plain_greedy(default_model_dir, exact):
    """n-gram speculation over the quantized model, fast and exact mode: the plain greedy tokens."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    opts = dict(dtype="bfloat16", device="cpu", max_num_seqs=2, max_model_len=512)
    spec = LLM(str(default_model_dir), spec=SpecConfig(num_draft_tokens=6, exact=exact), **opts)
    plain = LLM(str(default_model_dir), spec=SpecConfig(method="none", num_draft_tokens=6, exact=exact), **opts)
    assert isinstance(spec.engine.model.lm_head, QuantizedLinear)
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert spec.engine.stats.num_accepted_tokens > 0, "the prompts were chosen to give accepted drafts"


def test_long_prompt_chunks_stay_bfloat16_and_cache_alike(default_model_dir, monkeypatch, cpu_level):
    """On a CPU without bfloat16 dot products the quantized model's long prompt chunks stay
    bfloat16 (its products round their inputs to int8 in either dtype; a dense copy's chunks
    compute in float32), so a prompt cached in one chunk or in several leaves the same cache, bit
    for bit, in fast mode: how a load chunks prompts does not change a row's tokens."""
    monkeypatch.setattr(cpu_kernels, "has_bf16_dot", lambda: False)
    model = load_model(default_model_dir, torch.bfloat16, "cpu", max_len=512)
    prompt = list(range(1000, 1201))
    last = [Row(0, prompt[-1:], len(prompt) - 1)]
    logits = []
    for cuts in ([0, 200], [0, 150, 200], [0, 40, 200]):
        runner = ModelRunner(model, num_slots=1, max_len=512, max_step_tokens=256)
        assert runner.prefill_dtype is None
        for a, b in zip(cuts, cuts[1:]):
            runner.forward([Row(0, prompt[a:b], a)], logits="none")
        logits.append(runner.forward(last)[0])
    assert all(torch.equal(logits[0], other) for other in logits[1:])
    dense = load_model(default_model_dir, torch.bfloat16, "cpu", max_len=512, weights="bf16")
    assert ModelRunner(dense, num_slots=1, max_len=512, max_step_tokens=256).prefill_dtype is torch.float32


RSS_SCRIPT = """
import ctypes, json, sys, torch
from outpace.kernels import cpu_kernels
from outpace.model.config import ModelConfig
from outpace.model.registry import FAMILIES
from outpace.weights.loader import load_model
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
cpu_kernels.linear(torch.ones(1, 64), cpu_kernels.pack_weight(torch.ones(16, 64)), 0, None, 16)   # libraries in
cfg = ModelConfig.from_folder(sys.argv[1])
with torch.device("meta"):          # the model code's first use loads more libraries
    FAMILIES[cfg.family](cfg, 64)
before = rss()
model = load_model(sys.argv[1], torch.bfloat16, "cpu", max_len=64, weights=sys.argv[2])
ctypes.CDLL("libc.so.6").malloc_trim(0)
print(json.dumps(rss() - before))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_resident_memory_is_about_the_files(default_model_dir, default_gguf):
    """Loading the default model quantized (the embedding's lookups from its blocks too) adds about
    the GGUF's size to the process, under 60% of what the bfloat16 model adds."""
    grown = {}
    for weights in ("quantized", "bf16"):
        done = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(default_model_dir), weights],
                              capture_output=True, text=True, check=True)
        grown[weights] = json.loads(done.stdout.strip().splitlines()[-1])
    size = default_gguf.stat().st_size
    assert grown["quantized"] < 1.5 * size, (grown, size)
    assert grown["quantized"] < 0.6 * grown["bf16"], (grown, size)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_converted_gguf_computes_as_its_float_copy(home, tmp_path, arch):
    """A small GGUF with quantized q/k/v (llama's rows permuted, qwen2's with biases), gate/up, down
    and an untied output head in each supported type: its quantized model's float32 logits are
    close to its float32 model's (a misread weight or a wrong row order is far from it)."""
    kinds = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q5_0", "ffn_gate": "Q4_0",
             "ffn_up": "Q4_0", "ffn_down": "Q8_0", "output": "Q8_0"}
    write_test_gguf(tmp_path / "m.gguf", arch, {"tie_word_embeddings": False, "vocab_size": 320}, quantized=kinds)
    folder = convert_gguf(tmp_path / "m.gguf")
    models = {weights: load_model(folder, torch.float32, "cpu", max_len=64, weights=weights)
              for weights in ("quantized", "fp32")}
    held = models["quantized"].modules()
    assert {m.qtype for m in held if isinstance(m, QuantizedLinear)} == {"Q4_0", "Q4_1", "Q5_0", "Q8_0"}
    ids = [Row(0, list(range(3, 40)), 0)]
    logits = [ModelRunner(m, num_slots=1, max_len=64, max_step_tokens=64).forward(ids)[0] for m in models.values()]
    close(logits[0], logits[1], 0.05)       # measured: about 1%


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_k_quant_gguf_computes_close_to_its_float_copy(home, tmp_path, dtype):
    """Q4_K_M's mix, as llama.cpp writes it: Q4_K matrices, Q6_K values (a qkv of mixed types:
    QuantizedParts, one product for q and k), down and LM head, and a Q4_K embedding; qwen2's q/k/v biases. Every matrix
    keeps the file's bytes, and the quantized model's float32 logits are close to its float32
    model's; in bfloat16, each token's logits are the same bits alone as beside another sequence's
    draft (speculation stays lossless), and n-gram speculation generates plain greedy's tokens."""
    kinds = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
             "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K", "token_embd": "Q4_K"}
    shape = {"tie_word_embeddings": False, "vocab_size": 320, "hidden_size": 256, "intermediate_size": 512,
             "head_dim": 64}
    write_test_gguf(tmp_path / "m.gguf", "qwen2", shape, quantized=kinds)
    folder = convert_gguf(tmp_path / "m.gguf")
    model = load_model(folder, dtype, "cpu", max_len=64, weights="quantized")
    # q and k, both Q4_K, in one product; v, Q6_K, in another, each writing its columns of qkv
    assert all([part.qtype for part in layer.attn.qkv.parts] == ["Q4_K", "Q6_K"] for layer in model.layers)
    held = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert {m.qtype for m in held} == {"Q4_K", "Q6_K"} and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    matrices = [t for t in GGUFFile(tmp_path / "m.gguf").tensors if len(t.shape) == 2 and "token_embd" not in t.name]
    assert sum(m.packed.numel() for m in held) == sum(t.num_bytes for t in matrices)    # rows all whole blocks of 16
    runner = ModelRunner(model, num_slots=2, max_len=64, max_step_tokens=64)
    prompt = list(range(3, 40))
    if dtype == torch.float32:
        reference = load_model(folder, torch.float32, "cpu", max_len=64, weights="fp32")
        rows = [Row(0, prompt, 0)]
        close(runner.forward(rows)[0], ModelRunner(reference, 1, 64, 64).forward(rows)[0], 0.05)
        return
    draft = [5, 17, 300, 42]
    runner.forward([Row(0, prompt, 0)], logits="none")
    runner.forward([Row(1, prompt[:9], 0)], logits="none")
    alone = [runner.forward([Row(0, [t], len(prompt) + i)])[0][0, 0].clone() for i, t in enumerate(draft)]
    together, _ = runner.forward([Row(0, draft, len(prompt)), Row(1, [11], 9)])
    for i in range(len(draft)):
        assert torch.equal(together[0, i], alone[i]), i
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    opts = dict(dtype="bfloat16", device="cpu", max_num_seqs=2, max_model_len=128, weights="quantized")
    outputs = [LLM(str(folder), spec=SpecConfig(method=method, num_draft_tokens=4), **opts).generate(PROMPTS[:2], params)
               for method in ("ngram", "none")]
    assert [o.token_ids for o in outputs[0]] == [o.token_ids for o in outputs[1]]
    assert all(len(o.token_ids) == 32 for o in outputs[1])


def test_a_requantized_model_holds_q4_0_where_its_file_takes_more_bytes(home, tmp_path):
    """requantize "Q4_0" (a draft model's matrices): every matrix whose type takes more bytes a
    weight than Q4_0 (Q5_0, Q8_0, Q4_1, Q6_K) holds the Q4_0 blocks of its dequantized values; Q4_0
    and Q4_K (as many bytes) keep the file's. A fused layer whose parts all become Q4_0 is one
    product; its logits stay near the float model's (a misplaced block is about 100% off)."""
    kinds = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_0",
             "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q8_0"}
    shape = {"tie_word_embeddings": False, "vocab_size": 320, "hidden_size": 256, "intermediate_size": 512,
             "head_dim": 64}
    tensors = write_test_gguf(tmp_path / "m.gguf", "qwen2", shape, quantized=kinds)
    folder = convert_gguf(tmp_path / "m.gguf")
    model = load_model(folder, torch.float32, "cpu", max_len=64, weights="quantized", requantize="Q4_0")

    def q4_0(*names):
        blocks = cpu_kernels.quantize_q4_0(torch.cat([torch.as_tensor(tensors[n]) for n in names]))
        return cpu_kernels.pack_quantized(blocks, "Q4_0")

    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        qkv = [prefix + f"self_attn.{p}_proj.weight" for p in "qkv"]
        assert isinstance(layer.attn.qkv, QuantizedLinear) and torch.equal(layer.attn.qkv.packed, q4_0(*qkv))
        assert torch.equal(layer.attn.o.packed, q4_0(prefix + "self_attn.o_proj.weight"))
        assert torch.equal(layer.mlp.down.packed, q4_0(prefix + "mlp.down_proj.weight"))
        assert [part.qtype for part in layer.mlp.gate_up.parts] == ["Q4_0", "Q4_K"]
    assert model.lm_head.qtype == "Q4_0" and torch.equal(model.lm_head.packed, q4_0("lm_head.weight"))
    file = load_model(folder, torch.float32, "cpu", max_len=64, weights="quantized")
    assert torch.equal(file.layers[0].mlp.gate_up.parts[0].packed, model.layers[0].mlp.gate_up.parts[0].packed)
    reference = load_model(folder, torch.float32, "cpu", max_len=64, weights="fp32")
    rows = [Row(0, list(range(3, 40)), 0)]
    got, want = (ModelRunner(m, 1, 64, 64).forward(rows)[0] for m in (model, reference))
    close(got, want, 0.3)           # measured: about 17% (4-bit rounding of random weights, two layers)


@pytest.fixture
def requantizable(home, tmp_path):
    """A converted GGUF of mixed types whose tied LM head (a Q8_0 embedding's) and q, k, v, o and
    down (Q5_0, Q8_0, Q4_1, Q6_K) requantize to Q4_0; gate (Q4_0) and up (Q4_K) keep theirs."""
    kinds = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_0",
             "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"}
    shape = {"vocab_size": 320, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    write_test_gguf(tmp_path / "m.gguf", "qwen2", shape, quantized=kinds)
    return convert_gguf(tmp_path / "m.gguf")


def held_blocks(folder) -> dict[str, torch.Tensor]:
    """A draft load's (requantize "Q4_0") packed blocks, by buffer name."""
    model = load_model(folder, torch.float32, "cpu", max_len=64, weights="quantized", requantize="Q4_0")
    return dict(model.named_buffers())


def test_a_requantized_models_q4_0_blocks_are_written_once(requantizable, monkeypatch):
    """The first requantizing load writes quantized/q4_0.safetensors: just the matrices it changes
    (the tied LM head's embedding blocks among them), uint8 [rows, K / 32 * 18], Q4_0 in its
    qtypes, removing a dead writer's temporary file; a later load reads it, requantizing nothing,
    and holds the same bytes."""
    copy = requantizable / "quantized" / "q4_0.safetensors"
    dead = copy.with_name(".q4_0.safetensors.tmp-999999")        # a writer killed midway
    dead.write_bytes(b"partial")
    first = held_blocks(requantizable)
    assert copy.is_file() and not dead.exists()
    changed = {f"model.layers.{i}.{m}.weight" for i in range(2)
               for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj")}
    with safe_open(str(copy), framework="pt") as f:
        assert set(f.keys()) == changed | {"model.embed_tokens.weight"}
        assert json.loads(f.metadata()[QTYPES_KEY]) == dict.fromkeys(f.keys(), "Q4_0")
        with safe_open(str(quantized.blocks_file(requantizable)), framework="pt") as blocks:
            for name in f.keys():
                rows, K = blocks.get_slice(name).get_shape()[0], 512 if "down_proj" in name else 256
                tensor = f.get_tensor(name)
                assert tensor.dtype == torch.uint8 and tuple(tensor.shape) == (rows, K // 32 * 18), name
    monkeypatch.setattr(cpu_kernels, "quantize_q4_0", lambda weight: pytest.fail("requantized again"))
    second = held_blocks(requantizable)
    assert first.keys() == second.keys()
    for name, blocks in first.items():
        assert torch.equal(blocks, second[name]), name


@pytest.mark.parametrize("how", ["read-only folder", "too little free"])
def test_a_requantized_copy_that_cannot_be_written_is_requantized_in_memory(requantizable, monkeypatch, capsys, how):
    """Where the Q4_0 copy cannot be written (the write fails as in a read-only folder, which
    root's writes would not show; or the disk has too little room to try), stderr says so, what it
    takes and what to do, nothing is left behind, and the load holds the bytes of the load that
    writes the copy."""
    def read_only(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    if how == "read-only folder":
        monkeypatch.setattr(quantized, "write_safetensors", read_only)
    else:
        monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=0))
    capsys.readouterr()
    in_memory = held_blocks(requantizable)
    why = "Permission denied" if how == "read-only folder" else "No space left on device"
    assert re.search(rf"could not write the Q4_0 copy of m-\w+'s matrices \({why}; it takes 0\.0 GB in .*quantized\): "
                     r"they are requantized in memory at every start instead.*\. Free disk space or make the folder "
                     r"writable", capsys.readouterr().err)
    assert sorted(p.name for p in (requantizable / "quantized").iterdir()) == ["model.safetensors"]
    monkeypatch.undo()
    written = held_blocks(requantizable)
    assert (requantizable / "quantized" / "q4_0.safetensors").is_file() and in_memory.keys() == written.keys()
    for name, blocks in in_memory.items():
        assert torch.equal(blocks, written[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_embedding_is_its_float_copys_rows(home, tmp_path, dtype):
    """A Q4_K embedding (Q4_K_M's) looked up in its blocks gives the float model's rows bit for bit,
    in the model's dtype, and the float copy is never written for it; an embedding in a type
    without kernels stays float."""
    shape = {"vocab_size": 320, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    write_test_gguf(tmp_path / "m.gguf", "qwen2", shape, quantized={"token_embd": "Q4_K", "ffn_down": "Q6_K"})
    folder = convert_gguf(tmp_path / "m.gguf")
    model = load_model(folder, dtype, "cpu", max_len=64, weights="quantized")
    assert isinstance(model.embed, QuantizedEmbedding) and not (folder / gguf.DEQUANTIZED_FILE).exists()
    reference = load_model(folder, dtype, "cpu", max_len=64, weights="fp32" if dtype == torch.float32 else "bf16")
    ids = torch.tensor([[5, 319, 0, 5]])
    got = model.embed(ids)
    assert got.dtype == dtype and torch.equal(got, reference.embed(ids))
    # a head's trainer reads the tied LM head's rows (its draft vocabulary's) through its forward
    from outpace.train.answers import lm_head_rows
    rows = lm_head_rows(model, torch.tensor([3, 7]))
    assert rows.dtype == dtype
    close(rows.float(), reference.embed(torch.tensor([3, 7])).float(), 0.05)
    write_test_gguf(tmp_path / "n.gguf", "qwen2", {"vocab_size": 320}, quantized={"token_embd": "Q5_1"})
    assert type(load_model(convert_gguf(tmp_path / "n.gguf"), dtype, "cpu", max_len=64).embed) is torch.nn.Embedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_layers_stacked_compute_as_the_layers_do(home, tmp_path, monkeypatch, dtype):
    """Quantized layers, a qkv of mixed types with its biases among them, run in one
    cpu_kernels.DecoderStack call with the logits of the layers' own forwards, bit for bit."""
    kinds = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_1", "ffn_gate": "Q8_0",
             "ffn_up": "Q8_0", "ffn_down": "Q5_0", "output": "Q6_K"}
    shape = {"tie_word_embeddings": False, "vocab_size": 320, "hidden_size": 256, "intermediate_size": 512,
             "head_dim": 64}
    write_test_gguf(tmp_path / "m.gguf", "qwen2", shape, quantized=kinds)
    model = load_model(convert_gguf(tmp_path / "m.gguf"), dtype, "cpu", max_len=64, weights="quantized")
    assert model.cpu_stack(dtype) is not None and isinstance(model.layers[0].attn.qkv, QuantizedParts)

    def run():
        runner = ModelRunner(model, num_slots=2, max_len=64, max_step_tokens=64)
        return [runner.forward([Row(0, list(range(3, 30)), 0)])[0], runner.forward([Row(1, [5, 6], 0)])[0],
                runner.forward([Row(0, [7, 8, 9], 27), Row(1, [10], 2)])[0]]
    stacked = run()
    monkeypatch.setattr(DecoderLM, "cpu_stack", lambda self, dtype: None)
    for got, expected in zip(stacked, run()):
        assert torch.equal(got, expected)


def test_inputs_not_whole_blocks_are_dequantized_with_a_warning(home, tmp_path, capsys):
    """A matrix whose inputs are not whole blocks of its type (a converted folder whose block types
    say Q4_K for 64 inputs a row; llama.cpp never writes one) is left to the float copy, and stderr
    says why. The float copy is written before the types are edited, as a float load writes it."""
    write_test_gguf(tmp_path / "m.gguf", "llama", quantized={"ffn_down": "Q8_0", "ffn_gate": "Q8_0", "ffn_up": "Q8_0"})
    folder = convert_gguf(tmp_path / "m.gguf")
    gguf.dequantized_copy(folder)
    blocks = quantized.blocks_file(folder)
    with safe_open(str(blocks), framework="pt") as f:
        tensors, metadata = {n: f.get_tensor(n) for n in f.keys()}, f.metadata()
    qtypes = json.loads(metadata[QTYPES_KEY])
    qtypes.update({n: "Q4_K" for n in qtypes if "gate_proj" in n or "up_proj" in n})
    save_file(tensors, str(blocks), metadata={**metadata, QTYPES_KEY: json.dumps(qtypes)})
    capsys.readouterr()
    model = load_model(folder, torch.float32, "cpu", max_len=64)
    assert "64 inputs are not whole blocks of Q4_K (256 inputs a block): 4 matrices dequantized" in capsys.readouterr().err
    assert isinstance(model.layers[0].mlp.down, QuantizedLinear) and not isinstance(model.layers[0].mlp.gate_up, QuantizedLinear)


def test_types_without_kernels_are_dequantized_with_a_warning(home, tmp_path, capsys):
    """A Q5_1 matrix (no kernel) is dequantized, and stderr names the type, the supported ones and
    the cost; a fused layer of mixed types (q Q4_1, k and v Q5_1) is dequantized whole."""
    kinds = {"attn_q": "Q4_1", "attn_k": "Q5_1", "attn_v": "Q5_1", "ffn_down": "Q5_1", "ffn_gate": "Q8_0",
             "ffn_up": "Q8_0"}
    write_test_gguf(tmp_path / "m.gguf", "llama", quantized=kinds)
    folder = convert_gguf(tmp_path / "m.gguf")
    capsys.readouterr()
    model = load_model(folder, torch.float32, "cpu", max_len=64)
    err = capsys.readouterr().err
    # q, k, v and down of 2 layers: 32768 weights
    assert "no CPU kernels for Q5_1 (kernels: Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0): 8 matrices dequantized" in err
    assert "0.1 MB in bfloat16 (0.1 in float32) where the file holds 0.0 MB" in err
    layer = model.layers[0]
    assert isinstance(layer.mlp.gate_up, QuantizedLinear) and not isinstance(layer.mlp.down, QuantizedLinear)
    assert not isinstance(layer.attn.qkv, QuantizedLinear)
    reference = load_model(folder, torch.float32, "cpu", max_len=64, weights="fp32")
    rows = [Row(0, list(range(3, 30)), 0)]
    close(ModelRunner(model, 1, 64, 64).forward(rows)[0], ModelRunner(reference, 1, 64, 64).forward(rows)[0], 0.05)


def test_unmet_choices_say_so(default_model_dir, tmp_path, capsys):
    """On CUDA (or sharded) a GGUF is dequantized with one stderr line; weights quantized on a float
    model, or bf16 weights with a float32 dtype, are errors that say what to do."""
    assert not quantized.chosen(default_model_dir, "auto", "cuda", sharded=False)
    assert "dequantized (the quantized kernels run on the CPU)" in capsys.readouterr().err
    assert not quantized.chosen(default_model_dir, "bf16", "cpu", sharded=False)
    assert quantized.chosen(default_model_dir, "quantized", "cpu", sharded=False) == cpu_kernels.has_library()
    make_tiny("llama", tmp_path)
    assert not quantized.chosen(tmp_path, "auto", "cpu", sharded=False)
    with pytest.raises(InvalidParameterError, match="needs a GGUF model"):
        quantized.chosen(tmp_path, "quantized", "cpu", sharded=False)
    with pytest.raises(InvalidParameterError, match="leave dtype auto"):
        EngineConfig(weights="bf16", dtype="float32")
    with pytest.raises(InvalidParameterError, match="weights must be one of"):
        EngineConfig(weights="int4")
    assert EngineConfig(weights="fp32").dtype == "float32"


@pytest.mark.parametrize("weights", ["auto", "bf16"])
def test_a_draft_model_holds_its_weights_as_the_target_does(default_model_dir, weights):
    """`weights` reaches the draft model: a GGUF draft is quantized beside a quantized target and
    float beside a bf16 one (the default model drafting for itself)."""
    llm = LLM(str(default_model_dir), spec=SpecConfig(method="draft", draft_model=str(default_model_dir)),
              device="cpu", max_num_seqs=1, max_model_len=256, weights=weights, calibrate=False)
    quantized_in = [isinstance(m.lm_head, QuantizedLinear) for m in (llm.engine.model, llm.engine.drafter.model)]
    assert quantized_in == [weights == "auto"] * 2


@pytest.mark.parametrize("draft_weights", ["q4_0", "file"])
def test_a_draft_model_in_q4_0_keeps_greedy_output(default_model_dir, draft_weights):
    """The default model drafting for itself: with draft_weights q4_0 its draft copy holds every
    matrix in Q4_0 while the target keeps the file's types (Q4_1, Q8_0), with file the file's;
    greedy output equals plain greedy's either way, the rounded draft's drafts still accepted."""
    opts = dict(device="cpu", max_num_seqs=2, max_model_len=256, calibrate=False)
    spec = SpecConfig(method="draft", draft_model=str(default_model_dir), num_draft_tokens=4,
                      draft_weights=draft_weights)
    llm = LLM(str(default_model_dir), spec=spec, **opts)
    types = [{m.qtype for m in model.modules() if isinstance(m, QuantizedLinear)}
             for model in (llm.engine.model, llm.engine.drafter.model)]
    assert types[0] == {"Q4_1", "Q8_0"}
    assert types[1] == ({"Q4_0"} if draft_weights == "q4_0" else types[0])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(default_model_dir), spec="none", **opts).generate(PROMPTS, params)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in plain]
    assert llm.engine.stats.num_accepted_tokens > 0
    with pytest.raises(InvalidParameterError, match="draft_weights must be one of"):
        SpecConfig(method="draft", draft_model=str(default_model_dir), draft_weights="q2")
