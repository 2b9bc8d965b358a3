"""The gated delta rule, the recurrence of Gated DeltaNet layers (Yang et al., 2024), per head:

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T        state S [dk, dv]
    o_t = S_t^T q_t                                               a_t = exp(g_t), g_t <= 0

Two forms of the same arithmetic, in plain PyTorch (a GPU kernel replaces each loop later):
`steps` runs token by token and can keep the state after every token (the snapshots that verify
rows roll back to); `chunks` runs a prompt in blocks of tokens, a few matrix products a block.
Tokens with g = 0 and b = 0 leave the state as it is, exactly (S * 1 + k * 0): rows of different
lengths are padded with such tokens.

Shapes: q, k [B, S, H, dk] (l2-normalised; q scaled by dk^-1/2; key heads already repeated up to
the value heads H), v [B, S, H, dv], g, b [B, S, H], state [B, H, dk, dv]; all one float dtype.
"""
from __future__ import annotations

import torch


def steps(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
          state: torch.Tensor, keep_states: bool = False):
    """Token by token. Returns (o [B, S, H, dv], or None when q is None, and the states after each
    token [B, S, H, dk, dv] with keep_states, else the last one [B, H, dk, dv]). `state` itself is
    not written."""
    B, S = k.shape[:2]
    out = v.new_empty(v.shape) if q is not None else None
    states = state.new_empty(B, S, *state.shape[1:]) if keep_states else None
    decay = g.exp()[..., None, None]                                        # [B, S, H, 1, 1]
    for t in range(S):
        state = torch.mul(state, decay[:, t], out=states[:, t] if keep_states else None)
        k_t = k[:, t, :, None, :]                                           # [B, H, 1, dk]
        delta = b[:, t, :, None, None] * (v[:, t, :, None, :] - k_t @ state)    # [B, H, 1, dv]: b (v - S^T k)
        state.addcmul_(k_t.transpose(-1, -2), delta)                        # + k delta^T
        if q is not None:
            out[:, t] = (q[:, t, :, None, :] @ state)[:, :, 0]
    return out, (states if keep_states else state)


def chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
           state: torch.Tensor, block: int = 64):
    """Blocks of `block` tokens (the sequence padded with identity tokens). Returns (o [B, S, H, dv],
    the last state [B, H, dk, dv]).

    Within a block, with G_t = exp(g_1 + ... + g_t) and S_0 the state before it, the state after
    token t is G_t S_0 + sum_{i<=t} (G_t / G_i) k_i u_i^T, where u_i, what token i writes, solves
    the unit lower-triangular system  u_i + b_i sum_{j<i} (G_i / G_j) (k_i . k_j) u_j
    = b_i v_i - b_i G_i S_0^T k_i,  i.e. U = U0 - W S_0 with U0, W independent of S_0."""
    B, S, H, dk = k.shape
    pad = -S % block
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, b = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (g, b))
    n = (S + pad) // block
    # [B, H, n, block, ...]
    q, k, v = (x.reshape(B, n, block, H, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g, b = (x.reshape(B, n, block, H).permute(0, 3, 1, 2) for x in (g, b))
    log_decay = g.cumsum(-1)                                                # log G_t
    causal = torch.ones(block, block, dtype=torch.bool, device=k.device).tril()
    # G_t / G_i for i <= t, else 0 (masked before exp: never a positive exponent)
    decay = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    system = (b[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)    # [.., block, block]
    u0 = torch.linalg.solve_triangular(system, b[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, (b * log_decay.exp())[..., None] * k, upper=False,
                                      unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay                              # (G_t / G_i) q_t . k_i
    q_decayed = q * log_decay.exp()[..., None]                              # G_t q_t
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]       # (G_end / G_i) k_i
    out = torch.empty_like(v)
    for c in range(n):
        u = u0[:, :, c] - w[:, :, c] @ state                                # [B, H, block, dv]
        out[:, :, c] = q_decayed[:, :, c] @ state + scores[:, :, c] @ u
        state = state * log_decay[:, :, c, -1].exp()[..., None, None] + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = out.permute(0, 2, 3, 1, 4).reshape(B, n * block, H, -1)[:, :S]
    return out, state
