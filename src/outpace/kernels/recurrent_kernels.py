"""The recurrent layers of hybrid models on the CPU as compiled C, one call a layer.

A Gated DeltaNet layer in PyTorch is about 60 small ops between its two projections (the
convolution tap by tap, silu, norms, the delta rule's products per token, gathers and scatters
of the state cache), and its state moves through several copies each step. Here
(recurrent_kernels.c) one call runs all of it for every sequence of a forward, reading each
slot's state where the cache keeps it and writing the state after each token straight into its
snapshot entry; LFM2's gated short convolution, replay mode's commit and Qwen3.5's (1 + w) norm
are one call each too. Float32 and bfloat16 activations; the states are float32. A float64 model
(the exactness tests) keeps the PyTorch path.

Every sequence and head runs on one thread in one order, so a token's results never depend on
what else the call holds: a verify row's token gets the state and output of a decode step of
that token, bit for bit, and a replayed state is the verify forward's (tests/test_hybrid_kernels.py).

Built like cpu_kernels, at the instruction-set level cpu_isa chooses (the delta rule's token pass
has an AVX-512 path; other levels run the compiler's vectorised loops); without a compiler, or
with OUTPACE_CPU_KERNELS=0, the layers run their PyTorch ops.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

import torch

from outpace.kernels import cpu_build, cpu_isa

SOURCE = Path(__file__).with_name("recurrent_kernels.c")
DTYPES = (torch.float32, torch.bfloat16)


def _library() -> ctypes.CDLL | None:
    """The kernels at the level chosen now (OUTPACE_CPU_ISA may change between tests)."""
    if os.environ.get("OUTPACE_CPU_KERNELS", "1") == "0":
        return None
    return _load(cpu_isa.chosen())


@functools.cache
def _load(level: cpu_isa.Level) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(cpu_build.build(level, SOURCE)))
    except OSError as e:
        print(f"outpace: recurrent CPU kernels off ({e}); hybrid models' recurrent layers use PyTorch's ops",
              file=sys.stderr)
        return None
    p, i, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    c = ctypes.c_int
    lib.gated_deltanet.argtypes = [p, i, c, p, c, p, c, i, p, i, p, p, p, p, i, p, p, p, f, p, i, i, c, c, c, c, p]
    lib.gated_deltanet.restype = c
    lib.delta_replay.argtypes = [p, i, p, p, p, p, i, p, i, c, c, c, c]
    lib.short_conv.argtypes = [p, c, p, p, c, p, c, i, p, i, i, i, p]
    lib.short_conv.restype = c
    lib.offset_rms_norm.argtypes = [p, p, p, p, p, i, i, f, c]
    lib.offset_rms_norm.restype = c
    return lib


def kernel_weights(owner: torch.nn.Module, params: tuple[torch.Tensor | None, ...], make) -> tuple:
    """make(*float32 copies of params) (None stays None): the weights a kernel reads, kept on owner
    and made again whenever a parameter changes (replaced or written in place)."""
    key = tuple(None if p is None else (p.data_ptr(), p._version) for p in params)
    cached = owner.__dict__.get("_kernel_weights_cache")
    if cached is None or cached[0] != key:
        with torch.no_grad():
            made = make(*(None if p is None else p.detach().float() for p in params))
            cached = owner.__dict__["_kernel_weights_cache"] = (key, tuple(None if t is None else t.contiguous() for t in made))
    return cached[1]


def serves(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors (a layer's activations, its cache): all on the CPU
    in float32 or bfloat16, and the kernels built."""
    return all(t.device.type == "cpu" and t.dtype in DTYPES for t in tensors) and _library() is not None


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _check(code: int) -> None:
    if code == -1:
        raise MemoryError("out of memory for a recurrent layer's inputs")
    if code:
        raise ValueError("recurrent CPU kernel: head size beyond 256 or convolution beyond 16 taps")


