"""Verification properties: greedy verification matches a per-row reference; speculative sampling
emits tokens distributed exactly as the target's, whatever the drafter proposes.

Statistical tests draw 200k rows in one batched call with fixed seeds and apply a chi-square test
at significance 0.001 (a correct sampler fails one such test with probability 0.001).
"""
import pytest
import torch
from scipy.stats import chisquare

from outpace.config import SamplingParams
from outpace.sampling.sampler import SamplingState, logits_to_probs, make_generator, sample
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


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_in_sampled_batch_equal_verify_greedy(device):
    """Greedy rows beside sampled rows (with or without draft_probs) give verify_greedy's output exactly."""
    gen = torch.Generator().manual_seed(1)
    batch, slots = 64, 4
    logits = torch.randn(batch, slots + 1, VOCAB, generator=gen).to(device)
    drafts = torch.randint(0, VOCAB, (batch, slots), generator=gen).to(device)
    drafts[::3] = logits[::3, :slots].argmax(-1)  # some greedy rows accept everything
    num_draft = torch.randint(0, slots + 1, (batch,), generator=gen).to(device)
    draft_probs = torch.softmax(torch.randn(batch, slots, VOCAB, generator=gen), -1).to(device)
    params = [SamplingParams(temperature=0.0 if row % 2 else 0.8, top_k=3) for row in range(batch)]
    state = SamplingState.from_params(params, device=device)
    greedy_out, greedy_num = verify_greedy(logits, drafts, num_draft)
    for q in (None, draft_probs):
        out, num_out = verify_sampling(logits, drafts, num_draft, state, q)
        assert torch.equal(out[1::2], greedy_out[1::2]) and torch.equal(num_out[1::2], greedy_num[1::2])


@pytest.mark.parametrize("device", DEVICES)
def test_no_drafts_is_plain_sampling(device):
    """num_draft 0 emits exactly the token sample() draws from the same generator state, step
    after step; with or without drafts, a call leaves each generator where sample() leaves it."""
    torch.manual_seed(2)
    batch, slots, vocab = 16, 3, 40
    params = [SamplingParams(temperature=0.7 + 0.1 * row, top_p=0.9, seed=row) for row in range(batch)]
    plain = SamplingState.from_params(params, [make_generator(p.seed, device) for p in params], device)
    spec = SamplingState.from_params(params, [make_generator(p.seed, device) for p in params], device)
    for _ in range(3):
        logits = torch.randn(batch, slots + 1, vocab, device=device) * 2
        expected = sample(logits_to_probs(logits[:, 0], plain), plain.generators, plain.is_greedy_rows)
        drafts = torch.randint(0, vocab, (batch, slots), device=device)
        out, num_out = verify_sampling(logits, drafts, torch.zeros(batch, dtype=torch.long, device=device), spec)
        assert torch.equal(num_out, torch.ones_like(num_out)) and torch.equal(out[:, 0], expected)
    sample(logits_to_probs(logits[:, 0], plain), plain.generators, plain.is_greedy_rows)
    verify_sampling(logits, drafts, torch.full((batch,), slots, device=device), spec)
    for g_plain, g_spec in zip(plain.generators, spec.generators):
        assert torch.equal(g_plain.get_state(), g_spec.get_state())


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_verification_is_batch_independent_and_ignores_padding(device):
    """A seeded row emits the same tokens whatever the batch's padded K, its neighbours, its
    position, and the values in its padding: it consumes a fixed count of random numbers per call."""
    torch.manual_seed(3)
    steps, vocab, my_slots = 4, 12, 2
    my_logits = torch.randn(steps, my_slots + 1, vocab, device=device)
    my_drafts = torch.randint(0, vocab, (steps, my_slots), device=device)
    my_q = torch.softmax(torch.randn(steps, my_slots, vocab, device=device), -1)
    my_num_draft = [2, 0, 1, 2]
    params = SamplingParams(temperature=1.1, top_k=8, seed=99)

    def run(slots: int, others: int, position: int, pad_value: int) -> list[list[int]]:
        batch = others + 1
        generators = [make_generator(7 + i, device) if i % 2 else None for i in range(batch)]
        generators[position] = make_generator(params.seed, device)
        row_params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9) for i in range(batch)]
        row_params[position] = params
        state = SamplingState.from_params(row_params, generators, device)
        emitted = []
        for step in range(steps):
            logits = torch.randn(batch, slots + 1, vocab, device=device)
            drafts = torch.randint(0, vocab, (batch, slots), device=device)
            q = torch.softmax(torch.randn(batch, slots, vocab, device=device), -1)
            num_draft = torch.randint(0, slots + 1, (batch,), device=device)
            logits[position] = torch.randn(slots + 1, vocab, device=device)  # positions past mine: unused
            logits[position, : my_slots + 1] = my_logits[step]
            drafts[position] = pad_value
            drafts[position, :my_slots] = my_drafts[step]
            drafts[position, my_num_draft[step]:] = pad_value
            q[position, :my_slots] = my_q[step]
            num_draft[position] = my_num_draft[step]
            out, num_out = verify_sampling(logits, drafts, num_draft, state, q)
            emitted.append(out[position, : int(num_out[position])].tolist())
        return emitted

    reference = run(my_slots, 0, 0, 0)
    for slots, others, position, pad_value in [(2, 0, 0, -3), (5, 6, 3, 1000), (7, 12, 12, 0), (3, 2, 0, 5)]:
        assert run(slots, others, position, pad_value) == reference


