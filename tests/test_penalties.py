"""Repetition, frequency and presence penalties, logit bias and min_tokens: plain decoding applies
them as a reference loop over transformers' logits does, and speculation keeps plain's output
under them whatever drafts (each verified position shaped with the drafts before it counted:
chains and trees, greedy and seeded sampling, batched with rows that have none, drafters that
propose the very tokens the bias or min_tokens bars).
"""
import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.errors import InvalidParameterError
from test_spec_lossless import OracleDrafter, RandomDrafter
from test_trees import TreeDrafter
from tiny import make_tiny

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42]]
OPTIONS = dict(dtype="float64", device="cpu", max_num_seqs=3, max_model_len=256, max_prefill_tokens=8,
               calibrate=False)
PENALTIES = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.9), dict(presence_penalty=1.5),
             dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.5), {}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tiny-llama-penalties")
    model = make_tiny("llama", folder, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    return folder, model


def params(i: int, **extra) -> SamplingParams:
    return SamplingParams(**dict(temperature=0, max_tokens=24, ignore_eos=True) | PENALTIES[i % len(PENALTIES)] | extra)


def reference(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding over transformers' logits (rounded to float32 as the engine's are), each
    step biased, its stop tokens barred before min_tokens, and penalized from the prompt and the
    output so far (EOS ignored: the stop tokens are p.stop_token_ids)."""
    out = []
    for _ in range(p.max_tokens):
        with torch.no_grad():
            x = model(torch.tensor([prompt + out])).logits[0, -1].float()
        for token, bias in (p.logit_bias or {}).items():
            x[token] += bias
        if len(out) < p.min_tokens:
            x[p.stop_token_ids] = float("-inf")
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[0]).float()
        if p.repetition_penalty != 1:
            seen = counts > 0
            seen[prompt] = True
            x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        out.append(int(x.argmax()))
        if out[-1] in p.stop_token_ids:
            break
    return out


@pytest.fixture(scope="module")
def plain(tiny):
    folder, model = tiny
    llm = LLM(str(folder), spec="none", **OPTIONS)
    return [o.token_ids for o in llm.generate(PROMPTS, [params(i) for i in range(len(PROMPTS))])]


def test_plain_decoding_penalizes_as_the_reference(tiny, plain):
    _, model = tiny
    unpenalized = [o.token_ids for o in LLM(str(tiny[0]), spec="none", **OPTIONS).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    for i, (prompt, out) in enumerate(zip(PROMPTS, plain)):
        assert out == reference(model, prompt, params(i)), PENALTIES[i]
    assert all(plain[i] != unpenalized[i] for i in (0, 2, 3)), "the penalties must change these outputs"


@pytest.mark.parametrize("name", ["oracle", "corrupt-after-1", "random", "ngram", "trees"])
def test_speculation_keeps_penalized_output(tiny, plain, name):
    folder, _ = tiny
    truth = {tuple(p): o for p, o in zip(PROMPTS, plain)}
    drafter = {"oracle": OracleDrafter(truth), "corrupt-after-1": OracleDrafter(truth, corrupt_after=1),
               "random": RandomDrafter(49152), "trees": TreeDrafter(truth, branching=2)}.get(name)
    llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=5), drafter=drafter, **OPTIONS)
    outputs = llm.generate(PROMPTS, [params(i) for i in range(len(PROMPTS))])
    assert [o.token_ids for o in outputs] == plain
    if name in ("oracle", "trees"):
        assert sum(o.spec["num_accepted_tokens"] for o in outputs) > 0


def test_sampled_penalized_speculation_is_plain_seeded_sampling(tiny):
    folder, _ = tiny
    asks = [params(i, temperature=0.9, top_p=0.95, seed=11 + i) for i in range(len(PROMPTS))]
    want = [o.token_ids for o in LLM(str(folder), spec="none", **OPTIONS).generate(PROMPTS, asks)]
    truth = {tuple(p): o for p, o in zip(PROMPTS, want)}
    for drafter in (OracleDrafter(truth), TreeDrafter(truth, seed=3), None):
        llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=4), drafter=drafter, **OPTIONS)
        assert [o.token_ids for o in llm.generate(PROMPTS, asks)] == want


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_the_gpu_paths_steps_penalize_outside_the_graph(tiny, plain, device):
    from test_cuda_graphs import device_path_llm
    folder, _ = tiny
    llm = device_path_llm(folder, SpecConfig(num_draft_tokens=5), device)
    outputs = llm.generate(PROMPTS[:3], [params(i) for i in range(3)])
    assert [o.token_ids for o in outputs] == plain[:3]


@pytest.fixture(scope="module")
def unshaped(tiny):
    folder, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.token_ids for o in LLM(str(folder), spec="none", **OPTIONS).generate(PROMPTS, params)]


def shaping(i: int, unshaped: list[list[int]], **extra) -> SamplingParams:
    """Logit bias and min_tokens aimed at prompt i's unshaped greedy output u: the first prompt's
    first token barred and its fifth raised; a strong bias beside a frequency penalty; the third
    prompt's fifth token (which comes back every other token) a stop token barred for 9 tokens,
    the fourth prompt's second (back at the eighth) one barred for 8."""
    u = unshaped[i]
    shape = [dict(logit_bias={u[0]: -100, u[4]: 4.0}), dict(logit_bias={u[1]: 30}, frequency_penalty=0.9),
             dict(stop_token_ids=[u[4]], min_tokens=9), dict(stop_token_ids=[u[1]], min_tokens=8)]
    return SamplingParams(**dict(temperature=0, max_tokens=24, ignore_eos=True) | shape[i] | extra)


@pytest.fixture(scope="module")
def shaped(tiny, unshaped):
    folder, _ = tiny
    llm = LLM(str(folder), spec="none", **OPTIONS)
    return [o.token_ids for o in llm.generate(PROMPTS, [shaping(i, unshaped) for i in range(len(PROMPTS))])]


def test_plain_decoding_biases_and_bars_as_the_reference(tiny, unshaped, shaped):
    _, model = tiny
    for i, (prompt, out) in enumerate(zip(PROMPTS, shaped)):
        p = shaping(i, unshaped)
        assert out == reference(model, prompt, p), p
        assert out != unshaped[i][:len(out)], "the shaping must change this output"
    # unshaped, each stop token comes back before min_tokens
    assert unshaped[2][4] in unshaped[2][5:9] and unshaped[3][1] in unshaped[3][2:8]
    for i in (2, 3):        # shaped, neither before min_tokens
        p = shaping(i, unshaped)
        assert p.stop_token_ids[0] not in shaped[i][:p.min_tokens]
    # and the third stops on its stop token after min_tokens
    assert shaped[2][-1] == unshaped[2][4] and len(shaped[2]) > 9


@pytest.mark.parametrize("name", ["unshaped", "oracle", "corrupt-after-1", "random", "trees"])
def test_speculation_keeps_biased_and_barred_output(tiny, unshaped, shaped, name):
    """"unshaped" drafts what the model picks without the shaping: the very tokens it bars."""
    folder, _ = tiny
    truth = {tuple(p): o for p, o in zip(PROMPTS, shaped)}
    drafter = {"unshaped": OracleDrafter({tuple(p): o for p, o in zip(PROMPTS, unshaped)}),
               "oracle": OracleDrafter(truth), "corrupt-after-1": OracleDrafter(truth, corrupt_after=1),
               "random": RandomDrafter(49152), "trees": TreeDrafter(truth, branching=2)}[name]
    llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=5), drafter=drafter, **OPTIONS)
    outputs = llm.generate(PROMPTS, [shaping(i, unshaped) for i in range(len(PROMPTS))])
    assert [o.token_ids for o in outputs] == shaped
    if name in ("oracle", "trees"):
        assert sum(o.spec["num_accepted_tokens"] for o in outputs) > 0


