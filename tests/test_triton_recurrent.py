"""The recurrent layers' Triton kernels (kernels/triton_recurrent.py) against the PyTorch path
they replace. On CUDA they run as compiled; elsewhere in Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1, set here), so the shapes are tiny and the forwards few.
Without Triton every test skips.

Guards: every kind of row (a prompt chunk written in place, a fresh row, decode, verify rows with
a snapshot per token or replay's log, a static step's idle row on the sink slot) gives the
PyTorch path's outputs and leaves the same convolution history and states in every entry; an
idle row changes no real slot; a verify row's snapshot after its token j is the state a decode
of tokens 0..j leaves (rollback by pointer is exact).
"""
import os
import sys

import pytest
import torch

from outpace.kernels import recurrent_kernels
from outpace.model.layers import ForwardBatch
from outpace.model.recurrent_rows import GPU_ROW_TOKENS, RowGroups, row_groups
from outpace.weights.loader import load_model
from tiny import make_tiny, slot_state

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # read as Triton's own functions and the kernels are decorated (so before Triton is first
    # imported) and as they run; nothing else launches Triton without CUDA
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported before its interpreter was asked for", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
from outpace.kernels import triton_recurrent  # noqa: E402

MAX_LEN = 64
# float32 arithmetic in another order (the convolution's taps, the delta rule's sums): outputs and
# states of size about 1 agree to a few float32 steps, relative to their largest entry
TOLERANCE = 2e-5


@pytest.fixture(scope="module", params=["qwen3_5", "lfm2"])
def model(request, tmp_path_factory):
    """A tiny model whose first recurrent layer's weights are redrawn or scaled so that its output
    is about 1 in size (its own scale would hide errors)."""
    folder = tmp_path_factory.mktemp(request.param)
    make_tiny(request.param, folder, dtype=torch.float32)
    model = load_model(folder, torch.float32, DEVICE, max_len=MAX_LEN)
    mixer = next(layer for layer in model.layers if not layer.is_attention).mixer
    torch.manual_seed(0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.7)
        for linear, scale in ((mixer.in_proj, 6), (mixer.out, 30)):       # the CPU's packed layout, or plain
            (linear.packed if hasattr(linear, "packed") else linear.weight).mul_(scale)
    return model


@pytest.fixture
def use_triton(monkeypatch):
    """use_triton(True): the recurrent layers run the Triton kernels (on CPU tensors too);
    False: their PyTorch ops."""
    monkeypatch.setattr(recurrent_kernels, "serves", lambda *tensors: False)

    def use(on: bool):
        fits = (lambda self, x: self.max_width <= GPU_ROW_TOKENS) if on else (lambda self, x: False)
        monkeypatch.setattr(RowGroups, "on_gpu_kernels", fits)
    return use


def forward(model, cache, start: int, width: int, logits: bool, idle: bool = False, seed: int = 0):
    """The first recurrent layer over rows on slots [2, 0] from position `start` (a row from
    position 0 is fresh); idle: slot 0's row is a static step's idle row."""
    mixer = next(layer for layer in model.layers if not layer.is_attention).mixer
    starts = torch.tensor([start, MAX_LEN if idle else start], device=DEVICE)
    batch = ForwardBatch(input_ids=torch.zeros(2, width, dtype=torch.long, device=DEVICE),
                         positions=starts[:, None] + torch.arange(width, device=DEVICE), slots=torch.tensor([2, 0], device=DEVICE),
                         kv_len=start + width, logits=logits, idle_start=MAX_LEN if idle else None)
    x = torch.randn(2, width, model.cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    return mixer(x, row_groups(batch, cache), cache, 0)


def run(model, snapshots: bool):
    """Outputs of a prompt chunk, a decode step, a verify forward and its commit, a static step
    with an idle row; the state cache after them; slot 0's state before and after the static step."""
    cache = model.make_cache(3, MAX_LEN, torch.float32, DEVICE, max_row_tokens=4, snapshots=snapshots).state
    outs = [forward(model, cache, 0, 11, False, seed=1), forward(model, cache, 11, 1, True, seed=2),
            forward(model, cache, 12, 4, True, seed=3)]
    cache.commit([2, 0], [1, 3])
    before = slot_state(cache, 0)
    outs.append(forward(model, cache, 14, 3, True, idle=True, seed=4)[:1])     # the real row's outputs
    cache.commit([2], [2])
    return outs, cache, before, slot_state(cache, 0)


def assert_near(got: torch.Tensor, want: torch.Tensor):
    torch.testing.assert_close(got, want, atol=TOLERANCE * max(float(want.abs().max()), 1.0), rtol=0)


@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "replay"])
def test_kernels_match_pytorch_path(model, use_triton, snapshots):
    use_triton(False)
    want, want_cache, _, _ = run(model, snapshots)
    use_triton(True)
    got, got_cache, before, after = run(model, snapshots)
    for g, w in zip(got, want):
        assert float(w.abs().max()) > 0.3
        assert_near(g, w)
    real = slice(0, got_cache.sink)             # the sink slot holds whatever idle rows left
    for g, w in zip(got_cache.conv + got_cache.state, want_cache.conv + want_cache.state):
        if w is not None:
            assert_near(g[real], w[real])
    for g, w in zip(after, before):
        assert torch.equal(g, w), "an idle row changed a real slot's state"


