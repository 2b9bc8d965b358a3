"""Sampler properties: seeded draws are reproducible and batch-independent, filters are exact.

Statistical tests use fixed seeds and a chi-square test at significance 0.001.
"""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from outpace.config import SamplingParams
from outpace.sampling.sampler import MAX_NUM_DRAFT, SamplingState, logits_to_probs, make_generator, sample

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ALPHA = 0.001


def reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """A per-row float64 re-statement of the shaping rules, written independently of the sampler."""
    z = logits / params.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    allowed = order[: params.top_k] if params.top_k > 0 else order
    kept, mass, total = [], 0.0, p[allowed].sum()
    for token in allowed:  # nucleus over the top-k distribution renormalised
        kept.append(token)
        mass += p[token] / total
        if mass >= params.top_p:
            break
    kept = [t for t in kept if p[t] >= params.min_p * p.max()]
    out = np.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


TOY_LOGITS = np.log(np.array([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02]))
FILTERS = [
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.6),  # keeps 0.30, 0.22, 0.16 (0.52 < 0.6 <= 0.68)
    SamplingParams(min_p=0.35),  # keeps p >= 0.105: four tokens
    SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1),
    SamplingParams(temperature=1.5),
]


def test_probs_match_reference_per_row():
    """Different filters on different rows of one batch (full sort, as some rows have no top-k)
    and each row alone (partial sort by torch.topk when it has a top-k) give its own distribution."""
    logits = torch.tensor(TOY_LOGITS, dtype=torch.float32).expand(len(FILTERS), -1)
    probs = logits_to_probs(logits, SamplingState.from_params(FILTERS))
    for row, params in enumerate(FILTERS):
        expected = reference_probs(TOY_LOGITS, params)
        np.testing.assert_allclose(probs[row].numpy(), expected, atol=1e-6)
        alone = logits_to_probs(logits[:1], SamplingState.from_params([params]))
        np.testing.assert_allclose(alone[0].numpy(), expected, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_filtered_tokens_never_drawn_and_frequencies_match(device):
    """top-k / top-p / min-p never emit a filtered token; kept tokens follow the renormalised
    probabilities (chi-square, significance 0.001). 40k draws per filter, all in one batch."""
    torch.manual_seed(0)
    draws = 40_000
    params = [p for p in FILTERS for _ in range(draws)]
    logits = torch.tensor(TOY_LOGITS, dtype=torch.float32, device=device).expand(len(params), -1)
    state = SamplingState.from_params(params, device=device)
    tokens = sample(logits_to_probs(logits, state), state.generators, state.is_greedy_rows).cpu().numpy()
    for i, p in enumerate(FILTERS):
        counts = np.bincount(tokens[i * draws:(i + 1) * draws], minlength=len(TOY_LOGITS))
        expected = reference_probs(TOY_LOGITS, p)
        assert counts[expected == 0].sum() == 0, f"{p}: filtered token drawn"
        kept = expected > 0
        assert chisquare(counts[kept], expected[kept] / expected[kept].sum() * draws).pvalue > ALPHA, p


@pytest.mark.parametrize("device", DEVICES)
def test_documented_random_consumption(device):
    """A seeded sampled row draws exactly torch.rand(V + MAX_NUM_DRAFT, float64) per call and picks
    argmax p / -log(u[:V]): the contract that speculative verification also follows."""
    torch.manual_seed(4)
    vocab = 30
    logits = torch.randn(3, vocab, device=device)
    params = [SamplingParams(temperature=0.9, seed=5), SamplingParams(), SamplingParams(temperature=0.0, seed=6)]
    generators = [make_generator(p.seed, device) for p in params]
    state = SamplingState.from_params(params, generators, device)
    probs = logits_to_probs(logits, state)
    tokens = sample(probs, state.generators, state.is_greedy_rows)
    replay = make_generator(5, device)
    u = torch.rand(vocab + MAX_NUM_DRAFT, dtype=torch.float64, generator=replay, device=device)
    assert tokens[0] == (probs[0] / -torch.log(u[:vocab]).float()).argmax()
    assert torch.equal(generators[0].get_state(), replay.get_state())
    assert torch.equal(generators[2].get_state(), make_generator(6, device).get_state())  # greedy: untouched


def test_top_p_always_keeps_the_top_token():
    """A tiny top_p still leaves one token: the most likely one."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    probs = logits_to_probs(logits, SamplingState.from_params([SamplingParams(top_p=1e-6)]))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_zero_is_argmax_and_consumes_no_randomness(device):
    """Greedy rows are the argmax, in an all-greedy batch and beside sampled rows, and leave their
    generator untouched."""
    torch.manual_seed(1)
    logits = torch.randn(6, 50, device=device)
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(top_k=5) for i in range(6)]
    generators = [make_generator(i, device) for i in range(6)]
    before = [g.get_state() for g in generators]
    for batch in (params, [SamplingParams(temperature=0.0)] * 6):
        state = SamplingState.from_params(batch, generators, device)
        tokens = sample(logits_to_probs(logits, state), state.generators, state.is_greedy_rows)
        greedy = torch.tensor(state.is_greedy_rows, device=device)
        assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    for row in range(0, 6, 2):
        assert torch.equal(generators[row].get_state(), before[row])


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_is_reproducible_and_batch_independent(device):
    """A seeded row's tokens depend only on its seed and its logits: the same with other rows,
    other batch sizes, other positions in the batch, unseeded neighbours, greedy neighbours."""
    vocab, steps = 100, 5
    torch.manual_seed(2)
    mine = torch.randn(steps, vocab, device=device)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(num_others: int, position: int, seeded_others: bool) -> list[int]:
        generator = make_generator(params.seed, device)
        others = [SamplingParams(temperature=t, top_k=k) for t, k in zip([0.0, 1.3, 0.5, 0.0, 2.0], [0, 7, 0, 0, 3])]
        others = (others * 4)[:num_others]
        other_generators = [make_generator(100 + i, device) if seeded_others else None for i in range(num_others)]
        batch = others[:position] + [params] + others[position:]
        generators = other_generators[:position] + [generator] + other_generators[position:]
        state = SamplingState.from_params(batch, generators, device)
        tokens = []
        for step in range(steps):
            logits = torch.randn(len(batch), vocab, device=device) * 3
            logits[position] = mine[step]
            tokens.append(sample(logits_to_probs(logits, state), state.generators, state.is_greedy_rows)[position])
        return torch.stack(tokens).tolist()

    reference = run(0, 0, False)
    assert reference == run(0, 0, False)
    for num_others, position, seeded in [(3, 1, False), (7, 7, True), (12, 4, True), (12, 0, False)]:
        assert run(num_others, position, seeded) == reference


def test_three_dim_logits_match_repeated_rows():
    """[B, S, V] logits shape the same as the flattened [B*S, V] with each row repeated S times."""
    torch.manual_seed(3)
    params = [SamplingParams(temperature=0.8, top_k=4), SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.7, min_p=0.05)]
    logits = torch.randn(3, 4, 20)
    state = SamplingState.from_params(params)
    flat = logits_to_probs(logits.reshape(12, 20), state.repeat_rows(4))
    assert torch.allclose(logits_to_probs(logits, state).reshape(12, 20), flat)
