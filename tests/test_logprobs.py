"""Log-probabilities of the output tokens (SamplingParams.logprobs): the target's own, at every
emitted position, whatever drafted it.

A tiny random float64 model's outputs (its logits, and so the logprobs, in float32) are checked
against transformers' forward over the whole sequence: each token's logprob and rank, and its alternatives, for plain decoding and for drafters
that are always right, always wrong, half right and trees, batched with rows that ask for none,
greedy and seeded sampling; exact mode gives a speculative request plain's bits.
"""
import pytest
import torch

from outpace import LLM, SamplingParams, SpecConfig
from outpace.engine.sequence import Status
from outpace.errors import InvalidParameterError
from test_spec_lossless import OracleDrafter, RandomDrafter
from test_trees import TreeDrafter
from tiny import make_tiny

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 200, 300, 100, 200], [7] * 30, [42]]
OPTIONS = dict(dtype="float64", device="cpu", max_num_seqs=3, max_model_len=256, max_prefill_tokens=8,
               calibrate=False)
# a GPU's graphs norm in float32 with their own reduction order (test_cuda_graphs.py): its float64
# model's logprobs agree to float32 rounding (measured on an H200: 1.05e-5 apart at most)
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tiny-llama-logprobs")
    model = make_tiny("llama", folder, vocab_size=49152, tokenizer_from=default_model_dir, dtype=torch.float64)
    return folder, model


def reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len(output), V] at each output token's position, from its
    logits rounded to float32 as the engine's are."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(output)].float(), dim=-1)


def check(model, prompt, token_ids, logprobs, num_top: int, tolerance: float = 1e-5):
    assert len(logprobs) == len(token_ids) > 0
    want = reference(model, prompt, token_ids)
    for j, (token, entry) in enumerate(zip(token_ids, logprobs)):
        first, *others = entry.items()
        assert first[0] == token, "the emitted token comes first"
        assert first[1].logprob == pytest.approx(want[j, token].item(), abs=tolerance)
        assert first[1].rank == int((want[j] > want[j, token]).sum()) + 1
        top = want[j].topk(num_top)
        assert set(entry) == {token, *top.indices.tolist()}
        for t, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t].logprob == pytest.approx(value, abs=tolerance)


@pytest.fixture(scope="module")
def plain(tiny):
    folder, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return {tuple(p): o.token_ids for p, o in zip(PROMPTS, LLM(str(folder), spec="none", **OPTIONS)
                                                  .generate(PROMPTS, params))}


@pytest.mark.parametrize("name", ["plain", "oracle", "corrupt-after-1", "random", "ngram", "trees"])
def test_greedy_logprobs_are_the_targets(tiny, plain, name):
    folder, model = tiny
    drafter = {"oracle": OracleDrafter(plain), "corrupt-after-1": OracleDrafter(plain, corrupt_after=1),
               "random": RandomDrafter(49152), "trees": TreeDrafter(plain, branching=2)}.get(name)
    spec = SpecConfig(method="none" if name == "plain" else "ngram", num_draft_tokens=5)
    llm = LLM(str(folder), spec=spec, drafter=drafter, **OPTIONS)
    # rows that ask for none share the steps: only the asking rows' entries are computed
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=None if i == 1 else 3)
              for i in range(len(PROMPTS))]
    outputs = llm.generate(PROMPTS, params)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outputs)):
        assert out.token_ids == plain[tuple(prompt)]
        if i == 1:
            assert out.logprobs is None
        else:
            check(model, prompt, out.token_ids, out.logprobs, 3)
            assert all(isinstance(lp.decoded_token, str) for e in out.logprobs for lp in e.values())
    if name in ("oracle", "trees"):
        assert sum(o.spec["num_accepted_tokens"] for o in outputs) > 0


def test_sampled_logprobs_are_the_targets_unshaped_distribution(tiny):
    """Sampled rows report the model's own distribution (before temperature and top-p), and the
    entry's first token is the one sampled."""
    folder, model = tiny
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i, max_tokens=20, ignore_eos=True, logprobs=2)
              for i in range(len(PROMPTS))]
    want = [o.token_ids for o in LLM(str(folder), spec="none", **OPTIONS).generate(PROMPTS, params)]
    llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=4), **OPTIONS)
    outputs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == want
    for prompt, out in zip(PROMPTS, outputs):
        check(model, prompt, out.token_ids, out.logprobs, 2)


def test_stops_cut_the_logprobs_with_the_tokens(tiny, plain):
    """A row that stops inside a step keeps the entries of the tokens it kept."""
    folder, _ = tiny
    prompt = PROMPTS[0]
    stop = plain[tuple(prompt)][5]
    llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=5), drafter=OracleDrafter(plain), **OPTIONS)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], logprobs=0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    assert [next(iter(e)) for e in out.logprobs] == out.token_ids
    assert all(len(e) == 1 for e in out.logprobs)