def test_snapshots_are_decode_states(model, use_triton):
    """A verify row of 4 tokens: its snapshot after token j equals the state that decoding its
    tokens one at a time leaves after token j."""
    if not any(layer.mixer.state_shape().delta for layer in model.layers if not layer.is_attention):
        pytest.skip("no delta-rule state")
    use_triton(True)
    caches = [model.make_cache(3, MAX_LEN, torch.float32, DEVICE, max_row_tokens=4).state for _ in range(2)]
    for cache in caches:
        forward(model, cache, 0, 7, False, seed=1)
    verify, decode = caches
    proj_seed = 5
    out = forward(model, verify, 7, 4, True, seed=proj_seed)
    x = torch.randn(2, 4, model.cfg.hidden_size, generator=torch.Generator().manual_seed(proj_seed)).to(DEVICE)
    mixer = next(layer for layer in model.layers if not layer.is_attention).mixer
    for j in range(4):
        batch = ForwardBatch(input_ids=torch.zeros(2, 1, dtype=torch.long, device=DEVICE),
                             positions=torch.full((2, 1), 7 + j, device=DEVICE), slots=torch.tensor([2, 0], device=DEVICE),
                             kv_len=8 + j, logits=True)
        step = mixer(x[:, j:j + 1].contiguous(), row_groups(batch, decode), decode, 0)
        assert_near(step[:, 0], out[:, j])
        for slot in (2, 0):
            entry = (int(verify.read[slot]) + 1 + j) % verify.entries
            assert_near(verify.state[0][slot, entry], decode.state[0][slot, int(decode.live[slot])])


def test_kernel_shapes_without_a_model():
    """Heads of sizes that are not powers of two (masked tiles), one row on slot 1: the delta
    kernel's output against delta_rule.steps from the same convolution output."""
    from outpace.model import delta_rule
    from outpace.model.gated_deltanet import l2_normalized
    torch.manual_seed(1)
    Hk, dk, H, dv, K, T = 1, 12, 2, 20, 3, 3
    C = 2 * Hk * dk + H * dv
    proj = torch.randn(T, C + H * dv + 2 * H, device=DEVICE)
    weight, neg_a, dt_bias = torch.randn(K, C, device=DEVICE), -torch.rand(H, device=DEVICE), torch.randn(H, device=DEVICE)
    history = torch.randn(2, K - 1 + T, C, device=DEVICE)
    state = torch.randn(2, T, H, dk, dv, device=DEVICE)
    rows = torch.tensor([[1, 0, -1, 0, 0, 0, T, 1]], device=DEVICE)
    window = history[1, :K - 1].clone()
    start = state[1, 0].clone()
    out = triton_recurrent.gated_deltanet(proj, weight, neg_a, dt_bias, history, state, None, rows, T, (Hk, dk, H, dv))
    seq = torch.cat([window, proj[:, :C]])                                              # [K-1+T, C]
    mixed = sum(seq[i:i + T] * weight[i] for i in range(K))
    mixed = mixed * mixed.sigmoid()
    q, k, v = mixed.split([dk, dk, H * dv], dim=-1)
    q = (l2_normalized(q) * dk ** -0.5).repeat(1, H)[None].view(1, T, H, dk)
    k = l2_normalized(k).repeat(1, H)[None].view(1, T, H, dk)
    b = proj[:, C + H * dv:C + H * dv + H].sigmoid()[None]
    g = (neg_a * torch.nn.functional.softplus(proj[:, -H:] + dt_bias))[None]
    want, states = delta_rule.steps(q, k, v.view(1, T, H, dv), g, b, start[None], keep_states=True)
    assert_near(out.view(1, T, H, dv), want)
    for j in range(T):
        assert_near(state[1, (1 + j) % T], states[0, j])
    assert torch.equal(history[1, :K - 1], window) and torch.equal(history[1, K - 1:], proj[:, :C])
