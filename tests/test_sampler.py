"""Sampler properties: the noise is a pure function of seed and position, draws follow the shaped
distribution, seeded draws are batch-independent, filters are exact.

Statistical tests use fixed seeds and a chi-square test at significance 0.001.
"""
import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from outpace.config import SamplingParams
from outpace.sampling.sampler import SamplingState, inverse_cdf, logits_to_probs, sample, uniforms

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ALPHA = 0.001
M64 = (1 << 64) - 1


def state_of(params, device="cpu", positions=None) -> SamplingState:
    """Row i seeded with i."""
    return SamplingState.from_params(params, list(range(len(params))), positions, device)


def reference_uniform(seed: int, position: int) -> float:
    """splitmix64 written out on Python integers: the key is the mixed seed, the counter the position."""
    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)
    z = mix(mix(seed & M64) + (position + 1) * 0x9E3779B97F4A7C15 & M64)
    return (z >> 11) / 2**53


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


@pytest.mark.parametrize("device", DEVICES)
def test_noise_is_a_pure_function_of_seed_and_position(device):
    """u(seed, i), as the state sends it to the device, equals splitmix64 on Python integers, for
    seeds anywhere in the int64 range and beyond it (taken mod 2**64) and positions far into a
    long output."""
    rng = random.Random(0)
    seeds = [0, 1, 2**63 - 1, -1, 2**64 + 5] + [rng.getrandbits(63) for _ in range(11)]
    starts = [rng.randrange(2**40) for _ in seeds[:-3]] + [0, 1, 2]
    state = SamplingState.from_params([SamplingParams()] * len(seeds), seeds, starts, device)
    got = state.uniforms(7).cpu()
    expected = torch.tensor([[reference_uniform(s, p + i) for i in range(7)] for s, p in zip(seeds, starts)],
                            dtype=torch.float64)
    assert torch.equal(got, expected)
    assert ((got >= 0) & (got < 1)).all()
    assert torch.equal(torch.from_numpy(uniforms(seeds, starts, 7)), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_cdf_matches_a_running_sum(device):
    """inverse_cdf (blocked sums) picks the first token whose float64 running sum exceeds u * total,
    for vocabularies that are and are not multiples of its block, with zero weights between, and
    u at both ends of [0, 1); it never picks a token of zero weight."""
    torch.manual_seed(5)
    for vocab in (1, 6, 255, 256, 300, 49152):
        weights = torch.softmax(torch.randn(7, 9, vocab, device=device) * 3, -1)
        if vocab > 1:
            weights[..., ::3] = 0
            weights[0, 0, :-1], weights[0, 0, -1] = 0, 1                # only the last token
        u = torch.rand(7, 9, dtype=torch.float64, device=device)
        u[1, :3] = torch.tensor([0.0, 1 - 2**-53, 0.5**60], dtype=torch.float64)
        cum = weights.double().cumsum(-1)
        expected = (cum <= (u * cum[..., -1])[..., None]).sum(-1).clamp_max(vocab - 1)
        got = inverse_cdf(weights, u)
        assert torch.equal(got, expected), vocab
        assert (weights.gather(-1, got[..., None]) > 0).all()


def test_probs_match_reference_per_row():
    """Different filters on different rows of one batch (full sort, as some rows have no top-k)
    and each row alone (partial sort by torch.topk when it has a top-k) give its own distribution."""
    logits = torch.tensor(TOY_LOGITS, dtype=torch.float32).expand(len(FILTERS), -1)
    probs = logits_to_probs(logits, state_of(FILTERS))
    for row, params in enumerate(FILTERS):
        expected = reference_probs(TOY_LOGITS, params)
        np.testing.assert_allclose(probs[row].numpy(), expected, atol=1e-6)
        alone = logits_to_probs(logits[:1], state_of([params]))
        np.testing.assert_allclose(alone[0].numpy(), expected, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_filtered_tokens_never_drawn_and_frequencies_match(device):
    """top-k / top-p / min-p never emit a filtered token; kept tokens follow the renormalised
    probabilities (chi-square, significance 0.001). 40k draws per filter, one seed per row, all in
    one batch."""
    draws = 40_000
    params = [p for p in FILTERS for _ in range(draws)]
    logits = torch.tensor(TOY_LOGITS, dtype=torch.float32, device=device).expand(len(params), -1)
    state = state_of(params, device)
    tokens = sample(logits_to_probs(logits, state), state).cpu().numpy()
    for i, p in enumerate(FILTERS):
        counts = np.bincount(tokens[i * draws:(i + 1) * draws], minlength=len(TOY_LOGITS))
        expected = reference_probs(TOY_LOGITS, p)
        assert counts[expected == 0].sum() == 0, f"{p}: filtered token drawn"
        kept = expected > 0
        assert chisquare(counts[kept], expected[kept] / expected[kept].sum() * draws).pvalue > ALPHA, p


@pytest.mark.parametrize("device", DEVICES)
def test_one_seed_across_positions_follows_the_distribution(device):
    """One seed's draws over 40k consecutive positions follow the distribution too (chi-square):
    the noise is uniform along a request, not only across seeds."""
    draws = 40_000
    params = SamplingParams(temperature=1.5)
    logits = torch.tensor(TOY_LOGITS, dtype=torch.float32, device=device).expand(draws, -1)
    state = SamplingState.from_params([params] * draws, [1234] * draws, list(range(draws)), device)
    counts = np.bincount(sample(logits_to_probs(logits, state), state).cpu().numpy(), minlength=len(TOY_LOGITS))
    expected = reference_probs(TOY_LOGITS, params)
    assert chisquare(counts, expected * draws).pvalue > ALPHA


def test_top_p_always_keeps_the_top_token():
    """A tiny top_p still leaves one token: the most likely one."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    probs = logits_to_probs(logits, state_of([SamplingParams(top_p=1e-6)]))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_temperature_is_its_limit(device):
    """Guards: temperature 1e-38 gave NaN probabilities (logits / T overflowed to inf), so the
    request sampled garbage. A tiny positive temperature shapes to the argmax, shared among exact
    ties, for float32 temperatures that underflow to 0 too."""
    logits = torch.tensor([[1.0, 5.0, -3.0, 2.0], [7.0, 0.0, 7.0, -1e4]], device=device)
    for temperature in (1e-6, 1e-38, 1e-45, 1e-300):
        params = [SamplingParams(temperature=temperature)] * 2
        probs = logits_to_probs(logits, state_of(params, device)).cpu()
        assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]], temperature


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_are_the_argmax(device):
    """Greedy rows are the argmax, in an all-greedy batch and beside sampled rows, whatever their seed."""
    torch.manual_seed(1)
    logits = torch.randn(6, 50, device=device)
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(top_k=5) for i in range(6)]
    for batch in (params, [SamplingParams(temperature=0.0)] * 6):
        state = state_of(batch, device)
        tokens = sample(logits_to_probs(logits, state), state)
        greedy = torch.tensor([p.is_greedy for p in batch], device=device)
        assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])


def test_a_sampled_row_needs_a_seed():
    with pytest.raises(ValueError, match="row 1 samples but has no seed"):
        SamplingState.from_params([SamplingParams(temperature=0), SamplingParams()])


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_is_reproducible_and_batch_independent(device):
    """A seeded row's tokens depend only on its seed, its positions and its logits: the same with
    other rows, other batch sizes, other positions in the batch, greedy neighbours; another seed
    gives other tokens."""
    vocab, steps = 100, 5
    torch.manual_seed(2)
    mine = torch.randn(steps, vocab, device=device)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(num_others: int, position: int, seed: int = 1234) -> list[int]:
        others = [SamplingParams(temperature=t, top_k=k) for t, k in zip([0.0, 1.3, 0.5, 0.0, 2.0], [0, 7, 0, 0, 3])]
        others = (others * 4)[:num_others]
        batch = others[:position] + [params] + others[position:]
        seeds = [100 + i for i in range(num_others)]
        seeds = seeds[:position] + [seed] + seeds[position:]
        tokens = []
        for step in range(steps):
            state = SamplingState.from_params(batch, seeds, [step] * len(batch), device)
            logits = torch.randn(len(batch), vocab, device=device) * 3
            logits[position] = mine[step]
            tokens.append(sample(logits_to_probs(logits, state), state)[position])
        return torch.stack(tokens).tolist()

    reference = run(0, 0)
    for num_others, position in [(3, 1), (7, 7), (12, 4), (12, 0)]:
        assert run(num_others, position) == reference
    assert any(run(0, 0, seed) != reference for seed in (1, 2, 3))


def test_three_dim_logits_match_flattened_rows():
    """[B, S, V] logits shape the same as the flattened [B*S, V] with each row's params repeated S times."""
    torch.manual_seed(3)
    params = [SamplingParams(temperature=0.8, top_k=4), SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.7, min_p=0.05)]
    logits = torch.randn(3, 4, 20)
    flat = logits_to_probs(logits.reshape(12, 20), state_of([p for p in params for _ in range(4)]))
    assert torch.allclose(logits_to_probs(logits, state_of(params)).reshape(12, 20), flat)
