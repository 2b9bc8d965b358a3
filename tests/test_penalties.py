"""Repetition, frequency and presence penalties: plain decoding applies them as a reference loop
over transformers' logits does, and speculation keeps plain's output under them whatever drafts
(each verified position penalized with the drafts before it counted: chains and trees, greedy and
seeded sampling, batched with rows that have none).
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
    step penalized from the prompt and the output so far."""
    out = []
    for _ in range(p.max_tokens):
        with torch.no_grad():
            x = model(torch.tensor([prompt + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[0]).float()
        if p.repetition_penalty != 1:
            seen = counts > 0
            seen[prompt] = True
            x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        out.append(int(x.argmax()))
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


def test_the_gpu_paths_steps_penalize_outside_the_graph(tiny, plain):
    from test_cuda_graphs import device_path_llm
    folder, _ = tiny
    llm = device_path_llm(folder, SpecConfig(num_draft_tokens=5))
    outputs = llm.generate(PROMPTS[:3], [params(i) for i in range(3)])
    assert [o.token_ids for o in outputs] == plain[:3]


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3),
                                          ("repetition_penalty", 0), ("repetition_penalty", 101),
                                          ("presence_penalty", True)])
def test_penalties_out_of_range_are_refused(field, value):
    with pytest.raises(InvalidParameterError, match=field):
        SamplingParams(**{field: value})
