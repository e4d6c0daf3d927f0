"""A transformers ``Cache`` for one engine forward pass: hands each layer's K/V to that layer's compressor.

The engine runs the unmodified transformers model with ``past_key_values=StepCache(...)`` and explicit
``position_ids`` (ragged: no padding). Every layer's ``update`` registers itself with the model's
:class:`~diffkv.hf.routing.Router`; the ``diffkv`` attention function then calls :meth:`StepLayer.attend`:

* ``prefill`` (the prompts of the requests admitted this step, packed into one row, each with its own positions
  from 0): causal SDPA over each prompt's own segment, then each group of prompts (:func:`pad_groups`) is
  left-padded into one batch and its compressor stores it in the prompts' pages;
* ``decode`` (the running requests, one token each): the compressor's decode step over the pages (pages were
  reserved beforehand for all layers at once by the engine's cache).

Sliding-window layers of a hybrid model (Gemma-3) are :class:`SlidingStepLayer`: SDPA over each prompt's segment
with the window's causal mask, or over each request's window read from its pages
(:mod:`diffkv.engine.sliding`); their K/V is stored uncompressed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from diffkv.cache.kv_store import KVStore
from diffkv.engine.sliding import SlidingDecode, SlidingPrefill
from diffkv.hf.layer import RoutedLayer
from diffkv.hf.routing import Router, sdpa_attention_forward


@dataclass(frozen=True)
class LayerTarget:
    """Where one model layer's K/V go in one engine pass: table layer ``layer`` of ``store``, for ``slots`` (one
    group of packed prompts, or every running request). Only the store's entry points are called. fill_pages: a
    prefix frozen next (``KVStore.prefill``)."""

    store: KVStore
    layer: int
    slots: tuple[int, ...]
    fill_pages: bool = False

    @property
    def score_window(self) -> int:
        return self.store.config.score_window

    def prefill(self, query, key, value, valid, scaling) -> None:
        self.store.prefill(self.layer, list(self.slots), query, key, value, valid, scaling,
                           fill_pages=self.fill_pages)

    def decode(self, query, key, value, scaling) -> torch.Tensor:
        """The step planned by ``KVStore.begin_step`` (pages reserved). Returns [B, H_q, D] fp32."""
        return self.store.decode(self.layer, query, key, value, scaling)


@dataclass(frozen=True)
class DeferredTarget:
    """A :class:`LayerTarget` whose prompt stores wait: ``prefill`` records its arguments in ``log`` (one entry
    per call, in layer order) and the host runs them after the forward (:func:`run_deferred`). A prefill that rides
    in the decode forward (issue #61) stores this way, so that a store that fails (no pages, NaN keys) cannot leave
    the step's decodes half done."""

    target: LayerTarget
    log: list

    @property
    def score_window(self) -> int:
        return self.target.score_window

    def prefill(self, query, key, value, valid, scaling) -> None:
        self.log.append((self.target, (query, key, value, valid, scaling)))


def run_deferred(log: list, slots: tuple[int, ...]) -> None:
    """Run the recorded stores of the group of ``slots`` (every layer, in order). Raises what the store raises
    (``PoolExhausted``, ``ValueError``); the caller closes the group's slots then."""
    for target, args in log:
        if target.slots == slots:
            target.prefill(*args)


def pad_groups(lengths: list[int], waste: float = 2.0) -> list[list[int]]:
    """Split the sequences of ``lengths`` into groups, longest first, whose left-padded batch (``len(group)`` x the
    longest) is at most ``waste`` x the group's tokens: the compressor's padded copies stay near the packed size."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= waste * (total + lengths[i]):
            groups[-1].append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


def left_pad(x: torch.Tensor, starts: list[int], lengths: list[int], last: int | None = None) -> torch.Tensor:
    """x: [1, H, T, D] packed segments -> [B, H, max(lengths), D], segment b right-aligned, zeros before it.
    last: copy only each segment's last ``last`` tokens (zeros before them)."""
    width = max(lengths)
    out = x.new_zeros(len(lengths), x.shape[1], width, x.shape[3])
    for b, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        k = n if last is None else min(n, last)
        out[b, :, width - k:] = x[0, :, s + n - k:s + n]
    return out


class StepLayer(RoutedLayer):
    """Model layer ``layer_idx`` of one engine pass: ``phase`` is fixed ("prefill" of the packed prompts of
    ``lengths``, or "decode" of the running requests) and the layer takes exactly one ``update``. ``compressors``
    (:class:`LayerTarget`):
    one per group of ``groups`` (indices into ``lengths``; decode: one compressor over every running request)."""

    def __init__(self, router: Router, layer_idx: int, compressors: list[LayerTarget], phase: str,
                 lengths: list[int] | None = None, groups: list[list[int]] | None = None):
        super().__init__(layer_idx)
        self.router, self.compressors, self.fixed_phase = router, compressors, phase
        self.lengths, self.groups = lengths, groups

    def next_phase(self, q: int) -> str:
        if (self.fixed_phase == "decode" and q != 1) or self.processed:
            raise RuntimeError(f"StepCache({self.fixed_phase}) got {q} tokens after {self.processed}; "
                               "a StepCache serves exactly one forward pass")
        if self.fixed_phase == "prefill" and self.lengths is not None and sum(self.lengths) != q:
            raise RuntimeError(f"StepCache(prefill) expected {sum(self.lengths)} packed tokens, got {q}")
        return self.fixed_phase

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        """query: [B, H_q, q, D] (prefill: B = 1, the prompts packed). Returns ([B, q, H_q, D], None)."""
        if self.phase == "decode":
            out = self.compressors[0].decode(query[:, :, 0], key[:, :, 0], value[:, :, 0], scaling)
            return out.to(query.dtype).unsqueeze(1), None
        kwargs.pop("is_causal", None)
        lengths = self.lengths or [key.shape[2]]
        if len(lengths) == 1:  # one prompt: as it is, no copy
            out, _ = sdpa_attention_forward(module, query, key, value, None, scaling=scaling, is_causal=True,
                                            **kwargs)
            valid = torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
            self.compressors[0].prefill(query, key, value, valid, scaling)
            return out, None
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        outs = [sdpa_attention_forward(module, query[:, :, s:s + n], key[:, :, s:s + n], value[:, :, s:s + n],
                                       None, scaling=scaling, is_causal=True, **kwargs)[0]
                for s, n in zip(starts, lengths, strict=True)]
        for comp, group in zip(self.compressors, self.groups, strict=True):
            s, n = [starts[i] for i in group], [lengths[i] for i in group]
            width, counts = max(n), torch.tensor(n, device=key.device)[:, None]
            valid = torch.arange(width, device=key.device)[None, :] >= width - counts  # [B, width], left padding
            # the compressor reads only the last score_window queries of each prompt (its importance window)
            q = left_pad(query, s, n, last=comp.score_window)
            comp.prefill(q, left_pad(key, s, n), left_pad(value, s, n), valid, scaling)
        return torch.cat(outs, dim=1), None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the mask is not used: prefill is causal SDPA per prompt, decode reads its pages

    def get_seq_length(self) -> int:
        return 0


class SlidingStepLayer(StepLayer):
    """One sliding-window layer of one engine pass; ``sliding``: the step's handle on the sliding-window pages."""

    is_sliding = True

    def __init__(self, router: Router, layer_idx: int, sliding: SlidingPrefill | SlidingDecode, phase: str,
                 lengths: list[int] | None = None):
        RoutedLayer.__init__(self, layer_idx)
        self.router, self.sliding, self.fixed_phase, self.lengths = router, sliding, phase, lengths

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        """query: [B, H_q, q, D] (prefill: B = 1, the prompts packed). Returns ([B, q, H_q, D], None)."""
        kwargs.pop("is_causal", None)
        if self.phase == "decode":
            k, v, mask = self.sliding.append_and_read(self.layer_idx, key[:, :, 0], value[:, :, 0])
            return sdpa_attention_forward(module, query, k.to(query.dtype), v.to(query.dtype), mask,
                                          scaling=scaling, **kwargs)
        lengths = self.lengths or [key.shape[2]]
        window, outs, start = self.sliding.store.window, [], 0
        for slot, n in zip(self.sliding.slots, lengths, strict=True):
            q, k, v = (x[:, :, start:start + n] for x in (query, key, value))
            mask = None
            if n > window:  # causal within the window: key j is seen by query i when i - window < j <= i
                i, j = torch.arange(n, device=key.device)[:, None], torch.arange(n, device=key.device)[None, :]
                mask = ((j <= i) & (j > i - window))[None, None]
            outs.append(sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, is_causal=mask is None,
                                               **kwargs)[0])
            self.sliding.store.write_prompt(self.layer_idx, slot, k[0], v[0])
            start += n
        return torch.cat(outs, dim=1), None


class StepCache(Cache):
    """compressors: per model layer, the :class:`LayerTarget` (the cache's table layer, which may differ from the
    model layer) of each group of ``groups`` (prefill) or the one
    over every running request (decode), None for a sliding-window layer (then ``sliding`` is the step's handle on
    their pages). lengths: the packed prompts' lengths (prefill)."""

    def __init__(self, router: Router, compressors: list[list[LayerTarget] | None], phase: str,
                 lengths: list[int] | None = None, groups: list[list[int]] | None = None,
                 sliding: SlidingPrefill | SlidingDecode | None = None):
        if phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
        if lengths is not None and len(lengths) > 1 and sorted(i for g in groups or [] for i in g) != list(
                range(len(lengths))):
            raise ValueError(f"groups {groups} must cover the {len(lengths)} packed prompts exactly once")
        if sliding is None and any(c is None for c in compressors):
            raise ValueError("sliding-window layers need the step's sliding handle")
        super().__init__(layers=[StepLayer(router, i, c, phase, lengths, groups) if c is not None
                                 else SlidingStepLayer(router, i, sliding, phase, lengths)
                                 for i, c in enumerate(compressors)])
