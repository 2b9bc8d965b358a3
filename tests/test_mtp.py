"""Multi-token prediction through the hidden-state interface, on tiny random MTP modules (no real
MTP weights were reachable).

Guards: both layouts (Qwen3-Next's mtp.*, DeepSeek-V3's extra layer) must load into place and
compute the module's equations (the embedding's norm first in the concatenation, the target's
final norm on its hidden state, the target's own LM head), also as the CPU drafter runs it (q, k
and v as one product, norms and rotation in the CPU kernels); drafting with it keeps greedy output,
chains and trees, with the module shipped inside the target's folder; what the module does not
implement is refused by name.
"""
import shutil

import pytest
import torch
import torch.nn.functional as F

from outpace import LLM, SamplingParams, SpecConfig
from outpace.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError
from outpace.model.draft_head import attend
from outpace.model.mtp import load_mtp_head
from outpace.weights.loader import load_model
from heads import target_config, write_mtp
from tiny import make_tiny

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42]]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
OPTIONS = dict(dtype="float64", device="cpu", max_num_seqs=2, max_model_len=128, max_prefill_tokens=8,
               calibrate=False)


@pytest.fixture(scope="module")
def target(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tiny-llama-mtp")
    make_tiny("llama", folder, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    return folder


@pytest.fixture(scope="module")
def plain(target):
    return [o.token_ids for o in LLM(str(target), spec="none", **OPTIONS).generate(PROMPTS, PARAMS)]


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("layout", ["qwen3_next", "deepseek_v3"])
def test_the_module_computes_its_equations(target, tmp_path, layout, kernels):
    """One pair at position 0 (it attends to itself alone, so attention is its value projection).
    kernels: as a CPU drafter runs it, in float32 with q, k and v as one product and the norms,
    SwiGLU and rotation through cpu_kernels."""
    from outpace.kernels import cpu_kernels
    if kernels and not cpu_kernels.has_library():
        pytest.skip("no C compiler: the CPU kernels are not built")
    w = write_mtp(tmp_path, target_config(target), layout)
    model = load_model(target, torch.float64, "cpu", 64)
    head = load_mtp_head(tmp_path, model, torch.float64, "cpu", 64)
    if kernels:         # the equations below read the float64 model's weights
        head = load_mtp_head(tmp_path, load_model(target, torch.float32, "cpu", 64), torch.float32, "cpu", 64)
        head.fuse_qkv()
        head.kernels = True
    p = "mtp." if layout == "qwen3_next" else "model.layers.2."
    layer = "mtp.layers.0." if layout == "qwen3_next" else p
    names = (("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm") if layout == "qwen3_next"
             else ("enorm", "hnorm", "eh_proj", "shared_head.norm"))
    e_norm, h_norm, proj, final = (w[p + n + ".weight"] for n in names)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, 1, 64, generator=g, dtype=torch.float64)     # the target's last layer, before its norm
    token = torch.tensor([1234])
    embed = model.embed(token).double()
    x = torch.cat([_rms(embed, e_norm), _rms(_rms(hidden[:, 0], model.norm.weight), h_norm)], -1) @ proj.T
    heads, kv = 4, 2
    v = _rms(x, w[layer + "input_layernorm.weight"]) @ w[layer + "self_attn.v_proj.weight"].T
    h = x + v.view(1, kv, 16).repeat_interleave(heads // kv, 1).reshape(1, 64) @ w[layer + "self_attn.o_proj.weight"].T
    m = _rms(h, w[layer + "post_attention_layernorm.weight"])
    out = h + (F.silu(m @ w[layer + "mlp.gate_proj.weight"].T) * (m @ w[layer + "mlp.up_proj.weight"].T)) \
        @ w[layer + "mlp.down_proj.weight"].T
    want = _rms(out, final) @ model.lm_head.weight.T
    dtype = head.norm.weight.dtype
    residual, q, k, vv = head.project(head.features(hidden.to(dtype)), embed.to(dtype), torch.tensor([0]))
    got = head.logits(head.finish(residual[None], attend(q[None], k.transpose(0, 1)[None], vv.transpose(0, 1)[None],
                                                         torch.ones(1, 1, 1, 1, dtype=torch.bool)))[0])
    torch.testing.assert_close(got.double(), want, rtol=1e-4 if kernels else 1e-5, atol=1e-3 if kernels else 1e-4)
    assert head.cfg.target_layers == (1,) and (kernels or head.lm_head is model.lm_head)
    assert not any(n.startswith("lm_head") for n in head.state_dict())     # the target's, not the module's


@pytest.mark.parametrize("tree_width", [1, 2])
def test_mtp_inside_the_targets_folder_keeps_greedy_output(target, plain, tmp_path, tree_width):
    folder = tmp_path / "with-mtp"
    shutil.copytree(target, folder)
    write_mtp(folder, target_config(target))                # beside the model's own weights, as Qwen3-Next ships it
    spec = SpecConfig(method="mtp", draft_head=str(folder), num_draft_tokens=4, tree_width=tree_width)
    llm = LLM(str(folder), spec=spec, **OPTIONS)
    out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in out] == plain
    assert sum(o.spec["num_draft_tokens"] for o in out) > 0
    assert sorted(llm.engine.scheduler.free_slots) == [0, 1]


def test_what_the_module_does_not_implement_is_refused(target, tmp_path):
    model = load_model(target, torch.float64, "cpu", 64)
    cfg = target_config(target)
    with pytest.raises(ModelNotFoundError, match="no multi-token-prediction module"):
        load_mtp_head(target, model, torch.float64, "cpu", 64)
    write_mtp(tmp_path / "moe", cfg, extra={"mtp.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(4, 64)})
    with pytest.raises(UnsupportedModelError, match="mixture of experts"):
        load_mtp_head(tmp_path / "moe", model, torch.float64, "cpu", 64)
    gated = write_mtp(tmp_path / "gated", cfg)
    gated["mtp.layers.0.self_attn.q_proj.weight"] = torch.zeros(128, 64, dtype=torch.float64)
    from safetensors.torch import save_file
    save_file(gated, str(tmp_path / "gated" / "mtp.safetensors"))
    with pytest.raises(CorruptModelError, match="gated attention"):
        load_mtp_head(tmp_path / "gated", model, torch.float64, "cpu", 64)
