"""Batch-invariant model calls: a request's logits do not depend on how many other rows share its forward.

A compressed cache turns the last-bit differences of batched arithmetic into different quantization codes and tier
decisions, so a greedy answer can change with the load (``benchmarks/serve/batch_invariance.md``). On these CPUs the
model's own GEMMs are the source: with MKL, an fp32 ``linear`` over few rows takes another code path than over many
(rows of a 1- to 11-row product, except 4 and 8, differ in the last bits from the same rows inside a larger one),
while products of 4, 8 and :data:`MIN_ROWS` = 12 rows or more give each row the same bits. :func:`invariant_rows`
pads the input of every ``nn.Linear`` with zero rows to the next multiple of :data:`ROW_BLOCK` below that for the
duration of a forward, so a request decoded alone (one row, computed as four) gets exactly the bits it gets among
31 others. The padding is paid in compute: a lone request's GEMMs do 4x the multiplies
(``benchmarks/serve/batch_invariance.md``). :func:`rows_are_invariant` checks the property on the running machine
(another BLAS or a GPU may break it: then the engine refuses the mode rather than pretend).
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager

import torch
from torch import nn

MIN_ROWS = 12  # measured on MKL, AVX-512 and AVX2: 1-11 rows (except 4, 8) differ from larger products, 12+ not
ROW_BLOCK = 4  # below MIN_ROWS, products of a multiple of 4 rows agree with larger ones


def padded_rows(rows: int) -> int:
    """Rows a product of ``rows`` rows is computed over (rows >= 0)."""
    return rows if rows >= MIN_ROWS else -(-rows // ROW_BLOCK) * ROW_BLOCK


def _pad(module: nn.Linear, args: tuple):
    x = args[0]
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if padded_rows(rows) == rows:
        module._diffkv_rows.append(None)
        return None
    module._diffkv_rows.append(x.shape)
    flat = x.reshape(rows, x.shape[-1])
    return (torch.cat([flat, flat.new_zeros(padded_rows(rows) - rows, x.shape[-1])]),) + tuple(args[1:])


def _unpad(module: nn.Linear, args: tuple, out: torch.Tensor):
    shape = module._diffkv_rows.pop()
    if shape is None:
        return None
    rows = shape.numel() // shape[-1]
    return out[:rows].reshape(*shape[:-1], out.shape[-1])


@contextmanager
def invariant_rows(model: nn.Module):
    """Within the block, every ``nn.Linear`` of ``model`` computes over :func:`padded_rows` rows (zero rows
    appended, their outputs dropped). The hooks are removed on exit, also when the forward raises."""
    handles = []
    try:
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m._diffkv_rows = []
                handles.append(m.register_forward_pre_hook(_pad))
                handles.append(m.register_forward_hook(_unpad))
        yield model
    finally:
        for h in handles:
            h.remove()
        for m in model.modules():
            if isinstance(m, nn.Linear) and hasattr(m, "_diffkv_rows"):
                del m._diffkv_rows


def rows_are_invariant(model: nn.Module, probe_rows: int = 64, seed: int = 0, padded: bool = True) -> bool:
    """Whether, for the first ``nn.Linear`` of ``model`` on its device and dtype, each row computed in a small
    product (padded as :func:`invariant_rows` does, unless ``padded=False``) equals the same row inside a
    ``probe_rows``-row product, for 1 .. 2 * MIN_ROWS rows."""
    layer = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if layer is None:
        return True
    w = layer.weight
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(probe_rows, w.shape[1], generator=g).to(device=w.device, dtype=w.dtype)
    with torch.inference_mode():
        ref = nn.functional.linear(x, w, layer.bias)
        with invariant_rows(layer) if padded else contextlib.nullcontext():
            return all(torch.equal(layer(x[:n]), ref[:n]) for n in range(1, 2 * MIN_ROWS + 1))
