"""Tensors carved from a host's memory: a store laid over a serving framework's KV buffer keeps its tables and key
vectors inside that buffer too, so the framework's KV budget counts them (docs/design.md §6.3)."""

from __future__ import annotations

import math

import torch

ALIGN = 16  # bytes: every tensor starts at a multiple of it


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` with its index filled in ("cuda" -> "cuda:0", the current device): torch compares
    ``torch.device("cuda") != torch.device("cuda:0")``, while a tensor made on "cuda" reports "cuda:0"."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Arena:
    """Hands out tensors that are views of ``buffer`` (uint8 [N], contiguous), one after another, each aligned to
    :data:`ALIGN` bytes. Nothing is freed: an arena lives as long as the store it serves."""

    def __init__(self, buffer: torch.Tensor):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError(f"an arena needs a contiguous uint8 [N] buffer, got {buffer.dtype} {tuple(buffer.shape)}")
        self.buffer, self.used = buffer, 0

    @staticmethod
    def bytes_for(*tensors: tuple[tuple[int, ...], torch.dtype]) -> int:
        """Bytes an arena needs for tensors of these (shape, dtype), alignment included."""
        total = 0
        for shape, dtype in tensors:
            total = -(-total // ALIGN) * ALIGN + math.prod(shape) * dtype.itemsize
        return total

    def full(self, shape: tuple[int, ...], value, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` filled with ``value``, in the next free bytes of the buffer."""
        start = -(-self.used // ALIGN) * ALIGN
        end = start + math.prod(shape) * dtype.itemsize
        if end > self.buffer.numel():
            raise ValueError(f"the arena's {self.buffer.numel()} bytes hold no {tuple(shape)} {dtype} tensor after "
                             f"the {self.used} bytes already used")
        self.used = end
        return self.buffer[start:end].view(dtype).view(shape).fill_(value)


def full(arena: Arena | None, shape: tuple[int, ...], value, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.full`` on ``device``, or the same tensor carved from ``arena`` when one is given."""
    if arena is None:
        return torch.full(shape, value, dtype=dtype, device=device)
    return arena.full(shape, value, dtype)
