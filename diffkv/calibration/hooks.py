"""Explicit attention recording for the profiling pass (no import-time patching).

:func:`recording` switches the model to an attention function that runs SDPA unchanged and hands the post-RoPE
queries and keys of every full-attention layer to a recorder; on exit the previous attention implementation is
restored and the handles are removed (in ``finally``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from diffkv.core import policy
from diffkv.hf.routing import attention_modules

RECORD_NAME = "diffkv_record"


class ImportanceRecorder:
    """Importance statistics of one causal forward over ``context + steps`` tokens (no padding).

    The first ``context`` tokens play the prompt: their prefill score is computed exactly as the cache does
    (:func:`diffkv.core.policy.prefill_scores`, last ``score_window`` prompt queries). Each of the next ``steps``
    queries plays one decode step: its probabilities over all tokens it sees, max over the GQA group.
    """

    def __init__(self, context: int, steps: int, score_window: int):
        self.context, self.steps, self.score_window = context, steps, score_window
        self.prefill: dict[int, torch.Tensor] = {}  # layer -> [B, H_kv, context] fp32
        self.decode: dict[int, torch.Tensor] = {}  # layer -> [B, H_kv, steps, context + steps] fp16

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """query: [B, H_q, T, D]; key: [B, H_kv, T, D] post-RoPE, T = context + steps."""
        b, hq, t, d = query.shape
        hkv, n, s = key.shape[1], self.context, self.steps
        if t != n + s:
            raise ValueError(f"recorder expects {n + s} tokens per forward, got {t}")
        self.prefill[layer_idx] = policy.prefill_scores(query[:, :, :n], key[:, :, :n], None, scaling,
                                                        self.score_window)
        if s == 0:
            return
        q = query[:, :, n:].float().view(b, hkv, hq // hkv, s, d)
        logits = torch.matmul(q, key.float()[:, :, None].transpose(-1, -2)) * scaling  # [B, H_kv, G, S, T]
        causal = torch.arange(t)[None, :] <= torch.arange(n, t)[:, None]  # [S, T]
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        self.decode[layer_idx] = probs.amax(dim=2).half()


def record_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA attention that also reports (query, key) of full-attention layers to ``module._diffkv_recorder``."""
    recorder = getattr(module, "_diffkv_recorder", None)
    if recorder is not None and getattr(module, "sliding_window", None) is None:
        recorder.observe(module.layer_idx, query, key, scaling if scaling is not None else module.scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)


@contextmanager
def recording(model, recorder: ImportanceRecorder):
    """Within the block, every forward of ``model`` reports its attention inputs to ``recorder``."""
    AttentionInterface.register(RECORD_NAME, record_attention_forward)
    AttentionMaskInterface.register(RECORD_NAME, sdpa_mask)
    modules = attention_modules(model)
    previous = model.config._attn_implementation
    try:
        for m in modules:
            m._diffkv_recorder = recorder
        model.set_attn_implementation(RECORD_NAME)
        yield recorder
    finally:
        for m in modules:
            if hasattr(m, "_diffkv_recorder"):
                del m._diffkv_recorder
        model.set_attn_implementation(previous)
