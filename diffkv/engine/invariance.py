"""Batch-invariant model calls: a request's logits do not depend on how many other rows share its forward.

A compressed cache turns the last-bit differences of batched arithmetic into different quantization codes and tier
decisions, so a greedy answer can change with the load (``benchmarks/serve/batch_invariance.md``). On these CPUs the
model's own GEMMs are the source: an fp32 ``linear`` takes another code path, and gives a row other bits, depending
on how many rows the product has (on AVX2 and AVX-512 MKL builds 1-11 rows except 4 and 8; with torch 2.13 on
AMX-capable Xeons every row count up to more than 128). Within a product of a fixed row count, though, a row's bits
do not depend on the other rows nor on its position. :func:`invariant_rows` therefore computes every ``nn.Linear``
of the model in blocks of exactly :data:`ROW_BLOCK` rows (the last block padded with zero rows) for the duration of
a forward, so a request decoded alone gets exactly the bits it gets among 31 others. The padding is paid in compute:
a lone request's GEMMs do 16x the multiplies, long prefills run as many 16-row products
(``benchmarks/serve/batch_invariance.md``). :func:`rows_are_invariant` checks the property on the running machine
for every weight shape of the model (another BLAS or a GPU may break it: then the engine refuses the mode).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from diffkv.ops.row_blocks import ROW_BLOCK, blocked_gemm  # every product: exactly ROW_BLOCK rows


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as products of exactly :data:`ROW_BLOCK` rows
    (``diffkv.ops.row_blocks.blocked_gemm``). x: [..., in] -> [..., out]; each output row has the bits it has in
    any other blocked product."""
    return blocked_gemm(nn.functional.linear, x, weight, bias)


def _blocked_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return blocked_linear(x, self.weight, self.bias)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


@contextmanager
def invariant_rows(model: nn.Module):
    """Within the block, every ``nn.Linear`` of ``model`` computes with :func:`blocked_linear` (its instance's
    ``forward`` shadowed, restored on exit, also when the forward raises). Subclasses of ``nn.Linear`` with their
    own ``forward`` are refused (their arithmetic is theirs)."""
    layers = _linears(model)
    custom = [type(m).__name__ for m in layers if type(m).forward is not nn.Linear.forward]
    if custom:
        raise ValueError(f"invariant_rows: linear layers with their own forward ({sorted(set(custom))}) cannot be "
                         "computed in fixed row blocks")
    try:
        for m in layers:
            m.forward = _blocked_forward.__get__(m)
        yield model
    finally:
        for m in layers:
            m.__dict__.pop("forward", None)


def _rows_agree(layer: nn.Linear, x: torch.Tensor, blocked: bool) -> bool:
    """Whether rows computed in small products at several offsets equal the same rows of the whole product."""
    def product(rows):
        return (blocked_linear if blocked else nn.functional.linear)(rows, layer.weight, layer.bias)

    ref = product(x)
    sizes = range(1, 2 * ROW_BLOCK + 1) if not blocked else (1, 2, 3, 5, ROW_BLOCK - 1, ROW_BLOCK, ROW_BLOCK + 1,
                                                                2 * ROW_BLOCK + 3)
    offsets = (0,) if not blocked else (0, 1, 7)
    return all(torch.equal(product(x[s:s + n]), ref[s:s + n]) for s in offsets for n in sizes)


def rows_are_invariant(model: nn.Module, probe_rows: int = 64, seed: int = 0, blocked: bool = True) -> bool:
    """Whether each ``nn.Linear`` weight shape of ``model`` (on its device and dtype) gives a row the same bits in a
    small product as inside a ``probe_rows``-row one, at several row offsets: computed in blocks as
    :func:`invariant_rows` does, or as plain products with ``blocked=False`` (then 1 .. 2 * ROW_BLOCK rows)."""
    if any(type(m).forward is not nn.Linear.forward for m in _linears(model)):
        return False
    seen = set()
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.inference_mode():
        for layer in _linears(model):
            key = (tuple(layer.weight.shape), layer.weight.dtype, layer.weight.device, layer.bias is None)
            if key in seen:
                continue
            seen.add(key)
            x = torch.randn(probe_rows, layer.weight.shape[1], generator=g)
            if not _rows_agree(layer, x.to(device=layer.weight.device, dtype=layer.weight.dtype), blocked):
                return False
    return True

