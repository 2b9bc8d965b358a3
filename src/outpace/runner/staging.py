"""Host-to-device staging: small host values reach the device in one asynchronous copy from
pinned memory, so building a step's inputs never waits for the device."""
from __future__ import annotations

import torch


def to_device(values: list | torch.Tensor, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list (or host tensor) as a device tensor (int64 unless dtype says), copied
    without a host synchronisation."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def slot_rows(slots: list[int], device: torch.device | str) -> slice | torch.Tensor:
    """Where a graph's row r is slot r, the rows of batch rows in `slots`: a slice (a view, no
    copy) where they are slots 0.. in order, else a device index."""
    return slice(0, len(slots)) if slots == list(range(len(slots))) else to_device(slots, device)


class HostSide:
    """A device tensor's host side: written in place, then sent in one asynchronous copy. On CUDA
    it is pinned memory, and an event marks when the device has read it: the next write waits
    for that, since the copy reads the host memory after the call that queued it returns. On the
    CPU it is the tensor itself, and sending does nothing."""

    def __init__(self, device_tensor: torch.Tensor):
        self.device_tensor = device_tensor
        is_cuda = device_tensor.device.type == "cuda"
        self.host = torch.zeros_like(device_tensor, device="cpu", pin_memory=True) if is_cuda else device_tensor
        self.values = self.host.numpy()                 # the view the host writes through
        self.read = torch.cuda.Event() if is_cuda else None
        self._parts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}    # (device, host) views

    def writable(self):
        """values, once the last copy has read them."""
        if self.read is not None:
            self.read.synchronize()
        return self.values

    def send(self, start: int, stop: int) -> None:
        """Queue values[start:stop] to the device tensor's same entries."""
        if self.read is None:
            return
        parts = self._parts.get((start, stop))
        if parts is None:
            parts = self._parts[(start, stop)] = self.device_tensor[start:stop], self.host[start:stop]
        parts[0].copy_(parts[1], non_blocking=True)
        self.read.record()
