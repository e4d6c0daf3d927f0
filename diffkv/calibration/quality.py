"""Quality of a DiffKV configuration vs the full cache, by teacher-forced decode over calibration text.

Each text's first ``context`` tokens are prefilled into a :class:`DiffKVCache`, then the next ``steps`` tokens are
fed one at a time, so every prediction comes from the compressed cache as it evolves during decode. The full-cache
reference is the recorded ``ref_logprobs`` of the profiling pass (same tokens, same positions).
"""

from __future__ import annotations

import math
from itertools import islice

import torch

from diffkv.core.config import DiffKVConfig


@torch.no_grad()
def decode_logprobs(model, ids: torch.Tensor, context: int, config: DiffKVConfig,
                    progress: bool = False, backend: str = "auto", tokenizer=None) -> tuple[torch.Tensor, dict]:
    """Log-probabilities through a DiffKVCache. ids: [B, context + steps (+ more)] -> [B, steps, V] fp32, stats.

    The prefill covers ``ids[:, :context]``; step s feeds token ``context + s`` and predicts ``context + s + 1``.
    backend: the cache's decode backend (``DiffKVCache(attention_backend=...)``). tokenizer: gives the re-read
    pass its bridge for a config with ``prompt_scores="repeat"`` (default: the model folder's).
    """
    from tqdm.auto import tqdm

    from diffkv.hf.generation import teacher_forced
    from diffkv.integrations.transformers import DiffKVCache

    steps = ids.shape[1] - context - 1
    cache = DiffKVCache(model, config, attention_backend=backend, tokenizer=tokenizer)
    try:  # teacher_forced yields token `context` first (the prefill's prediction): not a decode step, skipped
        logps = islice(teacher_forced(model, ids, context, cache), 1, None)
        out = list(tqdm(logps, total=steps, desc="decode", leave=False, disable=not progress))
        return torch.stack(out, 1), cache.stats()
    finally:
        cache.release()


def compare(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict:
    """ref, got: [N, S, V] log-probs (full cache, DiffKV); targets: [N, S] next tokens.

    Returns mean KL(full || DiffKV) per token (nats), top-1 agreement and the perplexity ratio DiffKV / full.
    """
    kl = (ref.exp() * (ref - got)).sum(-1)  # [N, S]
    nll_ref = -ref.gather(-1, targets[..., None]).squeeze(-1)
    nll_got = -got.gather(-1, targets[..., None]).squeeze(-1)
    return {
        "kl": float(kl.mean()), "kl_p95": float(kl.flatten().quantile(0.95)),
        "top1": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
        "ppl_ratio": math.exp(float(nll_got.mean() - nll_ref.mean())), "ppl_full": math.exp(float(nll_ref.mean())),
    }


def measure_quality(model, stats, config: DiffKVConfig, batch_size: int | None = None, progress: bool = False,
                    tokenizer=None) -> dict:
    """Quality and measured compression of ``config`` on the texts of ``stats`` (see module doc; tokenizer: for
    repeat scores, ``decode_logprobs``).

    Returns ``compare`` metrics plus ``compression_physical`` (all texts' fp16 bytes / page bytes) and
    ``tier_fractions`` measured by the cache.
    """
    ids, n = stats.ids, stats.ids.shape[0]
    batch_size = batch_size or n
    got, fp16, held, tiers = [], 0, 0, {"high": 0, "low": 0, "pruned": 0}
    for i in range(0, n, batch_size):
        logp, st = decode_logprobs(model, ids[i:i + batch_size], stats.context, config, progress,
                                   tokenizer=tokenizer)
        got.append(logp)
        fp16, held = fp16 + st["fp16_bytes"], held + st["bytes_in_pages"]
        for k in tiers:
            tiers[k] += st["tokens_per_tier"][k]
    total = sum(tiers.values())
    res = compare(stats.ref_logprobs, torch.cat(got), ids[:, stats.context + 1:stats.context + 1 + stats.steps])
    res["compression_physical"] = fp16 / held
    res["tier_fractions"] = {k: v / total for k, v in tiers.items()}
    return res
