"""StateCache: the recurrent state of a hybrid model's recurrent layers, per sequence slot, allocated
once, with what verification needs to roll a row back without running the model again.

Per recurrent layer and slot:
  - conv: the convolution's input history [K-1 + R, C] (K taps, R = max_row_tokens). A row's
    window (the K-1 inputs before its first token) starts at `conv_start`; a verify row writes its
    window and then its own inputs after it, so the window after any of its tokens n is entries
    n+1 .. n+K-1: rolling back moves `conv_start`, in either mode. A prompt chunk keeps only the
    window after its last token, at entry 0.
  - state (Gated DeltaNet layers): [E, H, dk, dv] entries; entry `live` is the slot's state.
    Snapshot mode (E = R): a verify row writes the state after its token j into entry
    (live + 1 + j) % E (never the entry it read, which it read first, unless j = E-1, which holds
    the state after all E tokens); commit(n) makes entry (read + 1 + n) % E live: a pointer.
    Replay mode (E = 2, for memory: 2 states and a log instead of R states): a verify row writes
    its state after its last token into the other entry and logs each token's k, v, g and b;
    commit(n), when n + 1 tokens are fewer than the row's, reruns the delta rule over the logged
    inputs of tokens 0..n from the entry the row read (the checkpoint). No layer of the model runs
    again: every layer is causal, so a rejected token changed no accepted token's inputs.
Prompt chunks (rows without logits) update the live state in place. A row at position 0 starts
from zero state (a new sequence in a reused slot); nothing needs clearing when a sequence ends.
One slot past the sequences' (`sink`) takes the rows of a static step that hold no sequence (the
CUDA graph runner's idle slots): their writes land there, where no sequence reads.

A forward whose rows return logits is a verify forward. Without a commit each row's state is the
one after its last token (padding included, where the runner padded it); after one with more than
one token a row, commit(slots, num_accepted) must come before the next forward. The host keeps
that record (begin_verify); a captured step's rows record nothing, so the runner records each
replay itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from outpace.errors import UnsupportedModelError
from outpace.kernels import recurrent_kernels
from outpace.model import delta_rule


@dataclass(frozen=True)
class RecurrentShape:
    """What one recurrent layer keeps per slot."""

    conv_channels: int
    conv_kernel: int
    delta: tuple[int, int, int, int] | None = None      # Gated DeltaNet: (key heads, dk, value heads, dv)


@dataclass
class StateRows:
    """Where one group of a forward's rows reads and writes its slots' state."""

    slots: torch.Tensor             # [B]
    fresh: torch.Tensor             # [B] bool: starts at position 0 (zero state)
    lengths: torch.Tensor           # [B] real tokens; a row's others (up to width) are padding
    width: int
    verify: bool                    # rows that return logits: they may be rolled back
    read: torch.Tensor              # [B] the entry holding each row's state before this forward
    conv_start: torch.Tensor        # [B] where each row's convolution window starts
    snapshots: torch.Tensor | None  # [B, width] entry of the state after each token (snapshot mode)
    final: torch.Tensor | None      # [B] entry of the state after the last real token (otherwise)


def state_bytes(shapes: list[RecurrentShape], num_slots: int, max_row_tokens: int, snapshots: bool,
                dtype: torch.dtype) -> int:
    """What StateCache(shapes, num_slots, max_row_tokens, snapshots, dtype) allocates for its
    histories, states and logs, in bytes: the cache built on the meta device, which holds no data."""
    return StateCache(shapes, num_slots, max_row_tokens, snapshots, dtype, "meta").nbytes


def free_memory(device: torch.device | str) -> int | None:
    """Bytes the device can still give: the GPU's free memory, or the host's available memory
    (Linux's MemAvailable); None where neither can be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class StateCache:
    def __init__(self, shapes: list[RecurrentShape], num_slots: int, max_row_tokens: int, snapshots: bool,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        """max_row_tokens: the most tokens a verify row holds (1 + most drafts); snapshots: one
        state per such token and slot (else checkpoint and replay). The conv history keeps the
        model's dtype; states are float32 (float64 for a float64 model)."""
        if max_row_tokens < 1:
            raise ValueError(f"max_row_tokens must be >= 1, got {max_row_tokens}")
        self.shapes, self.max_row_tokens, self.snapshots = shapes, max_row_tokens, snapshots
        self.state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.entries = max_row_tokens if snapshots else 2
        R, E = max_row_tokens, self.entries
        self.sink = num_slots
        num_slots += 1

        def zeros(*shape, dtype=self.state_dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.conv = [zeros(num_slots, s.conv_kernel - 1 + R, s.conv_channels, dtype=dtype) for s in shapes]
        self.state = [zeros(num_slots, E, s.delta[2], s.delta[1], s.delta[3]) if s.delta else None for s in shapes]
        # replay mode: each verify token's delta-rule inputs k [Hk, dk], v [H, dv], g [H], b [H]
        self.log = [(zeros(num_slots, R, s.delta[0], s.delta[1]), zeros(num_slots, R, s.delta[2], s.delta[3]),
                     zeros(num_slots, R, s.delta[2]), zeros(num_slots, R, s.delta[2]))
                    if s.delta and not snapshots else None for s in shapes]
        long = dict(dtype=torch.long)
        self.live, self.conv_start = zeros(num_slots, **long), zeros(num_slots, **long)
        # of each slot's last verify row: the entry it read, its tokens, whether it started at 0
        self.read, self.row_tokens = zeros(num_slots, **long), zeros(num_slots, **long)
        self.fresh = zeros(num_slots, dtype=torch.bool)
        self._arange = torch.arange(R + max(s.conv_kernel for s in shapes) if shapes else R, device=device)
        self._verify_width: int | None = None       # tokens a row of the last verify forward
        self._uncommitted = False                   # a verify forward of several tokens a row awaits commit

    @property
    def nbytes(self) -> int:
        tensors = self.conv + [s for s in self.state if s is not None] + [t for log in self.log if log for t in log]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- a forward ------------------------------------------------------------------------
    def begin_forward(self) -> None:
        if self._uncommitted:
            raise UnsupportedModelError(
                "a forward verified several tokens a row on a hybrid model and nothing committed how many "
                "were accepted (cache.commit): the engine does not roll back hybrid models' recurrent state "
                "yet; run them with spec='none' (--spec none)")

    def rows(self, slots: torch.Tensor, lengths: torch.Tensor, fresh: torch.Tensor, width: int,
             verify: bool, static: bool = False) -> StateRows:
        """Where rows of `width` tokens (lengths real) on `slots` read and write, and each slot
        moved to its state after the row's last token. Called once per group of a forward, after
        begin_forward, before any layer runs; static: a captured step's rows, device work only
        (the runner calls begin_verify at each replay)."""
        if verify and width > self.max_row_tokens:
            raise UnsupportedModelError(
                f"a hybrid model's state cache rolls back rows of at most {self.max_row_tokens} tokens "
                f"(max_row_tokens) and a forward asked for logits of {width} tokens a row: make the cache "
                f"with max_row_tokens >= 1 + num_draft_tokens, or run with spec='none' (--spec none)")
        read, conv_start = self.live[slots], self.conv_start[slots]
        snapshots = final = None
        if not verify:
            final = read
            self.conv_start[slots] = 0
            return StateRows(slots, fresh, lengths, width, False, read, conv_start, None, final)
        if self.snapshots:
            snapshots = (read[:, None] + 1 + self._arange[:width]) % self.entries
            self.live[slots] = (read + lengths) % self.entries
        else:
            final = 1 - read
            self.live[slots] = final
        self.read[slots], self.row_tokens[slots], self.fresh[slots] = read, lengths, fresh
        self.conv_start[slots] = lengths
        if not static:
            self.begin_verify(width)
        return StateRows(slots, fresh, lengths, width, True, read, conv_start, snapshots, final)

    def begin_verify(self, width: int) -> None:
        """The host's record of a verify forward of rows of `width` tokens: commit takes its
        width, and a forward before the commit is refused."""
        self._verify_width = width
        self._uncommitted = width > 1

    # ---- a layer's reads and writes (layer: index among the recurrent layers) -------------
    def conv_window(self, layer: int, rows: StateRows) -> torch.Tensor:
        """[B, K-1, C] the inputs before each row's first token (zeros for a fresh row)."""
        history = self.conv[layer]
        taps = history.shape[1] - self.max_row_tokens
        window = history[rows.slots[:, None], rows.conv_start[:, None] + self._arange[:taps]]
        return window.masked_fill(rows.fresh[:, None, None], 0)

    def save_conv(self, layer: int, rows: StateRows, inputs: torch.Tensor) -> None:
        """inputs [B, K-1 + width, C]: each row's window and then its tokens' inputs."""
        history = self.conv[layer]
        taps = history.shape[1] - self.max_row_tokens
        if rows.verify:
            history[rows.slots[:, None], self._arange[:inputs.shape[1]]] = inputs.to(history.dtype)
            return
        last = (rows.lengths[:, None] + self._arange[:taps])[..., None].expand(-1, -1, inputs.shape[-1])
        history[rows.slots[:, None], self._arange[:taps]] = inputs.gather(1, last).to(history.dtype)

    def state_before(self, layer: int, rows: StateRows) -> torch.Tensor:
        """[B, H, dk, dv] each row's state before its first token."""
        return self.state[layer][rows.slots, rows.read].masked_fill_(rows.fresh[:, None, None, None], 0)

    def save_states(self, layer: int, rows: StateRows, states: torch.Tensor) -> None:
        """states [B, width, H, dk, dv]: after each token (snapshot mode's verify rows)."""
        self.state[layer][rows.slots[:, None], rows.snapshots] = states

    def save_final(self, layer: int, rows: StateRows, state: torch.Tensor) -> None:
        """state [B, H, dk, dv]: after each row's last real token."""
        self.state[layer][rows.slots, rows.final] = state

    def save_log(self, layer: int, rows: StateRows, k, v, g, b) -> None:
        """Replay mode's verify rows: each token's delta-rule inputs (k [B, width, Hk, dk] before
        its heads are repeated, v, g, b), which commit replays."""
        at = (rows.slots[:, None], self._arange[:rows.width])
        for log, x in zip(self.log[layer], (k, v, g, b)):
            log[at] = x

    # ---- after acceptance -----------------------------------------------------------------
    def commit(self, slots, num_accepted) -> None:
        """Each slot's state becomes the one after its last verify row's token num_accepted (its
        drafts 0..num_accepted-1 accepted), for rows of the last verify forward. Snapshot mode:
        pointers only; replay mode: the delta rule reruns where the row kept fewer tokens than it
        had."""
        width = self._verify_width
        if width is None:
            raise ValueError("commit follows a forward whose rows return logits (a verify forward)")
        if not torch.is_tensor(num_accepted) and not all(0 <= n < width for n in num_accepted):
            raise ValueError(f"num_accepted must be in [0, {width - 1}] (drafts of a row of {width} tokens), "
                             f"got {list(num_accepted)}")
        device = self.live.device
        slots = torch.as_tensor(slots, dtype=torch.long, device=device)
        accepted = torch.as_tensor(num_accepted, dtype=torch.long, device=device)
        read = self.read[slots]
        if self.snapshots:
            self.live[slots] = (read + 1 + accepted) % self.entries
        else:
            self._replay(slots, read, accepted, width)
        self.conv_start[slots] = accepted + 1
        self._uncommitted = False

    def _replay(self, slots: torch.Tensor, read: torch.Tensor, accepted: torch.Tensor, width: int) -> None:
        """The state after tokens 0..accepted of each slot's last verify row, from the entry the row
        read, into the live entry; rows that kept all their tokens keep the state they have. Where
        verify forwards run the CPU kernels (the caches' dtypes are theirs), the kernels replay,
        with the forward's arithmetic."""
        redo = accepted + 1 < self.row_tokens[slots]
        live, fresh = self.live[slots], self.fresh[slots]
        if recurrent_kernels.serves(*self.conv, *(s for s in self.state if s is not None)):
            rows = torch.stack([slots, read, live, fresh.long(), accepted + 1], dim=1)[redo]
            if len(rows):
                for state, log in zip(self.state, self.log):
                    if state is not None:
                        recurrent_kernels.delta_replay(state, log, rows)
            return
        redo = redo[:, None, None, None]
        kept = (self._arange[:width][None, :] <= accepted[:, None])[..., None]       # [B, width, 1]
        fresh = fresh[:, None, None, None]
        for state, log in zip(self.state, self.log):
            if state is None:
                continue
            k, v, g, b = (x[slots, :width] for x in log)
            k = k.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
            start = state[slots, read].masked_fill(fresh, 0)
            _, replayed = delta_rule.steps(None, k, v, g.masked_fill(~kept, 0), b.masked_fill(~kept, 0), start)
            state[slots, live] = torch.where(redo, replayed, state[slots, live])