def gated_deltanet(proj: torch.Tensor, conv_weight: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor,
                   norm_weight: torch.Tensor, eps: float, history: torch.Tensor, state: torch.Tensor,
                   log: tuple[torch.Tensor, ...] | None, rows: torch.Tensor,
                   heads: tuple[int, int, int, int]) -> torch.Tensor:
    """A Gated DeltaNet layer between its projections (recurrent_kernels.c's gated_deltanet).

    proj [T, P] the in_proj output [q k v | z | b | a] of the forward's tokens; conv_weight [K, C],
    neg_a = -exp(A_log), dt_bias [H], norm_weight [dv] float32; history [slots, K-1+R, C] and state
    [slots, E, H, dk, dv] one layer's of the StateCache; log: its (k, v, g, b) for verify rows in
    replay mode, else None; rows [N, 8] int64 (recurrent_rows.RowGroups.table); heads (Hk, dk,
    H, dv). Returns [T, H * dv] in proj's dtype, each head's output normed and gated."""
    Hk, dk, H, dv = heads
    proj = proj.contiguous()
    T = proj.shape[0]
    out = proj.new_empty(T, H * dv)
    log_k, log_v, log_g, log_b = log or (None,) * 4
    R = history.shape[1] - conv_weight.shape[0] + 1
    _check(_library().gated_deltanet(
        proj.data_ptr(), proj.shape[1], proj.dtype == torch.bfloat16, conv_weight.data_ptr(), conv_weight.shape[0],
        history.data_ptr(), history.dtype == torch.bfloat16, history.shape[1], state.data_ptr(), state.shape[1], _ptr(log_k), _ptr(log_v),
        _ptr(log_g), _ptr(log_b), R, neg_a.data_ptr(), dt_bias.data_ptr(), norm_weight.data_ptr(), eps,
        rows.data_ptr(), rows.shape[0], T, Hk, dk, H, dv, out.data_ptr()))
    return out


def delta_replay(state: torch.Tensor, log: tuple[torch.Tensor, ...], rows: torch.Tensor) -> None:
    """Replay mode's commit on one layer: rows [N, 5] int64 (slot, entry read, entry written,
    fresh, tokens): the delta rule over each row's logged tokens, as gated_deltanet ran them."""
    log_k, log_v, log_g, log_b = log
    Hk, dk = log_k.shape[2:]
    H, dv = log_v.shape[2:]
    rows = rows.contiguous()
    _library().delta_replay(state.data_ptr(), state.shape[1], log_k.data_ptr(), log_v.data_ptr(), log_g.data_ptr(),
                            log_b.data_ptr(), log_k.shape[1], rows.data_ptr(), rows.shape[0], Hk, dk, H, dv)


def short_conv(proj: torch.Tensor, conv_weight: torch.Tensor, bias: torch.Tensor | None, history: torch.Tensor,
               rows: torch.Tensor) -> torch.Tensor:
    """LFM2's c * conv(b * x) from proj [T, 3C] = [b | c | x]; conv_weight [K, C] and bias [C]
    float32; history and rows as in gated_deltanet. Returns [T, C] in proj's dtype."""
    proj = proj.contiguous()
    T, C = proj.shape[0], proj.shape[1] // 3
    out = proj.new_empty(T, C)
    _check(_library().short_conv(proj.data_ptr(), proj.dtype == torch.bfloat16, conv_weight.data_ptr(), _ptr(bias),
                                 conv_weight.shape[0], history.data_ptr(), history.dtype == torch.bfloat16,
                                 history.shape[1], rows.data_ptr(),
                                 rows.shape[0], T, C, out.data_ptr()))
    return out


def offset_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight_1p: torch.Tensor, eps: float):
    """(h + delta, rms_norm(h + delta) * weight_1p) computed in float32 and rounded once
    (weight_1p = 1 + w, float32); delta None: (h, rms_norm(h) * weight_1p)."""
    h = h.contiguous()
    delta = None if delta is None else delta.contiguous()
    dim = h.shape[-1]
    h_out = h if delta is None else torch.empty_like(h)
    x = torch.empty_like(h)
    if _library().offset_rms_norm(h.data_ptr(), _ptr(delta), weight_1p.data_ptr(), h_out.data_ptr(), x.data_ptr(),
                                  h.numel() // dim, dim, eps, h.dtype == torch.bfloat16):
        raise ValueError(f"recurrent CPU kernel: norms of at most 16384 values, got {dim}")
    return h_out, x