def test_exact_mode_reports_plains_bits(default_model_dir):
    """In exact mode a speculative row's verify forward computes as a plain one does, so its
    logprobs are plain's bit for bit (the default model, whose drafts the n-gram lookup finds)."""
    prompts = ["Repeat after me: one two three four, one two three four, one two",
               "List the numbers from one to ten in words."]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=4)
    opts = dict(max_num_seqs=2, calibrate=False)
    spec = LLM(str(default_model_dir), spec=SpecConfig(num_draft_tokens=6, exact=True), **opts).generate(prompts, params)
    plain = LLM(str(default_model_dir), spec=SpecConfig(method="none", num_draft_tokens=6, exact=True),
                **opts).generate(prompts, params)
    assert sum(o.spec["num_accepted_tokens"] for o in spec) > 0
    for s, p in zip(spec, plain):
        assert s.token_ids == p.token_ids
        assert [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in s.logprobs] == \
               [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in p.logprobs]


@pytest.mark.parametrize("value", [-1, 21, 2.0, True, "3"])
def test_logprobs_out_of_range_are_refused(value):
    with pytest.raises(InvalidParameterError, match="logprobs"):
        SamplingParams(logprobs=value)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_the_gpu_paths_steps_keep_asking_rows_in_the_graph(tiny, device):
    """The GPU path (its static-shape runner, device drafter and GraphStep; on the CPU run
    eagerly, on a GPU in CUDA graphs): a greedy row alone drafts and verifies inside the graph
    step and launches steps ahead; rows asking for logprobs join while such a step runs and stay
    in it (their logprobs read from the graph's logits), and every row keeps plain output and gets
    the target's logprobs."""
    from test_cuda_graphs import count_in_graph, count_launched, device_path_llm
    folder, model = tiny
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    asking = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=n) for n in (2, 0)]
    prompts = PROMPTS[:3]
    plain = LLM(str(folder), spec="none", dtype="float64", device="cpu", max_num_seqs=3, max_model_len=128)
    want = [plain.generate(p, sp)[0].token_ids for p, sp in zip(prompts, [greedy] + asking)]
    llm = device_path_llm(folder, SpecConfig(num_draft_tokens=5), device)
    engine = llm.engine
    in_graph, launched = count_in_graph(engine), count_launched(engine)
    seqs = [engine.add_request(prompts[0], greedy)]
    for _ in range(4):
        engine.step()
    assert in_graph["calls"] > 0 and launched["calls"] > 0
    seqs += [engine.add_request(p, sp) for p, sp in zip(prompts[1:], asking)]
    while any(s.is_prefilling or s.status is Status.WAITING for s in seqs[1:]):
        engine.step()
    before = in_graph["calls"] + launched["calls"]
    for _ in range(8):          # every row decodes: each step holds the rows that ask
        engine.step()
    assert in_graph["calls"] + launched["calls"] >= before + 7
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == want
    assert seqs[0].logprobs is None
    for seq, num_top in zip(seqs[1:], (2, 0)):
        check(model, seq.prompt_ids, seq.output_ids, seq.logprobs, num_top, TOLERANCE[device])


def test_prompt_logprobs_are_the_targets(tiny):
    """Each prompt token after the first, scored by the forwards that cache the prompt in chunks of
    8 beside other requests' steps; a request that asks reuses no cached prefix, so a repeat gets
    them all again."""
    folder, model = tiny
    llm = LLM(str(folder), spec=SpecConfig(num_draft_tokens=4), **OPTIONS)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2, logprobs=1),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    for _ in range(2):
        outputs = llm.generate([PROMPTS[2], PROMPTS[0]], params)
        out = outputs[0]
        assert out.num_cached_tokens == 0 and outputs[1].prompt_logprobs is None
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[2])
        prompt = PROMPTS[2]
        check(model, prompt[:1], prompt[1:], out.prompt_logprobs[1:], 2)
        check(model, prompt, out.token_ids, out.logprobs, 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_prompt_logprobs_on_the_gpu_path(tiny, device):
    from test_cuda_graphs import device_path_llm
    folder, model = tiny
    llm = device_path_llm(folder, SpecConfig(num_draft_tokens=5), device)
    # a prompt past the graphs' widths runs its chunk eagerly; one of 5 tokens fits a step's graph
    prompts = [PROMPTS[2] * 2, PROMPTS[0], PROMPTS[1]]
    asking = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=3)
    outputs = llm.generate(prompts, [asking, SamplingParams(temperature=0, max_tokens=8), asking])
    for prompt, out in zip(prompts, outputs):
        if out.prompt_logprobs is not None:
            check(model, prompt[:1], prompt[1:], out.prompt_logprobs[1:], 3, TOLERANCE[device])
