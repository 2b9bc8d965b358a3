"""Verification properties: greedy verification matches a per-row reference; sampled verification
emits plain seeded sampling's tokens whatever the drafter proposes, so they are distributed exactly
as the target's.

Statistical tests draw 200k rows (one seed each) in one batched call and apply a chi-square test
at significance 0.001 (a correct sampler fails one such test with probability 0.001).
"""
import pytest
import torch
from scipy.stats import chisquare

from outpace.config import SamplingParams
from outpace.sampling.sampler import SamplingState, logits_to_probs, sample
from outpace.sampling.rejection import verify_greedy, verify_sampling

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ALPHA = 0.001
VOCAB = 6
NUM_ROWS = 200_000


def reference_verify_greedy(logits, drafts, num_draft):
    """Per-row Python statement of greedy verification -> list of emitted token lists."""
    target = logits.argmax(-1).tolist()
    emitted = []
    for row in range(len(target)):
        tokens = []
        for i in range(int(num_draft[row])):
            if int(drafts[row, i]) != target[row][i]:
                break
            tokens.append(target[row][i])
        tokens.append(target[row][len(tokens)])  # the correction, or the bonus after all drafts
        emitted.append(tokens)
    return emitted


@pytest.mark.parametrize("device", DEVICES)
def test_verify_greedy_matches_reference(device):
    """Ragged num_draft, garbage padding, all-accepted and first-rejected rows all agree with the reference."""
    gen = torch.Generator().manual_seed(0)
    batch, slots, vocab = 300, 5, 3
    logits = torch.randn(batch, slots + 1, vocab, generator=gen)
    drafts = logits[:, :slots].argmax(-1)
    corrupt = torch.rand(batch, slots, generator=gen) < 0.25
    drafts = torch.where(corrupt, torch.randint(0, vocab, (batch, slots), generator=gen), drafts)
    num_draft = torch.randint(0, slots + 1, (batch,), generator=gen)
    padding = torch.arange(slots) >= num_draft[:, None]
    drafts = torch.where(padding, torch.randint(-5, 50, (batch, slots), generator=gen), drafts)
    expected = reference_verify_greedy(logits, drafts, num_draft)

    out, num_out = verify_greedy(logits.to(device), drafts.to(device), num_draft.to(device))
    got = [out[row, :n].tolist() for row, n in enumerate(num_out.tolist())]
    assert got == expected
    lengths = [len(e) for e in expected]
    assert any(n == d + 1 and d == slots for n, d in zip(lengths, num_draft.tolist()))  # all accepted
    assert any(n == 1 and d > 0 for n, d in zip(lengths, num_draft.tolist()))  # first draft rejected


def seeded(params, device="cpu", positions=None) -> SamplingState:
    """Row i seeded with i."""
    return SamplingState.from_params(params, list(range(len(params))), positions, device)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_in_sampled_batch_equal_verify_greedy(device):
    """Greedy rows beside sampled rows give verify_greedy's output exactly."""
    gen = torch.Generator().manual_seed(1)
    batch, slots = 64, 4
    logits = torch.randn(batch, slots + 1, VOCAB, generator=gen).to(device)
    drafts = torch.randint(0, VOCAB, (batch, slots), generator=gen).to(device)
    drafts[::3] = logits[::3, :slots].argmax(-1)  # some greedy rows accept everything
    num_draft = torch.randint(0, slots + 1, (batch,), generator=gen).to(device)
    params = [SamplingParams(temperature=0.0 if row % 2 else 0.8, top_k=3) for row in range(batch)]
    greedy_out, greedy_num = verify_greedy(logits, drafts, num_draft)
    out, num_out = verify_sampling(logits, drafts, num_draft, seeded(params, device))
    assert torch.equal(out[1::2], greedy_out[1::2]) and torch.equal(num_out[1::2], greedy_num[1::2])


class MarkovTarget:
    """A toy target whose next-token logits depend on the last token: table [V, V]."""

    def __init__(self, vocab: int, seed: int, device: str):
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)).mul(2).to(device)

    def logits(self, chains: torch.Tensor) -> torch.Tensor:
        return self.table[chains]  # [B, S] last token + drafts -> [B, S, V]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("drafter", ["oracle", "corrupted", "random"])
