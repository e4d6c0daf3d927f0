"""FCFS continuous-batching scheduler: who is admitted, who is preempted.

Admission is first come, first served without skipping (a request that does not fit blocks the ones behind it,
so none starves): the head of the queue starts when a table slot is free, fewer than ``max_running`` requests run,
and the pool keeps ``watermark`` of its pages free after the request's expected prefill (one layer at its worst
case, the others at the compression the stored tokens currently achieve; ``cache.admission_pages``) and those
of the requests admitted before it in the same step (:meth:`Scheduler.admit`: the engine prefills them together,
within a token budget). If the prefill needs more than expected, the engine puts the request back at the front
and it is admitted at its worst case next time.

Decode growth is reserved ahead in part, adaptively (the ``new_token_ratio`` idea of SGLang's scheduler): admission
also keeps room for ``reserve_ratio`` of the tokens every running request (and the new one) may still generate, at
the high tier's size (``cache.decode_pages``: decoded tokens enter the high tier, so prefill compression does not
carry over to them); a hybrid model's sliding-window layers count only what each request's window can still grow
(nothing but the boundary block once it is full: a block leaves as one enters). The ratio starts at ``reserve[0]``,
falls by ``reserve[2]`` per step to ``reserve[1]`` (requests often stop early), and jumps to 1 at a preemption,
which shows the pool was over-committed; without it a preempted request is readmitted as soon as its own pages are
free and preempted again (thrashing). ``reserve=None`` reserves nothing ahead. When a step's reservation does not
fit anyway, the newest running request is preempted (its pages freed at once, its tokens recomputed by a later
prefill) and it goes back to the front of the queue.
"""

from __future__ import annotations

from collections import deque

from diffkv.engine.cache import EngineCache
from diffkv.engine.request import Request, Status

DEFAULT_RESERVE = (0.7, 0.1, 0.001)  # decode reserve ratio: start, floor, decay per step (SGLang's defaults)


class Scheduler:
    def __init__(self, cache: EngineCache, *, watermark: float = 0.01, max_running: int | None = None,
                 reserve: tuple[float, float, float] | None = DEFAULT_RESERVE):
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a fraction of the pool in [0, 1), got {watermark}")
        if reserve is not None and not (0 <= reserve[1] <= reserve[0] <= 1 and reserve[2] >= 0):
            raise ValueError(f"reserve must be (start, floor, decay per step) with 0 <= floor <= start <= 1 and "
                             f"decay >= 0, got {reserve}")
        self.reserve = reserve
        self.reserve_ratio = reserve[0] if reserve else 0.0
        self.cache = cache
        self.watermark_pages = int(watermark * cache.num_pages)
        self.max_running = min(max_running or cache.max_slots, cache.max_slots)
        self.cached = None  # request -> prompt tokens a prefix cache holds for it (the engine sets it)
        self.worst_case: set[Request] = set()  # their prefill once needed more pages than expected
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first

    def check_fits(self, num_tokens: int) -> None:
        """Raise ValueError if a request of ``num_tokens`` could never be admitted, even into an empty pool."""
        need, room = self.cache.prefill_pages(num_tokens), self.cache.num_pages - self.watermark_pages
        if need > room:
            raise ValueError(f"a prefill of {num_tokens} tokens needs {need} KV pages but the pool has {room} "
                             "usable; shorten the prompt or raise the KV budget")

    def admit(self, compression: float | None = None, max_tokens: int | None = None) -> list[Request]:
        """The requests to prefill together now, in queue order (taken off the queue and marked running): while
        the head of the queue fits (:meth:`next_admission`, counting the pages the ones before it will take) and
        their tokens stay within ``max_tokens`` (the first one is admitted whatever its length)."""
        batch: list[Request] = []
        committed = tokens = 0
        while self.waiting and (not batch or max_tokens is None or tokens + self.waiting[0].num_tokens <= max_tokens):
            req = self.next_admission(compression, committed)
            if req is None:
                break
            batch.append(req)
            committed += self._prefill_need(req, compression)
            tokens += req.num_tokens
        return batch

    def next_admission(self, compression: float | None = None, committed: int = 0) -> Request | None:
        """The request to prefill now (taken off the queue and marked running), or None.
        compression: physical compression of the tokens stored now (None: assume the worst case); committed: pages
        that requests admitted before it in this step will take (not yet allocated)."""
        if not self.waiting or len(self.running) >= self.max_running:
            return None
        req = self.waiting[0]
        need = self._prefill_need(req, compression)
        if self.reserve_ratio > 0 and self.running:  # alone, a request that fits is always admitted (progress)
            ahead = [(self._tokens_held(r), self._tokens_ahead(r)) for r in (*self.running, req)]
            need += self.cache.decode_pages(ahead, self.reserve_ratio)
        if self.cache.free_pages() - committed - need < self.watermark_pages:
            return None
        self.waiting.popleft()
        req.status = Status.RUNNING
        self.running.append(req)
        return req

    def _prefill_need(self, req: Request, compression: float | None) -> int:
        """Pages to expect for the prefill of ``req``; a held shared prefix counts only its partial pages, which
        the request copies (at most one per tier, layer and head: one decode step's worth)."""
        cached = self.cached(req) if self.cached is not None else 0
        pages = self.cache.admission_pages(req.num_tokens - cached, None if req in self.worst_case else compression)
        return pages + (self.cache.store.step_pages() if cached else 0)

    @staticmethod
    def _tokens_held(req: Request) -> int:
        """Tokens ``req`` holds in the KV cache (the last sampled one is written by the next decode step), or, not
        yet prefilled (no slot), the tokens its prefill was counted for."""
        return req.num_tokens - 1 if req.slot is not None else req.num_tokens

    def _tokens_ahead(self, req: Request) -> int:
        """Most tokens ``req`` may still generate."""
        return max(0, min(req.params.max_new_tokens - len(req.output_ids), self.cache.max_model_len - req.num_tokens))

    def end_step(self) -> None:
        """Let the decode reserve decay by one step."""
        if self.reserve:
            self.reserve_ratio = max(self.reserve[1], self.reserve_ratio - self.reserve[2])

    def preempt_newest(self) -> Request:
        """Take the newest running request back to the front of the queue (the caller frees its pages)."""
        if self.reserve:
            self.reserve_ratio = 1.0
        req = self.running.pop()
        req.status = Status.WAITING
        req.preemptions += 1
        self.waiting.appendleft(req)
        return req

    def requeue(self, reqs: list[Request], worst_case: Request | None = None) -> None:
        """Put running requests back at the front of the queue, in this order (their prefill did not fit);
        ``worst_case``: the one whose pages ran out, admitted at its worst case from now on."""
        if worst_case is not None:
            self.worst_case.add(worst_case)
        for req in reversed(reqs):
            self.running.remove(req)
            req.status = Status.WAITING
            self.waiting.appendleft(req)

    def remove(self, req: Request) -> None:
        """Forget a finished or cancelled request."""
        self.worst_case.discard(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
