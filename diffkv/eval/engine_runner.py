"""Evaluation through the serving engine: every sample is a greedy request of one continuous-batching engine.

The fixed-batch path (:func:`diffkv.eval.runner.generate_batch`) decodes left-padded batches until the longest
answer of each batch ends; here a finished answer frees its slot and its pages at once and the next sample starts
(:class:`~diffkv.engine.Engine`, up to ``max_batch`` running). The engine holds any method with a page layout
(``Method.storage``: ``full`` as one 16-bit tier in the model's dtype, every DiffKV and uniform method). Each sample's
row carries the stats of its own cache at the end (``Request.kv_stats``), so compression is aggregated per sample
rather than per batch; ``full`` reports the uncompressed cache's stats, as ``DynamicCache`` does on the fixed path.

The pool is sized for ``max_batch`` requests at their worst case (every token in the high tier), so the engine
never preempts: the numbers differ from the fixed path only by the arithmetic of other batch shapes. On CPU a decode
step is bound by the model's GEMMs, which grow more efficient with the batch (qwen2.5-0.5b fp32: 48 ms per row at
5 rows, 13 at 32, 9.5 at 100), so the default batch is large; ``max_batch`` is lowered to what
:data:`POOL_BYTES_LIMIT` holds at the worst case (long prompts) and to the number of samples.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from diffkv.eval.methods import STAT_KEYS, Method, full_cache_stats
from diffkv.eval.tasks import get_task

DEFAULT_MAX_BATCH = 64
WATERMARK = 0.01  # the engine's default: the fraction of pages admission leaves free
POOL_BYTES_LIMIT = 4 << 30  # the engine's KV pool at the worst case, every sample's tokens in the high tier
log = logging.getLogger("diffkv.eval")


def engine_for(model, tokenizer, method: Method, profile: str | None, max_batch: int, max_model_len: int):
    """An :class:`~diffkv.engine.Engine` on ``method``'s storage, its pool sized so that ``max_batch`` requests of
    ``max_model_len`` tokens fit at their worst case."""
    from diffkv.engine import Engine, PagedCache
    from diffkv.memory import PagePool

    if method.storage is None:
        raise ValueError(f"method {method.name!r} is not a paged cache: the engine cannot hold it (run it with "
                         "--runner generate)")
    if max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
    config = method.storage(model, profile)

    def paged(slots: int, budget: int) -> PagedCache:
        return PagedCache(model, config, kv_budget_bytes=budget, max_slots=slots, max_model_len=max_model_len,
                          name=method.name)

    probe = paged(1, 1 << 24)
    per_request = probe.prefill_pages(max_model_len) + probe.decode_pages([(max_model_len, 1)])
    page = probe.plan.page_bytes + PagePool.BYTES_PER_PAGE
    fits = max(1, POOL_BYTES_LIMIT // (per_request * page))
    if fits < max_batch:
        log.warning("max_batch %d lowered to %d: %d requests of %d tokens fit %d GiB at their worst case", max_batch,
                    fits, fits, max_model_len, POOL_BYTES_LIMIT >> 30)
        max_batch = fits
    # tables and bookkeeping grow with the slots: max_batch x a one-slot cache's is an upper bound; the pages are
    # the requests' worst case plus the scheduler's watermark, which admission leaves free
    need = max_batch * per_request
    cache = paged(max_batch, max_batch * probe.fixed_bytes + (need + need // 99 + 1) * page)
    return Engine(model, tokenizer, cache, max_running=max_batch, watermark=WATERMARK)


def engine_generate(model, tokenizer, method: Method, rc: dict, samples: list[dict], prompts: dict[str, list[int]],
                    max_batch: int = DEFAULT_MAX_BATCH, on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Greedy answers of ``samples`` (in this order of arrival) through one engine; a result row per sample, in the
    order they finish (also handed to ``on_row`` as each one finishes, for streaming to disk).

    rc: the run's resolved config (``max_new_tokens``, ``profile``, ``task``); prompts: token ids per sample id.
    """
    from diffkv.engine import SamplingParams

    if not samples:
        return []
    new = rc["max_new_tokens"]
    engine = engine_for(model, tokenizer, method, rc["profile"], min(max_batch, len(samples)),
                        max(len(prompts[s["id"]]) for s in samples) + new)
    task, exact = get_task(rc["task"]), method.name == "full"
    by_request = {engine.add_request(prompts[s["id"]], SamplingParams(max_new_tokens=min(new, s.get(
        "max_new_tokens") or new))).id: s for s in samples}  # a sample may ask for fewer tokens (ruler's families)
    rows, start = [], time.perf_counter()
    while engine.has_work():
        for ev in engine.step():
            if not ev.finished:
                continue
            req = ev.request
            if req.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"sample {by_request[req.id]['id']!r} ended with {req.finish_reason}: {req.error}")
            sample = by_request[req.id]
            stats = full_cache_stats(model, req.kv_tokens) if exact else req.kv_stats
            rows.append({"id": sample["id"], "reference": sample["reference"], "output": req.text,
                         "prompt_tokens": len(req.prompt_ids), "new_tokens": len(req.output_ids),
                         **task.score(sample, req.text), "batch": f"{time.time_ns()}-{sample['id']}",
                         "batch_stats": {k: stats.get(k) for k in STAT_KEYS}, "runner": "engine",
                         "finished_at_seconds": round(time.perf_counter() - start, 2)})
            if on_row is not None:
                on_row(rows[-1])
    return rows