def test_sampled_biased_and_barred_speculation_is_plain_seeded_sampling(tiny, unshaped):
    folder, _ = tiny
    asks = [shaping(i, unshaped, temperature=0.9, seed=5 + i) for i in range(len(PROMPTS))]
    want = [o.token_ids for o in LLM(str(folder), spec="none", **OPTIONS).generate(PROMPTS, asks)]
    truth = {tuple(p): o for p, o in zip(PROMPTS, want)}
    for drafter in (OracleDrafter(truth), TreeDrafter(truth, seed=3), OracleDrafter(
            {tuple(p): o for p, o in zip(PROMPTS, unshaped)})):
        llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=4), drafter=drafter, **OPTIONS)
        assert [o.token_ids for o in llm.generate(PROMPTS, asks)] == want


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_the_gpu_paths_steps_bias_and_bar_outside_the_graph(tiny, unshaped, shaped, device):
    from test_cuda_graphs import device_path_llm
    folder, _ = tiny
    llm = device_path_llm(folder, SpecConfig(num_draft_tokens=5), device)
    outputs = llm.generate(PROMPTS[1:], [shaping(i, unshaped) for i in range(1, 4)])
    assert [o.token_ids for o in outputs] == shaped[1:]


@pytest.mark.parametrize("fields, words", [
    (dict(logit_bias={5: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(logit_bias={"5": 1}), "logit_bias"), (dict(logit_bias={5: True}), "logit_bias"),
    (dict(logit_bias={i: 1 for i in range(1025)}), "at most 1024"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=17, max_tokens=16), "min_tokens"),
])
def test_bias_and_min_tokens_out_of_range_are_refused(fields, words):
    with pytest.raises(InvalidParameterError, match=words):
        SamplingParams(**fields)


def test_a_bias_past_the_vocabulary_is_refused(tiny):
    llm = LLM(str(tiny[0]), spec="none", **OPTIONS)
    with pytest.raises(InvalidParameterError, match="logit_bias names token 49152"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={49152: 1}))


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3),
                                          ("repetition_penalty", 0), ("repetition_penalty", 101),
                                          ("presence_penalty", True)])
def test_penalties_out_of_range_are_refused(field, value):
    with pytest.raises(InvalidParameterError, match=field):
        SamplingParams(**{field: value})