def test_verified_tokens_are_plain_sampling_whatever_the_drafts(device, drafter):
    """Guards: with a draft-dependent number of random draws per step, speculation changed seeded
    text. Sampled verification over ragged drafts (the plain run's continuation, that continuation
    corrupted, random tokens) emits exactly the tokens that plain sampling, one token per step at
    the same positions, emits; the oracle's drafts are all accepted."""
    vocab, batch, length, slots = 20, 24, 30, 5
    target = MarkovTarget(vocab, seed=6, device=device)
    params = [SamplingParams(temperature=0.7 + 0.05 * (row % 5), top_p=0.95 if row % 2 else 1.0,
                             min_p=0.02 if row % 3 else 0.0) for row in range(batch)]
    start = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(7)).tolist()

    plain = [[t] for t in start]
    for step in range(length):
        state = SamplingState.from_params(params, list(range(batch)), [step] * batch, device)
        last = torch.tensor([p[-1] for p in plain], device=device)
        tokens = sample(logits_to_probs(target.logits(last[:, None])[:, 0], state), state).tolist()
        for row, token in enumerate(tokens):
            plain[row].append(token)

    rng = torch.Generator().manual_seed(8)
    spec = [[t] for t in start]
    num_accepted = num_drafted = 0
    while min(len(s) for s in spec) <= length:
        live = [row for row in range(batch) if len(spec[row]) <= length]
        room = [min(slots, length + 1 - len(spec[row]) - 1) for row in live]
        drafts = torch.randint(0, vocab, (len(live), slots), generator=rng)
        num_draft = torch.tensor([int(torch.randint(0, r + 1, (1,), generator=rng)) for r in room])
        for i, row in enumerate(live):
            done = len(spec[row])
            truth = torch.tensor(plain[row][done:done + slots] + [0] * slots)[:slots]
            if drafter == "oracle":
                drafts[i] = truth
            elif drafter == "corrupted":
                drafts[i] = torch.where(torch.arange(slots) < 2, truth, (truth + 1) % vocab)
        chains = torch.cat([torch.tensor([[spec[row][-1]] for row in live]), drafts], 1).to(device)
        state = SamplingState.from_params([params[row] for row in live], live,
                                          [len(spec[row]) - 1 for row in live], device)
        out, num_out = verify_sampling(target.logits(chains), drafts.to(device), num_draft.to(device), state)
        for i, row in enumerate(live):
            n = int(num_out[i])
            spec[row] += out[i, :n].tolist()
            num_drafted += int(num_draft[i])
            num_accepted += n - 1
    assert [s[:length + 1] for s in spec] == plain
    if drafter == "oracle":
        assert num_accepted == num_drafted > 0
    assert len({tuple(p) for p in plain}) > batch // 2, "the rows should sample different texts"


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_verification_is_batch_independent_and_ignores_padding(device):
    """A seeded row emits the same tokens whatever the batch's padded K, its neighbours, its
    position in the batch, and the values in its padding."""
    torch.manual_seed(3)
    steps, vocab, my_slots = 4, 12, 2
    my_logits = torch.randn(steps, my_slots + 1, vocab, device=device)
    my_drafts = torch.randint(0, vocab, (steps, my_slots), device=device)
    my_num_draft = [2, 0, 1, 2]
    params = SamplingParams(temperature=1.1, top_k=8, seed=99)

    def run(slots: int, others: int, position: int, pad_value: int) -> list[list[int]]:
        batch = others + 1
        row_params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9) for i in range(batch)]
        row_params[position] = params
        seeds = [7 + i for i in range(batch)]
        seeds[position] = params.seed
        emitted, done = [], 0
        for step in range(steps):
            state = SamplingState.from_params(row_params, seeds, [done] * batch, device)
            logits = torch.randn(batch, slots + 1, vocab, device=device)
            drafts = torch.randint(0, vocab, (batch, slots), device=device)
            num_draft = torch.randint(0, slots + 1, (batch,), device=device)
            logits[position] = torch.randn(slots + 1, vocab, device=device)  # positions past mine: unused
            logits[position, : my_slots + 1] = my_logits[step]
            drafts[position] = pad_value
            drafts[position, :my_slots] = my_drafts[step]
            drafts[position, my_num_draft[step]:] = pad_value
            num_draft[position] = my_num_draft[step]
            out, num_out = verify_sampling(logits, drafts, num_draft, state)
            emitted.append(out[position, : int(num_out[position])].tolist())
            done += len(emitted[-1])
        return emitted

    reference = run(my_slots, 0, 0, 0)
    for slots, others, position, pad_value in [(2, 0, 0, -3), (5, 6, 3, 1000), (7, 12, 12, 0), (3, 2, 0, 5)]:
        assert run(slots, others, position, pad_value) == reference


