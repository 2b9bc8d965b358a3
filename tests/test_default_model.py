"""The default model (SmolLM2-135M-Instruct Q4_1, from its GGUF) against transformers, and exact mode.

transformers dequantizes the GGUF to float32, so the comparisons with it load the float32 copy
(weights fp32); the quantized model's products round their inputs to int8 (tests/test_cpu_quant.py)."""
import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.kernels import cpu_isa
from outpace.runner.model_runner import ModelRunner, Row
from outpace.weights.loader import load_model

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Summarize: Paris is the capital of France. It is known for the Eiffel Tower. Summary:",
]


@pytest.fixture(scope="module")
def reference(default_gguf):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm_plain(default_model_dir):
    return LLM(str(default_model_dir), spec="none", weights="fp32", device="cpu", max_num_seqs=1)


def test_logits_match_transformers(default_model_dir, reference, llm_plain):
    """A prompt forward and cached decoding agree with transformers within float32 rounding."""
    ids = llm_plain.tokenizer.encode(PROMPTS[0])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    model = load_model(default_model_dir, torch.float32, "cpu", max_len=256, weights="fp32")
    runner = ModelRunner(model, num_slots=1, max_len=256, max_step_tokens=64)
    full, _ = runner.forward([Row(0, ids, 0)])
    torch.testing.assert_close(full[0], expected, atol=2e-3, rtol=1e-3)
    runner.forward([Row(0, ids[:5], 0)], logits="none")
    for pos in range(5, len(ids)):
        step, _ = runner.forward([Row(0, [ids[pos]], pos)])
        torch.testing.assert_close(step[0, 0], expected[pos], atol=2e-3, rtol=1e-3)


def test_greedy_matches_transformers_generate(reference, llm_plain):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm_plain.generate(PROMPTS, params)):
        ids = torch.tensor([llm_plain.tokenizer.encode(prompt)])
        with torch.no_grad():
            ref = reference.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist(), prompt


# float32 at this machine's top kernel level, bfloat16 at each level it executes
LEVELS = cpu_isa.testable()
DTYPE_LEVELS = [("float32", LEVELS[-1])] + [("bfloat16", level) for level in LEVELS]


@pytest.mark.parametrize("dtype,cpu_level", DTYPE_LEVELS, indirect=["cpu_level"])
def test_exact_mode_speculation_is_bit_identical(default_model_dir, dtype, cpu_level):
    """In exact mode every forward's arithmetic is independent of its token count, so speculative
    greedy output equals plain greedy output bit for bit, in either dtype."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    opts = dict(dtype=dtype, device="cpu", max_num_seqs=1, max_model_len=512)
    spec = LLM(str(default_model_dir), spec=SpecConfig(num_draft_tokens=6, exact=True), **opts)
    plain = LLM(str(default_model_dir), spec=SpecConfig(method="none", num_draft_tokens=6, exact=True), **opts)
    spec_out = [o.token_ids for o in spec.generate(PROMPTS, params)]
    plain_out = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert spec_out == plain_out
    assert spec.engine.stats.num_accepted_tokens > 0, "the prompts were chosen to give accepted drafts"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_forwards_compute_each_token_alike(default_model_dir, dtype, cpu_level):
    """On the CPU with the kernels (every instruction-set level), a token's logits do not depend
    on what else its forward holds: a verify row of several tokens packed beside another sequence's
    row gives each token the bits of its own one-token step. Fast mode's speculative greedy output
    is then bit-identical to plain decoding there, as exact mode's is everywhere."""
    model = load_model(default_model_dir, dtype, "cpu", max_len=256)
    runner = ModelRunner(model, num_slots=2, max_len=256, max_step_tokens=64)
    prompts, draft = [list(range(1000, 1040)), list(range(2000, 2023))], [5, 17, 300, 42, 7, 9000]
    for slot, prompt in enumerate(prompts):
        runner.forward([Row(slot, prompt, 0)], logits="none")
    alone = [runner.forward([Row(0, [t], len(prompts[0]) + i)])[0][0, 0].clone() for i, t in enumerate(draft)]
    other = runner.forward([Row(1, [11], len(prompts[1]))])[0][0, 0].clone()
    together, _ = runner.forward([Row(0, draft, len(prompts[0])), Row(1, [11], len(prompts[1]))])
    for i in range(len(draft)):
        assert torch.equal(together[0, i], alone[i]), i
    assert torch.equal(together[1, 0], other)


def test_bf16_prompt_chunks_compute_in_float32(default_model_dir, monkeypatch, cpu_level):
    """On a CPU without bfloat16 dot products a long bf16 prompt chunk of a model with dense
    weights runs in float32 (weights and cache stay bf16): the decode step after it sees the
    float32 model's logits about as closely as after a bf16 prefill."""
    from outpace.runner.model_runner import FP32_PREFILL_MIN_TOKENS
    from outpace.kernels import cpu_kernels
    monkeypatch.setattr(cpu_kernels, "has_bf16_dot", lambda: False)
    ids = list(range(1000, 1000 + 3 * FP32_PREFILL_MIN_TOKENS // 2))
    last = [ids.pop()]
    dense = {torch.float32: "fp32", torch.bfloat16: "bf16"}      # not the GGUF's blocks
    logits = {}
    for dtype, chunk in ((torch.float32, len(ids)), (torch.bfloat16, len(ids)), (torch.bfloat16, 32)):
        model = load_model(default_model_dir, dtype, "cpu", max_len=512, weights=dense[dtype])
        runner = ModelRunner(model, num_slots=1, max_len=512, max_step_tokens=64)
        seen = []
        hook = runner.model.register_forward_pre_hook(      # the dtype the forward computes in
            lambda m, args, kwargs: seen.append(kwargs["compute_dtype"] or dtype), with_kwargs=True)
        for start in range(0, len(ids), chunk):
            runner.forward([Row(0, ids[start:start + chunk], start)], logits="none")
        hook.remove()
        assert set(seen) == {torch.float32 if chunk >= FP32_PREFILL_MIN_TOKENS else dtype}
        assert runner.cache.k[0].dtype == dtype
        logits[dtype, chunk] = runner.forward([Row(0, last, len(ids))])[0][0, 0]
    reference = logits[torch.float32, len(ids)]
    fp32_chunk = (logits[torch.bfloat16, len(ids)] - reference).abs().max().item()
    bf16_chunks = (logits[torch.bfloat16, 32] - reference).abs().max().item()
    print(f"max |logit - float32 model's|: float32 chunk {fp32_chunk:.3f}, bf16 chunks {bf16_chunks:.3f}")
    assert fp32_chunk < 1.5 * bf16_chunks + 0.05
