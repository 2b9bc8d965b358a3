"""The Triton kernels of CUDA graph steps (kernels/triton_ops.py) against the reference ops, in
float32 from the same bf16 inputs; CUDA only.

Guards: the one-row product must equal F.linear for even and ragged sizes, with a bias; decode
attention must equal masked attention for grouped and plain heads of 16 to 256 dims, several
tokens per row, rows in a range of slots, a sliding window and key lengths that splits do not
divide, and must not read a cache entry past a query's position (those hold large values here,
which would swamp any result that saw them); with token trees' bits, exactly the keys of each
node's ancestors past its row's position.
"""
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("n,k,bias", [(960, 576, True), (576, 1536, False), (4096, 4096, False),
                                      (1001, 3000, True), (49152, 576, False)])
def test_matvec_equals_linear(n, k, bias):
    from outpace.kernels.triton_ops import matvec
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = matvec(x, w, b)
    assert got.shape == (1, 1, n) and got.dtype == torch.bfloat16
    # float32 sums rounded once to bf16: within bf16's relative step of the exact result
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("rows", [2, 9, 17])
def test_matvec_rows_compute_as_alone(rows):
    from outpace.kernels.triton_ops import matvec
    torch.manual_seed(0)
    w = torch.randn(960, 576, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(960, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, rows, 576, device="cuda", dtype=torch.bfloat16)
    got = matvec(x, w, b)
    assert got.shape == (1, rows, 960)
    for r in range(rows):
        assert torch.equal(got[0, r], matvec(x[:, r:r + 1], w, b)[0, 0])
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("heads,kv_heads,dim,rows,tokens,keys,window,slot_start", [
    (32, 8, 128, 1, 1, 512, 0, 0),       # Llama-3-8B's decode step
    (9, 3, 64, 3, 5, 640, 0, 1),         # the default model's heads, verify rows in slots 1..3
    (4, 2, 16, 2, 17, 192, 0, 2),
    (8, 8, 64, 2, 3, 256, 40, 0),        # no grouping, a sliding window
    (8, 2, 256, 1, 1, 200, 0, 0),        # Qwen3.5's gated attention: heads of 256, decode
    (8, 2, 256, 2, 9, 330, 0, 1),        # and verify rows of 1 + 8 tokens (64 query rows a block)
])
def test_decode_attention_equals_masked_attention(heads, kv_heads, dim, rows, tokens, keys, window, slot_start):
    from outpace.kernels.triton_ops import decode_attention
    torch.manual_seed(0)
    slots, length = slot_start + rows + 1, keys + 64
    k_cache = torch.randn(slots, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(slots, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16)
    starts = torch.randint(0, keys - tokens + 1, (rows, 1), device="cuda")
    starts[0] = keys - tokens                                     # one row reaches the last key
    positions = starts + torch.arange(tokens, device="cuda")      # [rows, tokens]
    for r in range(rows):                                         # past the row's last query: poison
        k_cache[slot_start + r, :, positions[r, -1] + 1:] = 300.0
        v_cache[slot_start + r, :, positions[r, -1] + 1:] = 1e4
    q = torch.randn(rows, tokens, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    key = torch.arange(keys, device="cuda")
    seen = key <= positions[:, None, :, None]                     # [rows, 1, tokens, keys]
    if window:
        seen &= key > positions[:, None, :, None] - window
    k_rows = k_cache[slot_start:slot_start + rows, :, :keys].float().repeat_interleave(heads // kv_heads, 1)
    v_rows = v_cache[slot_start:slot_start + rows, :, :keys].float().repeat_interleave(heads // kv_heads, 1)
    want = F.scaled_dot_product_attention(q.float(), k_rows, v_rows, attn_mask=seen)
    got = decode_attention(q, k_cache, v_cache, positions, keys, slot_start, window)
    assert got.shape == (rows, tokens, heads * dim)
    torch.testing.assert_close(got.float(), want.transpose(1, 2).reshape(rows, tokens, -1), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("heads,kv_heads,dim,rows,nodes,keys", [
    (9, 3, 64, 1, 16, 512),              # the default model's heads, a tree of 16 nodes
    (9, 3, 64, 3, 8, 640),
    (4, 2, 16, 2, 32, 192),              # a tree of 32 nodes: bits up to 31
    (8, 2, 64, 1, 39, 300),              # a head's frontier entries: bits up to 38
])
def test_decode_attention_with_tree_bits_equals_masked_attention(heads, kv_heads, dim, rows, nodes, keys):
    """Token trees: every query sees the keys up to its position and those of its ancestors among
    the next keys (bit i of its tree word: key position + 1 + i), none of the others (they hold
    values that would show), whatever the keys past them hold (poison)."""
    from outpace.kernels.triton_ops import decode_attention
    torch.manual_seed(0)
    tokens = nodes + 1
    k_cache = torch.randn(rows, kv_heads, keys + 64, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(rows, kv_heads, keys + 64, dim, device="cuda", dtype=torch.bfloat16)
    starts = torch.randint(0, keys - tokens + 1, (rows,), device="cuda")
    starts[0] = keys - tokens
    seen = torch.zeros(rows, 1, tokens, keys, dtype=torch.bool, device="cuda")
    bits = torch.zeros(rows, tokens, dtype=torch.long)
    for r in range(rows):
        k_cache[r, :, starts[r] + tokens:] = 300.0
        v_cache[r, :, starts[r] + tokens:] = 1e4
        parents = [-1] + [int(torch.randint(-1, j, (1,))) for j in range(1, nodes)]
        seen[r, 0, :, :starts[r] + 1] = True
        for j in range(nodes):                                    # token j + 1: node j
            at = j
            while at >= 0:
                seen[r, 0, j + 1, starts[r] + 1 + at] = True
                bits[r, j + 1] |= 1 << at
                at = parents[at]
    q = torch.randn(rows, tokens, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k_rows = k_cache[:, :, :keys].float().repeat_interleave(heads // kv_heads, 1)
    v_rows = v_cache[:, :, :keys].float().repeat_interleave(heads // kv_heads, 1)
    want = F.scaled_dot_product_attention(q.float(), k_rows, v_rows, attn_mask=seen)
    got = decode_attention(q, k_cache, v_cache, starts[:, None].expand(rows, tokens), keys, tree=bits.cuda())
    torch.testing.assert_close(got.float(), want.transpose(1, 2).reshape(rows, tokens, -1), rtol=2e-2, atol=2e-2)


def test_attention_fits_what_registers_hold():
    from outpace.kernels.triton_ops import attention_fits
    assert attention_fits(128, 128) and attention_fits(256, 36) and attention_fits(256, 64)
    assert not attention_fits(256, 65) and not attention_fits(512, 1) and not attention_fits(96, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_self_check_passes_on_this_card(dtype):
    from outpace.kernels.triton_ops import self_check, tree_check
    assert self_check(torch.device("cuda"), dtype) is None
    assert tree_check(torch.device("cuda"), dtype) is None