def _conditional_logits(seed: int, scale: float = 1.0):
    """A toy target whose next-token logits depend on the prefix: t0 [V], t1[x0] [V], t2[x0, x1] [V]."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(VOCAB, generator=gen) * scale, torch.randn(VOCAB, VOCAB, generator=gen) * scale,
            torch.randn(VOCAB, VOCAB, VOCAB, generator=gen) * scale)


def _probs_table(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    rows = logits.reshape(-1, VOCAB)
    return logits_to_probs(rows, seeded([params] * rows.shape[0])).double().reshape(logits.shape)


def _check_first_two_tokens(params, target, drafts, num_draft, device, all_accepted=False):
    """Verify a batch of drafted chains (row r seeded with r), complete the second token with a
    plain sampling step at position 1 (target conditioned on the first token) where only one was
    emitted, then test the first token against p_0 and the pair against p_0(x0) p_1(x1 | x0)."""
    t0, t1, t2 = target
    rows = drafts.shape[0]
    logits = torch.stack([t0.expand(rows, VOCAB), t1[drafts[:, 0]], t2[drafts[:, 0], drafts[:, 1]]], dim=1)
    state = seeded([params] * rows, device)
    out, num_out = verify_sampling(logits.to(device), drafts.to(device), num_draft.to(device), state)
    out, num_out = out.cpu(), num_out.cpu()
    if all_accepted:
        assert torch.equal(num_out, num_draft + 1)
    first = out[:, 0]
    at_one = seeded([params] * rows, device, positions=[1] * rows)
    follow = sample(logits_to_probs(t1[first].to(device), at_one), at_one).cpu()
    second = torch.where(num_out >= 2, out[:, 1], follow)

    p0 = _probs_table(t0, params)
    joint = (p0[:, None] * _probs_table(t1, params)).flatten()  # [V*V]: p_0(a) p_1(b | a)
    for observed, expected in [(torch.bincount(first, minlength=VOCAB), p0),
                               (torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB), joint)]:
        observed, expected = observed.numpy(), expected.numpy()
        assert observed[expected == 0].sum() == 0, "emitted a token the target filters out"
        kept = expected > 0
        pvalue = chisquare(observed[kept], expected[kept] / expected[kept].sum() * rows).pvalue
        assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e}"


def _sample_chain(gen, first, second):
    """Drafts x0 ~ first [V], x1 ~ second[x0] [V, V] for NUM_ROWS rows, from the test's own generator."""
    x0 = torch.multinomial(first, NUM_ROWS, replacement=True, generator=gen)
    x1 = torch.multinomial(second[x0], 1, generator=gen).squeeze(1)
    return torch.stack([x0, x1], 1)


def _ragged(gen):
    return torch.randint(0, 3, (NUM_ROWS,), generator=gen)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_exact_with_drafts_from_another_distribution(device):
    """Drafts sampled independently from a q unlike p, ragged num_draft in 0..2, temperature 0.9:
    first token ~ p_0 and second | first ~ p_1 (chi-square, significance 0.001)."""
    gen = torch.Generator().manual_seed(10)
    q0, q1, _ = (torch.softmax(t, -1) for t in _conditional_logits(11, scale=1.5))
    _check_first_two_tokens(SamplingParams(temperature=0.9), _conditional_logits(12), _sample_chain(gen, q0, q1),
                            _ragged(gen), device)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_exact_with_adversarial_drafts(device):
    """Drafts of a fixed, unlikely token pair: still exactly the target's distribution
    (chi-square, significance 0.001)."""
    gen = torch.Generator().manual_seed(20)
    target = _conditional_logits(21)
    worst = int(target[0].argmin())
    drafts = torch.tensor([worst, int(target[1][worst].argmin())]).expand(NUM_ROWS, 2).contiguous()
    _check_first_two_tokens(SamplingParams(top_p=0.95), target, drafts, _ragged(gen), device)


@pytest.mark.parametrize("device", DEVICES)
def test_drafter_coupled_through_the_noise_is_always_accepted(device):
    """A drafter that samples the target's own distribution at u(seed, i) (the coupling a sampling
    draft model uses, here with q = p) has every draft accepted, and the output is still p."""
    gen = torch.Generator().manual_seed(30)
    params = SamplingParams(temperature=0.8, min_p=0.05)
    target = _conditional_logits(31)
    t0, t1, _ = target
    at = [seeded([params] * NUM_ROWS, positions=[i] * NUM_ROWS) for i in (0, 1)]
    x0 = sample(logits_to_probs(t0.expand(NUM_ROWS, VOCAB), at[0]), at[0])
    x1 = sample(logits_to_probs(t1[x0], at[1]), at[1])
    _check_first_two_tokens(params, target, torch.stack([x0, x1], 1), _ragged(gen), device, all_accepted=True)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_never_emits_tokens_the_target_filters(device):
    """Drafts spread over all tokens, the target keeps only its top 3: filtered tokens are never
    emitted, and the kept ones follow the target (chi-square, significance 0.001)."""
    gen = torch.Generator().manual_seed(40)
    uniform = torch.full((VOCAB,), 1.0 / VOCAB)
    drafts = _sample_chain(gen, uniform, uniform.expand(VOCAB, VOCAB))
    _check_first_two_tokens(SamplingParams(top_k=3), _conditional_logits(41), drafts, _ragged(gen), device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_on_cuda():
    """Building the state, shaping, the noise, sampling and verification never wait for the GPU
    (sync debug mode raises if they do)."""
    device = "cuda"
    batch, slots, vocab = 8, 4, 1000
    params = [SamplingParams(temperature=0.0 if i == 0 else 0.8, top_k=50, top_p=0.9, min_p=0.01, seed=i)
              for i in range(batch)]
    logits = torch.randn(batch, slots + 1, vocab, device=device)
    drafts = torch.randint(0, vocab, (batch, slots), device=device)
    num_draft = torch.randint(0, slots + 1, (batch,), device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        state = SamplingState.from_params(params, [p.seed for p in params], list(range(batch)), device)
        sample(logits_to_probs(logits[:, 0], state), state)
        verify_sampling(logits, drafts, num_draft, state)
        verify_greedy(logits, drafts, num_draft)
    finally:
        torch.cuda.set_sync_debug_mode("default")
