"""A transformers ``Cache`` for one engine forward pass: hands each layer's K/V to that layer's compressor.

The engine runs the unmodified transformers model with ``past_key_values=StepCache(...)`` and explicit
``position_ids`` (ragged at decode: one position per sequence, no padding). Every layer's ``update`` registers
itself with the model's :class:`~diffkv.hf.routing.Router`; the ``diffkv`` attention function then
calls :meth:`StepLayer.attend`:

* ``prefill`` (one request, no padding): causal SDPA over the prompt, then the compressor stores it in pages;
* ``decode`` (the running requests, one token each): the compressor's decode step over the pages (pages were
  reserved beforehand for all layers at once by the backend).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from diffkv.compressor import LayerCompressor
from diffkv.hf.layer import RoutedLayer
from diffkv.hf.routing import Router, sdpa_attention_forward


class StepLayer(RoutedLayer):
    """One layer of one engine pass: ``phase`` is fixed ("prefill" of one request or "decode" of the running ones)
    and the layer takes exactly one ``update``."""

    def __init__(self, router: Router, compressor: LayerCompressor, phase: str):
        super().__init__(compressor.layer_idx)
        self.router, self.compressor, self.fixed_phase = router, compressor, phase

    def next_phase(self, q: int) -> str:
        if (self.fixed_phase == "decode" and q != 1) or self.processed:
            raise RuntimeError(f"StepCache({self.fixed_phase}) got {q} tokens after {self.processed}; "
                               "a StepCache serves exactly one forward pass")
        return self.fixed_phase

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        """query: [B, H_q, q, D]. Returns ([B, q, H_q, D], None)."""
        if self.phase == "prefill":
            kwargs.pop("is_causal", None)
            out, _ = sdpa_attention_forward(module, query, key, value, None, scaling=scaling, is_causal=True,
                                            **kwargs)
            valid = torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
            self.compressor.prefill(query, key, value, valid, scaling)
            return out, None
        out = self.compressor.decode(query[:, :, 0], key[:, :, 0], value[:, :, 0], scaling, reserved=True)
        return out.to(query.dtype).unsqueeze(1), None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the mask is not used: prefill is causal SDPA, decode reads its own pages

    def get_seq_length(self) -> int:
        return 0


class StepCache(Cache):
    """compressors: one :class:`LayerCompressor` per model layer, over the sequences of this pass."""

    def __init__(self, router: Router, compressors: list[LayerCompressor], phase: str):
        if phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
        super().__init__(layers=[StepLayer(router, c, phase) for c in compressors])
