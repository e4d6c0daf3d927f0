"""Next-token choice for a batch of requests with their own sampling parameters, and stop-string handling."""

from __future__ import annotations

import torch

from diffkv.engine.request import Request, SamplingParams


def _generator(request: Request) -> torch.Generator | None:
    """A per-request CPU generator (seeded requests are reproducible whatever else runs in the batch)."""
    if request.generator is None and request.params.seed is not None:
        request.generator = torch.Generator().manual_seed(request.params.seed)
    return request.generator


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [V] fp32. Temperature + top-p (nucleus) sampling; greedy when temperature is 0."""
    if params.greedy:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, -1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def next_tokens(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits: [R, V] (last position of each request, in ``requests`` order). Greedy rows in one argmax."""
    greedy = [i for i, r in enumerate(requests) if r.params.greedy]
    out = [0] * len(requests)
    if greedy:
        for i, t in zip(greedy, logits[greedy].argmax(-1).tolist(), strict=True):
            out[i] = t
    for i, r in enumerate(requests):
        if not r.params.greedy:
            out[i] = sample_one(logits[i], r.params, _generator(r))
    return out


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    """Index where the first stop string starts in ``text`` (looking only at matches that end after
    ``search_from``, i.e. involve new text), or None."""
    best = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
