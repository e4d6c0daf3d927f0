"""The vLLM plug-in's batch-invariant switch (``diffkv.integrations.vllm.invariance``, issue #62 item 4a), without
vLLM: the blocked GEMM gives the engine's blocked bits, and ``install`` wraps whatever GEMM vLLM's dispatch chose.
The end-to-end measurement runs in the vLLM venv (benchmarks/serve/batch_invariance/vllm_batches.py)."""

from __future__ import annotations

import sys
import types

import torch

from diffkv.engine.invariance import blocked_linear
from diffkv.integrations.vllm.invariance import blocked, install


def test_blocked_gemm_gives_the_engine_s_blocked_bits_and_rows_independent_of_the_batch():
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    x = torch.randn(2, 19, 40, generator=g)  # 38 rows: three 16-row products, the last padded
    gemm = blocked(torch.nn.functional.linear)
    out = gemm(x, weight, bias)
    assert out.shape == (2, 19, 24) and torch.equal(out, blocked_linear(x, weight, bias))
    alone = gemm(x[1, 5:6], weight, bias)
    assert torch.equal(alone[0], out[1, 5])  # a row alone has its bits among 37 others
    assert gemm(x[:, :0], weight, bias).shape == (2, 0, 24)


def test_install_wraps_the_gemm_vllm_dispatches_once(monkeypatch):
    calls = []

    def dispatch(layer, remove_weight):  # vLLM's: picks a GEMM for the layer
        calls.append(remove_weight)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    utils = types.SimpleNamespace(dispatch_cpu_unquantized_gemm=dispatch)
    layers = types.ModuleType("vllm.model_executor.layers")
    layers.utils = utils
    for name, module in (("vllm", types.ModuleType("vllm")), ("vllm.model_executor", types.ModuleType("x")),
                         ("vllm.model_executor.layers", layers), ("vllm.model_executor.layers.utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)
    assert install() and not install()  # idempotent: vLLM may run the plug-in's register() more than once
    layer = torch.nn.Linear(40, 24)
    utils.dispatch_cpu_unquantized_gemm(layer, True)
    assert calls == [True] and getattr(layer.cpu_linear, "diffkv_blocked", False)
    x = torch.randn(3, 40)
    assert torch.equal(layer.cpu_linear(x, layer.weight, layer.bias), blocked_linear(x, layer.weight, layer.bias))
