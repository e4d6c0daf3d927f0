"""The serving engine: continuous batching of a transformers model over a KV cache (``fp16`` or ``diffkv``,
:mod:`diffkv.engine.cache`).

Each :meth:`Engine.step`: take new requests and cancellations, plan the step (:mod:`diffkv.engine.planner`: one
frozen :class:`~diffkv.engine.step.Step`, every page it needs taken: the decodes' reservation, preemptions,
admissions, the next chunk of a long prompt), then run it: attach shared prefixes (:mod:`diffkv.engine.prefixes`),
prefill the requests admitted now together in one forward (:mod:`diffkv.engine.prefill`; their first token comes
from the prefill), run one forward for the running requests with ragged positions, the chunk's tokens packed in
front (:mod:`diffkv.engine.mixed`), sample, store a few layers of a completely staged prompt
(:mod:`diffkv.engine.chunks`); finished requests free their pages at once. Thread-safe entry points:
:meth:`add_request`, :meth:`Request.cancel`, :meth:`metrics`; everything else runs on the engine thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque

import torch

from diffkv.core.spans import word_edges
from diffkv.engine.cache import EngineCache
from diffkv.engine.chunks import CHUNKED_PREFILL, Chunker
from diffkv.engine.invariance import invariant_rows, rows_are_invariant
from diffkv.engine.mixed import MixedCache
from diffkv.engine.outputs import Outputs
from diffkv.engine.planner import Planner
from diffkv.engine.prefill import (
    DEFAULT_MAX_PREFILL_TOKENS,
    MIXED_PREFILL_TOKENS,
    PREFILL_MODES,
    PackedPrompts,
    Prefiller,
)
from diffkv.engine.prefixes import PrefixCache
from diffkv.engine.request import Request, RequestEvent, SamplingParams
from diffkv.engine.sampling import next_tokens
from diffkv.engine.scheduler import DEFAULT_RESERVE, Scheduler
from diffkv.engine.step import Counters, PromptWork, Step
from diffkv.hf.generation import eos_ids


class Engine:
    """model: a transformers causal LM (weights and modules used as they are); cache: where KV lives.
    max_prefill_tokens: most prompt tokens prefilled in one step (a longer prompt alone); prefill: "batched" (one
    forward for a step's admitted requests) or "single" (one forward each). batch_invariant: a request's tokens do
    not depend on the other requests of its steps (:mod:`diffkv.engine.invariance`: linear layers compute over padded
    rows, each prompt is scored and quantized alone); raises ValueError where the machine's GEMMs do not
    allow it. prefill_chunk: a prompt longer than this is prefilled over several steps, one chunk per step, while
    the running requests decode (:mod:`diffkv.engine.chunks`; full-attention models); None: whole.
    chunked_prefill: how the chunks are stored, "deferred" (default: staged at full precision, counted in the pool,
    stored as one prompt after the last chunk, so with the tiers of a whole prefill) or "extend" (appended to the
    pages as they come: bounded memory, slower chunks, more bytes). prefix_cache:
    requests that name a shared prefix (``add_request(..., prefix_tokens=P)``) read its pages, compressed once
    (:mod:`diffkv.engine.prefixes`; full-attention models). prefix_scores: what places a shared prefix's tokens,
    "context" (default: the config's context point, repeat scores, ``diffkv.core.points``) or "window" (the
    config as given: the prefix's own last queries). mixed_forward: the step's admitted prompts and staged chunk ride
    in its decode forward (default, :mod:`diffkv.engine.mixed`); False runs them in forwards of their own, as
    before issue #61 (for side-by-side measurements)."""

    def __init__(self, model, tokenizer, cache: EngineCache, *, watermark: float = 0.01,
                 max_running: int | None = None, reserve: tuple[float, float, float] | None = DEFAULT_RESERVE,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS, prefill: str = "batched",
                 batch_invariant: bool = False, prefill_chunk: int | None = None, chunked_prefill: str = "deferred",
                 prefix_cache: bool = False, prefix_scores: str = "context", mixed_forward: bool = True):
        if max_prefill_tokens < 1 or prefill not in PREFILL_MODES:
            raise ValueError(f"max_prefill_tokens must be >= 1 (got {max_prefill_tokens}) and prefill one of "
                             f"{PREFILL_MODES} (got {prefill!r})")
        if prefill_chunk is not None and (prefill_chunk < 1 or getattr(cache, "sliding", None)
                                          or not hasattr(cache, "store")):
            raise ValueError(f"prefill_chunk must be >= 1 (got {prefill_chunk}) on a paged cache of a model whose "
                             "layers are all full attention (sliding-window layers are prefilled whole)")
        if chunked_prefill not in CHUNKED_PREFILL or (chunked_prefill == "deferred" and prefill_chunk is not None
                                                      and cache.config.prompt_scores == "repeat"):
            raise ValueError(f"chunked_prefill must be one of {CHUNKED_PREFILL} (got {chunked_prefill!r}); "
                             "'deferred' scores with the prompt's own queries (not prompt_scores='repeat')")
        self.mixed_forward = mixed_forward
        self.model, self.tokenizer, self.cache = model.eval(), tokenizer, cache
        if batch_invariant and not rows_are_invariant(model):
            raise ValueError("batch_invariant: this machine's matrix products give a row different bits in a small "
                             "product than in a large one even when padded (another BLAS or a GPU); the mode "
                             "cannot hold here")
        self.batch_invariant = batch_invariant
        self.scheduler = Scheduler(cache, watermark=watermark, max_running=max_running, reserve=reserve)
        if prefix_cache and not hasattr(cache, "store"):
            raise ValueError("prefix_cache needs a paged cache (make_cache)")
        config = getattr(cache, "config", None)  # with score_spans the store pools scores over each prompt's words
        edges = word_edges(tokenizer) if config is not None and config.score_spans else None
        self.prefix = PrefixCache(cache, model, tokenizer, edges, prefix_scores) if prefix_cache else None
        if self.prefix is not None:
            self.scheduler.cached = self.prefix.cached_tokens
        self.device = next(model.parameters()).device
        self.counters = Counters()
        self.outputs = Outputs(tokenizer, eos_ids(model, tokenizer), cache, self.scheduler, self.counters, self._close)
        self.chunks = Chunker(model, cache, self.scheduler, self.outputs, self.counters, size=prefill_chunk,
                              mode=chunked_prefill, model_call=self._model_call, exact_rows=batch_invariant)
        self.prefiller = Prefiller(model, cache, self.scheduler, self.outputs, self.counters, self.chunks,
                                   mode=prefill, alone=batch_invariant, word_edges=edges, model_call=self._model_call)
        self.planner = Planner(self.scheduler, cache, self.chunks, self.outputs, self.counters,
                               self.prefiller.open_slot, self.prefix, max_prefill_tokens=max_prefill_tokens)
        self._inbox: deque[Request] = deque()
        self._wakeup = threading.Event()
        self.steps = self.peak_running = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps, for tokens/s
        self._metrics: dict = {}
        self._publish_metrics()

    # ---- thread-safe API ----
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, listener=None, *,
                    prefix_tokens: int | None = None) -> Request:
        """Queue a prompt (text, tokenized with the model's tokenizer, or token ids). prefix_tokens: its first
        tokens are a prefix other requests share (an engine with ``prefix_cache``; at least one token must follow).
        Raises ValueError for an empty prompt or one that cannot fit (``len + max_new_tokens > max_model_len``, or a
        pool too small), or a prefix it cannot take."""
        params = params or SamplingParams()
        ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        limit = self.cache.max_model_len
        if len(ids) + params.max_new_tokens > limit:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                             f"maximum context of {limit} tokens")
        self.scheduler.check_fits(len(ids) + params.max_new_tokens)
        if prefix_tokens is not None and (self.prefix is None or not 0 < prefix_tokens < len(ids)):
            raise ValueError(f"prefix_tokens={prefix_tokens}: needs Engine(prefix_cache=True) and 0 < prefix_tokens "
                             f"< the prompt's {len(ids)} tokens")
        req = Request(ids, params, listener, prefix_tokens=prefix_tokens)
        self._inbox.append(req)
        self._wakeup.set()
        return req

    def metrics(self) -> dict:
        return dict(self._metrics)

    # ---- engine thread ----
    def has_work(self) -> bool:
        return bool(self._inbox or self.scheduler.waiting or self.scheduler.running)

    def step(self) -> list[RequestEvent]:
        """One iteration (see the module docstring). Returns the events it produced."""
        self.steps += 1
        events: list[RequestEvent] = []
        while self._inbox:
            self.scheduler.waiting.append(self._inbox.popleft())
        for req in [*self.scheduler.waiting, *self.scheduler.running]:
            if req.cancel_requested:
                events.append(self.outputs.finish(req, "cancelled"))
        step = self.planner.plan(events, self._metrics.get("compression_physical_compressed"))
        events += self._run(step)
        self.peak_running = max(self.peak_running, len(self.scheduler.running))
        self.scheduler.end_step()
        self._publish_metrics(sum(len(e.token_ids) for e in events))
        return events

    def _run(self, step: Step) -> list[RequestEvent]:
        """Run a planned step: prefixes attached; the decode forward with the admitted prompts and the chunk's tokens
        packed in front (the prompts in a packed forward of their own where they may not ride along,
        :meth:`_mixes_prefills`; the chunk alone when nothing decodes or it is an ``"extend"`` chunk); the staged
        layers stored."""
        events: list[RequestEvent] = []
        if step.prefixed:
            self.prefix.attach_requests(list(step.prefixed), self.scheduler, self.chunks, self._close, self.device)
        packed = None
        if self._mixes_prefills(step):
            packed = self.prefiller.pack(list(step.prefills))
        else:
            events += self.prefiller.run(list(step.prefills))
        chunk = step.chunk
        if chunk is not None and (not step.decodes or chunk.stage is None or not self.mixed_forward):
            events += self.chunks.run_alone(chunk)
            chunk = None
        if step.decodes:
            start = time.perf_counter()
            events += self._decode(list(step.decodes), chunk, packed)
            self.counters.decode_seconds += time.perf_counter() - start
            self.counters.decode_steps += 1
            self.counters.decoded_rows += len(step.decodes)
        if step.store is not None:
            events += self.chunks.store(step.store)
        return events

    def run(self, max_steps: int | None = None) -> None:
        """Step until every queued request has finished (or ``max_steps``)."""
        n = 0
        while self.has_work() and (max_steps is None or n < max_steps):
            self.step()
            n += 1

    def serve_forever(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        """Step while there is work, sleep until woken otherwise, until ``stop`` is set."""
        while not stop.is_set():
            if self.has_work():
                self.step()
            else:
                self._wakeup.wait(idle_wait)
                self._wakeup.clear()

    def generate(self, prompts: list, params: SamplingParams | None = None) -> list[Request]:
        """Queue ``prompts`` together and run them to the end (offline batch use)."""
        reqs = [self.add_request(p, params) for p in prompts]
        self.run()
        return reqs

    # ---- steps ----
    def _mixes_prefills(self, step: Step) -> bool:
        """Whether the step's admitted prompts ride in its decode forward: with ``mixed_forward``, batched prefill,
        a full-attention model, something decoding and at most ``MIXED_PREFILL_TOKENS`` prompt tokens."""
        return bool(self.mixed_forward and step.decodes and step.prefills and self.prefiller.mode == "batched"
                    and not getattr(self.cache, "sliding", None) and hasattr(self.cache, "store")
                    and sum(r.num_tokens for r in step.prefills) <= MIXED_PREFILL_TOKENS)

    @torch.inference_mode()
    def _decode(self, batch: list[Request], chunk: PromptWork | None = None,
                packed: PackedPrompts | None = None) -> list[RequestEvent]:
        """One forward: a token for each request of ``batch`` (pages reserved), with ``packed``'s prompts and
        ``chunk``'s tokens in front of them (:mod:`diffkv.engine.mixed`) when given."""
        if chunk is not None and chunk.req in batch:
            raise ValueError(f"request {chunk.req.id} cannot both decode and feed a chunk in one step")
        positions = [r.num_tokens - 1 for r in batch]  # the last sampled token is not in the cache yet
        last = [r.output_ids[-1] for r in batch]
        heads = [] if packed is None else [(packed.cache, sum(packed.lengths), packed.ids, [0] * len(packed.ids))]
        if chunk is not None:
            heads.append((self.chunks.cache_for(chunk), len(chunk.ids), [chunk.ids], [chunk.pos]))
        dev = self.device
        try:
            step_cache = self.cache.decode_cache([r.slot for r in batch], positions)
            with self._model_call():
                if not heads:
                    out = self.model(input_ids=torch.tensor(last, device=dev)[:, None], use_cache=True,
                                     position_ids=torch.tensor(positions, device=dev)[:, None],
                                     past_key_values=step_cache)
                    logits = out.logits[:, -1]
                else:
                    ids = [t for *_, parts, _ in heads for x in parts for t in x] + last
                    pos = [p for *_, parts, starts in heads for x, s in zip(parts, starts, strict=True)
                           for p in range(s, s + len(x))] + positions
                    ends = torch.tensor([len(x) for *_, parts, _ in heads for x in parts], device=dev).cumsum(0) - 1
                    keep = torch.cat([ends, torch.arange(len(batch), device=dev) + len(ids) - len(batch)])
                    out = self.model(input_ids=torch.tensor([ids], device=dev), use_cache=True,
                                     position_ids=torch.tensor([pos], device=dev), logits_to_keep=keep,
                                     past_key_values=MixedCache(self.cache.router, step_cache,
                                                                [(c, n) for c, n, *_ in heads]))
                    logits = out.logits[0]  # [P (+ 1) + B, V]: each prompt's last token, the chunk's, each decode
            self.cache.end_step()  # the step's host sync, after the forward (a CUDA graph could hold the forward)
        except (ValueError, RuntimeError) as e:  # e.g. NaN keys: fail this step's requests, free their pages
            failed = [*batch, *([chunk.req] if chunk is not None else [])]
            events = [self.outputs.finish(r, "error", f"decode failed: {e}") for r in failed]
            return events + (self.prefiller.stored(packed, None) if packed is not None else [])
        events = [] if packed is None else self.prefiller.stored(packed, logits[:len(packed.reqs)])
        if chunk is not None:
            events += self.chunks.done(chunk, logits[-len(batch) - 1:-len(batch)])
        return events + self.outputs.append(batch, next_tokens(logits[-len(batch):].float(), batch))

    def _model_call(self):
        return invariant_rows(self.model) if self.batch_invariant else contextlib.nullcontext()

    def _close(self, req: Request) -> None:
        """Free what ``req`` holds: its prompt progress (staged pages) and its slot's pages."""
        self.chunks.forget(req)
        if req.slot is not None:
            self.cache.close_slot(req.slot)
            req.slot = None

    def _publish_metrics(self, new_tokens: int = 0) -> None:
        now = time.perf_counter()
        self._recent.append((now, new_tokens))
        while len(self._recent) > 1 and now - self._recent[0][0] > 10:
            self._recent.popleft()
        span = now - self._recent[0][0]
        running = self.scheduler.running
        stored = [r for r in running if r.slot is not None and not self.chunks.pending(r)]
        stats = self.cache.stats([r.slot for r in stored], [r.num_tokens - 1 for r in stored])
        self._metrics = {
            "cache": self.cache.name, "running": len(running), "waiting": len(self.scheduler.waiting)
            + len(self._inbox), "pages_total": stats["pages_total"], "pages_used": stats["pages_used"],
            "pages_free": stats["pages_total"] - stats["pages_used"],
            "pages_sliding": stats["pages_sliding"], "compression_physical": stats["compression_physical"],
            "compression_physical_compressed": stats["compression_physical_compressed"],
            "preemptions": self.counters.preemptions,
            "decode_reserve_ratio": round(self.scheduler.reserve_ratio, 4),
            "tokens_generated": self.counters.tokens_generated, "steps": self.steps, "peak_running": self.peak_running,
            "mean_decode_batch": self.counters.decoded_rows / max(self.counters.decode_steps, 1),
            "tokens_per_s": sum(n for _, n in list(self._recent)[1:]) / span if span > 0 else 0.0,
            **(self.prefix.metrics() if self.prefix is not None else {}),
        }
