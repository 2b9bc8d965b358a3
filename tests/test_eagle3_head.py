"""The EAGLE-3 head: its published checkpoint layout, its layer's math, and heads that do not fit.

Guards: every tensor of the published layout must land in its place (a swapped gate/up half or a
norm read as another norm would still draft, badly); the layer must compute EAGLE-3's midlayer
(the embedding's norm first in the attention's 2H input, the feature as the residual, features
fused from three layers); the layers a config names are numbered as vLLM and SGLang number them;
a saved head must load back bit for bit; a head for another vocabulary, hidden size or depth, or
with a broken vocabulary map, must be refused with a message that says what to do; the head that
ships for the default model must load and draft well, and --spec eagle3 without a head on a model
that ships none must say how to train one.
"""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from outpace import LLM, SamplingParams, SpecConfig
from outpace.errors import CorruptModelError, IncompatibleModelsError, ModelNotFoundError
from outpace.model.config import ModelConfig
from outpace.model.draft_head import attend
from outpace.model.eagle3 import default_layers, load_eagle3_head, save_eagle3_head
from heads import target_config, write_eagle3_head
from tiny import make_tiny


@pytest.fixture(scope="module")
def target(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tiny-4-layers")
    make_tiny("llama-4-layers", folder, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    return folder


def test_the_published_layout_loads_into_place(target, tmp_path):
    written = write_eagle3_head(tmp_path, target_config(target), layer_ids=(1, 2, 4))
    head = load_eagle3_head(tmp_path, ModelConfig.from_folder(target), torch.float64, "cpu", 64)
    assert head.cfg.target_layers == (0, 1, 3)          # id j: the input of layer j, the output of layer j - 1
    pairs = {"fc.weight": head.fc.weight, "midlayer.self_attn.q_proj.weight": head.q.weight,
             "midlayer.self_attn.k_proj.weight": head.k.weight, "midlayer.self_attn.v_proj.weight": head.v.weight,
             "midlayer.self_attn.o_proj.weight": head.o.weight, "midlayer.mlp.down_proj.weight": head.mlp.down.weight,
             "midlayer.input_layernorm.weight": head.input_norm.weight,
             "midlayer.hidden_norm.weight": head.hidden_norm.weight,
             "midlayer.post_attention_layernorm.weight": head.post_norm.weight, "norm.weight": head.norm.weight,
             "lm_head.weight": head.lm_head.weight}
    for name, param in pairs.items():
        assert torch.equal(param, written[name]), name
    assert torch.equal(head.mlp.gate_up.weight, torch.cat([written["midlayer.mlp.gate_proj.weight"],
                                                           written["midlayer.mlp.up_proj.weight"]]))
    draft_ids = torch.arange(head.cfg.draft_vocab_size)
    assert torch.equal(head.to_target(draft_ids), written["t2d"].nonzero()[:, 0])
    assert head.embed is None                           # the target's embedding is shared


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rotate(x, positions, D):
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = positions[:, None].double() * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def test_the_layer_computes_eagle3s_midlayer(target, tmp_path):
    """A sequence of pairs through the head against EAGLE-3's equations written out plainly."""
    cfg = target_config(target)
    w = write_eagle3_head(tmp_path, cfg)
    head = load_eagle3_head(tmp_path, ModelConfig.from_folder(target), torch.float64, "cpu", 64)
    g = torch.Generator().manual_seed(1)
    S, H, heads, kv = 7, cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = H // heads
    hidden, embed = torch.randn(S, 3, H, generator=g, dtype=torch.float64), torch.randn(S, H, generator=g, dtype=torch.float64)
    positions = torch.arange(S)
    # the reference: fused feature, [norm(embedding), norm(feature)], causal attention, residuals
    feature = hidden.reshape(S, 3 * H) @ w["fc.weight"].T
    x = torch.cat([_rms(embed, w["midlayer.input_layernorm.weight"]), _rms(feature, w["midlayer.hidden_norm.weight"])], -1)
    q = _rotate((x @ w["midlayer.self_attn.q_proj.weight"].T).view(S, heads, D), positions, D)
    k = _rotate((x @ w["midlayer.self_attn.k_proj.weight"].T).view(S, kv, D), positions, D)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(S, kv, D)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("shd,thd->hst", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hst,thd->shd", scores.softmax(-1), v).reshape(S, H)
    h = feature + attn @ w["midlayer.self_attn.o_proj.weight"].T
    m = _rms(h, w["midlayer.post_attention_layernorm.weight"])
    out = h + (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) \
        @ w["midlayer.mlp.down_proj.weight"].T
    want = _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    residual, q2, k2, v2 = head.project(head.features(hidden), embed, positions)
    got = head.logits(head.finish(residual[None], attend(q2[None], k2.transpose(0, 1)[None], v2.transpose(0, 1)[None],
                                                         torch.ones(S, S, dtype=torch.bool).tril()[None, None]))[0])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_saved_head_loads_back_bit_for_bit(target, tmp_path):
    write_eagle3_head(tmp_path / "a", target_config(target), layer_ids=(1, 3, 4))
    cfg = ModelConfig.from_folder(target)
    head = load_eagle3_head(tmp_path / "a", cfg, torch.float64, "cpu", 64)
    save_eagle3_head(head, tmp_path / "b", dtype=torch.float64)
    again = load_eagle3_head(tmp_path / "b", cfg, torch.float64, "cpu", 64)
    assert again.cfg == head.cfg
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_an_int8_lm_head_loads_as_its_values_times_their_scales(target, tmp_path):
    """lm_head_int8 (outpace's extension of the layout): the LM head saved as int8 with a scale a
    row loads as those values times the scales, within half a step of each row's weights, the other
    tensors bit for bit; an int8 LM head without its scales, or scales beside a float one, is
    refused."""
    from safetensors.torch import load_file, save_file
    write_eagle3_head(tmp_path / "a", target_config(target))
    cfg = ModelConfig.from_folder(target)
    head = load_eagle3_head(tmp_path / "a", cfg, torch.float64, "cpu", 64)
    save_eagle3_head(head, tmp_path / "b", dtype=torch.float64, lm_head_int8=True)
    tensors = load_file(str(tmp_path / "b" / "model.safetensors"))
    weight, scale = tensors["lm_head.weight"], tensors["lm_head.weight_scale"]
    assert weight.dtype == torch.int8 and scale.shape == (head.cfg.draft_vocab_size,)
    assert int(weight.abs().amax(dim=1).min()) == 127   # each row's largest weight takes the full range
    again = load_eagle3_head(tmp_path / "b", cfg, torch.float64, "cpu", 64)
    assert torch.equal(again.lm_head.weight, (weight.float() * scale[:, None]).double())
    error = (again.lm_head.weight - head.lm_head.weight).abs()
    assert (error <= scale.double()[:, None] / 2 + 1e-12).all() and error.max() > 0
    for name in ("fc.weight", "q.weight", "mlp.down.weight", "norm.weight", "d2t"):
        assert torch.equal(again.get_parameter(name) if name != "d2t" else again.d2t,
                           head.get_parameter(name) if name != "d2t" else head.d2t), name
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight_scale"}, str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(CorruptModelError, match="needs lm_head.weight_scale"):
        load_eagle3_head(tmp_path / "b", cfg, torch.float64, "cpu", 64)
    save_file(dict(tensors, **{"lm_head.weight": weight.double()}), str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(CorruptModelError, match="not int8"):
        load_eagle3_head(tmp_path / "b", cfg, torch.float64, "cpu", 64)


def test_default_layers_are_eagle3s_and_distinct():
    assert default_layers(30) == (1, 14, 26)            # SmolLM2-135M: inputs of layers 2, 15 and 27
    assert default_layers(32) == (1, 15, 28)            # Llama-3.1-8B
    for n in range(3, 64):
        layers = default_layers(n)
        assert 0 <= layers[0] < layers[1] < layers[2] < n


@pytest.mark.parametrize("change, error, words", [
    (dict(vocab_size=32000), IncompatibleModelsError, "vocabulary of 32000 tokens, the target has 49152"),
    (dict(target_hidden_size=128), IncompatibleModelsError, "hidden states of size 128"),
    (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}), IncompatibleModelsError, "target has 4"),
    (dict(num_attention_heads=None), CorruptModelError, "config.json"),
])
def test_a_head_that_does_not_fit_is_refused(target, tmp_path, change, error, words):
    write_eagle3_head(tmp_path, target_config(target))
    raw = json.loads((tmp_path / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    with pytest.raises(error, match=words):
        load_eagle3_head(tmp_path, ModelConfig.from_folder(target), torch.float64, "cpu", 64)


def test_a_broken_vocabulary_map_or_missing_tensor_is_refused(target, tmp_path):
    from safetensors.torch import load_file, save_file
    write_eagle3_head(tmp_path, target_config(target))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_folder(target)
    broken = dict(tensors, d2t=torch.zeros_like(tensors["d2t"]) + 49152)
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(CorruptModelError, match="d2t does not map"):
        load_eagle3_head(tmp_path, cfg, torch.float64, "cpu", 64)
    save_file({k: v for k, v in tensors.items() if k != "fc.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CorruptModelError, match="fc.weight"):
        load_eagle3_head(tmp_path, cfg, torch.float64, "cpu", 64)


def test_the_engine_refuses_a_head_for_another_target(tmp_path, default_model_dir):
    """The CLI's path: --spec eagle3 with a head trained for another model is a clear error at load."""
    write_eagle3_head(tmp_path / "head", dict(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                              num_key_value_heads=1, vocab_size=49152))
    make_tiny("llama-4-layers", tmp_path / "target", vocab_size=49152, tokenizer_from=default_model_dir)
    with pytest.raises(IncompatibleModelsError, match="outpace train-head"):
        LLM(str(tmp_path / "target"), spec=SpecConfig(method="eagle3", draft_head=str(tmp_path / "head")),
            device="cpu", dtype="float32", calibrate=False, max_model_len=64)


def test_without_a_head_a_model_that_ships_none_is_a_clear_error(target):
    with pytest.raises(ModelNotFoundError, match="outpace train-head"):
        LLM(str(target), spec=SpecConfig(method="eagle3"), device="cpu", dtype="float64", calibrate=False,
            max_model_len=64)


def test_the_default_models_head_ships_and_drafts(default_model_dir):
    """--spec eagle3 alone on the default model takes the head that ships with the package (trained
    by outpace train-head): greedy output stays the model's own, and its drafts are accepted where
    a head that knows nothing would almost never be (its products in Q4_0 beside the quantized
    target)."""
    llm = LLM("smollm2-135m", spec=SpecConfig(method="eagle3"), device="cpu", dtype="float32", calibrate=False,
              max_num_seqs=1, max_model_len=512)
    messages = [{"role": "user", "content": "Explain step by step how to compute 17 * 23."}]
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    spec = llm.chat(messages, params)[0]
    assert spec.token_ids == llm.chat(messages, params, speculate=False)[0].token_ids
    assert spec.spec["num_draft_tokens"] > 0
    # a random head's argmax almost never is the target's token; this head's: 41 of 419 here
    assert spec.spec["num_accepted_tokens"] >= max(10, 0.03 * spec.spec["num_draft_tokens"])
    # beside the quantized target (the GGUF's matrices kept, weights auto), the head's are Q4_0
    from outpace.kernels.cpu_linear import QuantizedLinear
    if isinstance(llm.engine.model.layers[0].mlp.down, QuantizedLinear):
        head = llm.engine.drafter.head
        assert all(isinstance(m, QuantizedLinear) and m.qtype == "Q4_0" for m in (head.fc, head.qkv, head.lm_head))
