"""The per-token score and position fields of a page, in their two encodings (torch reference).

* The paper's (8 bytes): ``score`` fp32, the *sum* of the attention a token received (policy module docstring),
  ``pos`` int32; the policy's mean is ``score / max(age - lag, 1)`` with ``age = position - pos``.
* Compact (4 bytes, ``DiffKVConfig.compact_meta``): ``score`` fp16, the *mean* itself, and ``pos`` int16, the
  position modulo 2^16 (``age = (position - pos) mod 2^16``, exact while a sequence has at most
  :data:`COMPACT_MAX_TOKENS` tokens). A decode step updates the mean in fp32 and rounds it once:
  ``m += (p - m) / max(age + 1 - lag, 1)`` (no multiply-add, so every backend rounds alike). A sum in fp16 would
  stop growing once a token's per-step attention drops below its sum's half-ulp; the mean keeps its relative
  precision (it stalls only when the update is below half an ulp of the mean itself, i.e. at its current value).

Peak importance (``DiffKVConfig.importance == "peak"``, beyond the paper) keeps in the same field, in either
encoding, the *largest* single-step attention a token has received (prefill: the largest over the scoring window's
queries); the update is ``s = max(s, p)`` rounded once to the stored dtype, and the policy compares ``s`` itself with
the thresholds (no division by age).

The compiled CPU step (``kernels/decode_cpu.c``) and the Triton kernels (``kernels/place_store.py``,
``kernels/paged_attention.py``) implement the same arithmetic; tests compare them bit for bit.
"""

from __future__ import annotations

import torch

COMPACT_MAX_TOKENS = 1 << 16
_WRAP = 0xFFFF


def field_dtypes(compact: bool) -> tuple[torch.dtype, torch.dtype]:
    """(score dtype, position dtype) as stored."""
    return (torch.float16, torch.int16) if compact else (torch.float32, torch.int32)


def encode_positions(pos: torch.Tensor, compact: bool) -> torch.Tensor:
    """Positions (any int dtype, may be negative: ``policy.prefill_positions`` with a lag) as stored."""
    if not compact:
        return pos.to(torch.int32)
    return ((pos.to(torch.int64) + 0x8000) & _WRAP).sub_(0x8000).to(torch.int16)


def ages(position: torch.Tensor, pos: torch.Tensor, compact: bool) -> torch.Tensor:
    """int64 ages ``position - pos``; position broadcasts against pos (stored positions, sign-extended)."""
    age = position.to(torch.int64) - pos.to(torch.int64)
    return age & _WRAP if compact else age


def full_positions(position: torch.Tensor, pos: torch.Tensor, compact: bool) -> torch.Tensor:
    """int64 positions such that ``position - result`` is the true age (compact: undoes the modulo)."""
    return position.to(torch.int64) - ages(position, pos, compact) if compact else pos.to(torch.int64)


def means(score: torch.Tensor, age: torch.Tensor, lag: int, compact: bool, peak: bool = False) -> torch.Tensor:
    """fp32 importance (mean attention, or the peak) of tokens of age ``age`` (int64, before this step's attention)
    from stored scores."""
    if compact or peak:
        return score.float()
    return score.float() / (age - lag).clamp_min(1).to(torch.float32)


def encode_prefill(score: torch.Tensor, pos: torch.Tensor, length: torch.Tensor, lag: int,
                   compact: bool, peak: bool = False) -> torch.Tensor:
    """Stored scores of prompt tokens: score sums [...] fp32 (peak: the peaks) with their (uncompressed) positions
    ``pos`` and the prompt length ``length`` (the next position; broadcasts) -> fp32 sums, or compact fp16 means
    (peak: the peaks in the stored dtype)."""
    if peak:
        return score.to(torch.float16 if compact else torch.float32)
    if not compact:
        return score.float()
    count = (length.to(torch.int64) - pos.to(torch.int64) - lag).clamp_min(1).to(torch.float32)
    return (score.float() / count).to(torch.float16)


def updated(score: torch.Tensor, gain: torch.Tensor, age: torch.Tensor, lag: int, compact: bool,
            peak: bool = False) -> torch.Tensor:
    """Stored scores after one step's attention ``gain`` [...] fp32; age: int64 before the step (same shape)."""
    if peak:
        return torch.maximum(score.float(), gain.float()).to(score.dtype)
    if not compact:
        return score + gain.to(score.dtype)
    m = score.float()
    return (m + (gain.float() - m) / (age + 1 - lag).clamp_min(1).to(torch.float32)).to(torch.float16)
