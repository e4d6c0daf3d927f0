"""FCFS continuous-batching scheduler: who is admitted, who is preempted.

Admission is first come, first served without skipping (a request that does not fit blocks the ones behind it,
so none starves): the head of the queue starts when a table slot is free, fewer than ``max_running`` requests run,
and the pool keeps ``watermark`` of its pages free after the request's expected prefill (one layer at its worst
case, the others at the compression the stored tokens currently achieve; ``backend.admission_pages``). If the
prefill needs more than expected, the engine puts the request back at the front and it is admitted at its worst
case next time. Decode growth is not reserved ahead: when a step's reservation does not fit, the newest running
request is preempted (its pages freed at once, its tokens recomputed by a later prefill) and it goes back to the
front of the queue.
"""

from __future__ import annotations

from collections import deque

from diffkv.engine.backend import KVBackend
from diffkv.engine.request import Request, Status


class Scheduler:
    def __init__(self, backend: KVBackend, *, watermark: float = 0.01, max_running: int | None = None):
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a fraction of the pool in [0, 1), got {watermark}")
        self.backend = backend
        self.watermark_pages = int(watermark * backend.num_pages)
        self.max_running = min(max_running or backend.max_slots, backend.max_slots)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first

    def check_fits(self, num_tokens: int) -> None:
        """Raise ValueError if a request of ``num_tokens`` could never be admitted, even into an empty pool."""
        need, room = self.backend.prefill_pages(num_tokens), self.backend.num_pages - self.watermark_pages
        if need > room:
            raise ValueError(f"a prefill of {num_tokens} tokens needs {need} KV pages but the pool has {room} "
                             "usable; shorten the prompt or raise the KV budget")

    def next_admission(self, compression: float | None = None) -> Request | None:
        """The request to prefill now (taken off the queue and marked running), or None.
        compression: physical compression of the tokens stored now (None: assume the worst case)."""
        if not self.waiting or len(self.running) >= self.max_running:
            return None
        req = self.waiting[0]
        need = self.backend.admission_pages(req.num_tokens, None if req.prefill_failed else compression)
        if self.backend.free_pages() - need < self.watermark_pages:
            return None
        self.waiting.popleft()
        req.status = Status.RUNNING
        self.running.append(req)
        return req

    def preempt_newest(self) -> Request:
        """Take the newest running request back to the front of the queue (the caller frees its pages)."""
        req = self.running.pop()
        req.status = Status.WAITING
        req.preemptions += 1
        self.waiting.appendleft(req)
        return req

    def requeue(self, req: Request) -> None:
        """Put a running request back at the front of the queue (its prefill did not fit)."""
        self.running.remove(req)
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def remove(self, req: Request) -> None:
        """Forget a finished or cancelled request."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