@pytest.mark.parametrize("device", DEVICES)
def test_rejection_with_zero_residual_samples_from_target(device):
    """If max(p - q, 0) is all zero (p == q) yet the draft is rejected (a draft outside its own q),
    the next token still comes from p, never from an empty residual (which would pick token 0)."""
    batch, vocab = 32, 5
    logits = torch.zeros(batch, 2, vocab, device=device)
    logits[:, :, 3] = 4.0  # top_k=1: p is one-hot at token 3
    q = torch.zeros(batch, 1, vocab, device=device)
    q[:, :, 3] = 1.0  # q == p ...
    drafts = torch.full((batch, 1), 1, device=device)  # ... but the draft is token 1, where p = q = 0
    state = SamplingState.from_params([SamplingParams(top_k=1)] * batch, device=device)
    out, num_out = verify_sampling(logits, drafts, torch.ones(batch, dtype=torch.long, device=device), state, q)
    assert (num_out == 1).all() and (out[:, 0] == 3).all()


def _conditional_logits(seed: int, scale: float = 1.0):
    """A toy target whose next-token logits depend on the prefix: t0 [V], t1[x0] [V], t2[x0, x1] [V]."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(VOCAB, generator=gen) * scale, torch.randn(VOCAB, VOCAB, generator=gen) * scale,
            torch.randn(VOCAB, VOCAB, VOCAB, generator=gen) * scale)


def _probs_table(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    rows = logits.reshape(-1, VOCAB)
    state = SamplingState.from_params([params] * rows.shape[0])
    return logits_to_probs(rows, state).double().reshape(logits.shape)


def _check_first_two_tokens(params, target, drafts, num_draft, draft_probs, device, all_accepted=False):
    """Verify a batch of drafted chains, complete the second token with a plain sampling step
    (num_draft 0, target conditioned on the first token) where only one was emitted, then test the
    first token against p_0 and the pair against p_0(x0) p_1(x1 | x0)."""
    t0, t1, t2 = target
    rows = drafts.shape[0]
    logits = torch.stack([t0.expand(rows, VOCAB), t1[drafts[:, 0]], t2[drafts[:, 0], drafts[:, 1]]], dim=1)
    state = SamplingState.from_params([params] * rows, device=device)
    out, num_out = verify_sampling(logits.to(device), drafts.to(device), num_draft.to(device), state,
                                   None if draft_probs is None else draft_probs.to(device))
    out, num_out = out.cpu(), num_out.cpu()
    if all_accepted:
        assert torch.equal(num_out, num_draft + 1)
    first = out[:, 0]
    follow, _ = verify_sampling(t1[first][:, None].to(device), torch.zeros(rows, 0, dtype=torch.long, device=device),
                                torch.zeros(rows, dtype=torch.long, device=device), state)
    second = torch.where(num_out >= 2, out[:, 1], follow[:, 0].cpu())

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
    """Drafts x0 ~ first [V], x1 ~ second[x0] [V, V] for NUM_ROWS rows, and the [rows, 2, V] q."""
    x0 = torch.multinomial(first, NUM_ROWS, replacement=True, generator=gen)
    x1 = torch.multinomial(second[x0], 1, generator=gen).squeeze(1)
    return torch.stack([x0, x1], 1), torch.stack([first.expand(NUM_ROWS, VOCAB), second[x0]], 1)


def _ragged(gen):
    return torch.randint(0, 3, (NUM_ROWS,), generator=gen)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_exact_with_draft_distribution(device):
    """Drafts from a q unlike p (given as draft_probs), ragged num_draft in 0..2, temperature 0.9:
    first token ~ p_0 and second | first ~ p_1 (chi-square, significance 0.001)."""
    torch.manual_seed(10)
    gen = torch.Generator().manual_seed(10)
    q0, q1, _ = (torch.softmax(t, -1) for t in _conditional_logits(11, scale=1.5))
    drafts, q = _sample_chain(gen, q0, q1)
    _check_first_two_tokens(SamplingParams(temperature=0.9), _conditional_logits(12), drafts, _ragged(gen), q, device)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_exact_with_adversarial_one_hot_drafts(device):
    """One-hot drafts (draft_probs None) of a fixed, unlikely token pair: still exactly the target's
    distribution (chi-square, significance 0.001)."""
    torch.manual_seed(20)
    gen = torch.Generator().manual_seed(20)
    target = _conditional_logits(21)
    worst = int(target[0].argmin())
    drafts = torch.tensor([worst, int(target[1][worst].argmin())]).expand(NUM_ROWS, 2).contiguous()
    _check_first_two_tokens(SamplingParams(top_p=0.95), target, drafts, _ragged(gen), None, device)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_q_equal_p_accepts_everything(device):
    """When q == p every draft is accepted (num_out = num_draft + 1) and the output is still p."""
    torch.manual_seed(30)
    gen = torch.Generator().manual_seed(30)
    params = SamplingParams(temperature=0.8, min_p=0.05)
    target = _conditional_logits(31)
    drafts, q = _sample_chain(gen, _probs_table(target[0], params).float(), _probs_table(target[1], params).float())
    _check_first_two_tokens(params, target, drafts, _ragged(gen), q, device, all_accepted=True)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_never_emits_tokens_the_target_filters(device):
    """q spreads mass over all tokens, the target keeps only its top 3: filtered tokens are never
    emitted, and the kept ones follow the target (chi-square, significance 0.001)."""
    torch.manual_seed(40)
    gen = torch.Generator().manual_seed(40)
    uniform = torch.full((VOCAB,), 1.0 / VOCAB)
    drafts, q = _sample_chain(gen, uniform, uniform.expand(VOCAB, VOCAB))
    _check_first_two_tokens(SamplingParams(top_k=3), _conditional_logits(41), drafts, _ragged(gen), q, device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_on_cuda():
    """Shaping, sampling and verification never wait for the GPU (sync debug mode raises if they do)."""
    device = "cuda"
    batch, slots, vocab = 8, 4, 1000
    params = [SamplingParams(temperature=0.0 if i == 0 else 0.8, top_k=50, top_p=0.9, min_p=0.01, seed=i)
              for i in range(batch)]
    state = SamplingState.from_params(params, [make_generator(p.seed, device) for p in params], device)
    logits = torch.randn(batch, slots + 1, vocab, device=device)
    drafts = torch.randint(0, vocab, (batch, slots), device=device)
    num_draft = torch.randint(0, slots + 1, (batch,), device=device)
    q = torch.softmax(torch.randn(batch, slots, vocab, device=device), -1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits_to_probs(logits[:, 0], state), state.generators, state.is_greedy_rows)
        verify_sampling(logits, drafts, num_draft, state, q)
        verify_sampling(logits, drafts, num_draft, state)
        verify_greedy(logits, drafts, num_draft)
    finally:
        torch.cuda.set_sync_debug_mode("default")
