"""What the engine's requests get back: sampled tokens appended, text decoded, stop strings and limits checked,
events sent to listeners, finished requests released (:class:`Outputs`, one per engine)."""

from __future__ import annotations

from collections.abc import Callable

from diffkv.engine.request import Request, RequestEvent, Status
from diffkv.engine.sampling import find_stop
from diffkv.engine.step import Counters


class Outputs:
    """tokenizer: decodes the output ids; eos: the end-of-sequence ids; cache: the engine's (``max_model_len``,
    ``slot_stats``); scheduler: forgets finished requests; close: frees a request's slot and prompt progress."""

    def __init__(self, tokenizer, eos: set[int], cache, scheduler, counters: Counters,
                 close: Callable[[Request], None]):
        self.tokenizer, self.eos, self.cache, self.scheduler, self.close = tokenizer, eos, cache, scheduler, close
        self.counters = counters

    def append(self, batch: list[Request], tokens: list[int]) -> list[RequestEvent]:
        """Token ``tokens[i]`` sampled for ``batch[i]`` (its KV cache holds every earlier token)."""
        events = []
        for req, tok in zip(batch, tokens, strict=True):
            self.counters.tokens_generated += 1
            req.kv_tokens = req.num_tokens  # the step stored every token but ``tok``
            if tok in self.eos and not req.params.ignore_eos:
                events.append(self.finish(req, "stop", token_ids=[tok]))
                continue
            req.output_ids.append(tok)
            before = len(req.text)
            req.text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
            cut = find_stop(req.text, req.params.stop, before)
            if cut is not None:
                req.text = req.text[:cut]
                events.append(self.finish(req, "stop", token_ids=[tok]))
            elif len(req.output_ids) >= req.params.max_new_tokens or req.num_tokens >= self.cache.max_model_len:
                events.append(self.finish(req, "length", token_ids=[tok]))
            else:
                events.append(self.event(req, [tok]))
        return events

    def event(self, req: Request, token_ids: list[int], reason: str | None = None) -> RequestEvent:
        end = len(req.text)
        if reason is None:  # hold back what a stop string or an incomplete UTF-8 character may still take back
            hold = max((len(s) - 1 for s in req.params.stop), default=0)
            end = max(0, end - max(hold, int(req.text.endswith("\ufffd"))))
        ev = RequestEvent(req, req.text[req._emitted:end], token_ids, reason, req.error)
        req._emitted = max(req._emitted, end)
        if req.listener is not None:
            req.listener(ev)
        return ev

    def finish(self, req: Request, reason: str, error: str | None = None, token_ids=()) -> RequestEvent:
        """End ``req``: free its pages now (a request that ended normally keeps what they held in ``kv_stats``),
        tell its listener."""
        self.scheduler.remove(req)
        if req.slot is not None and reason in ("stop", "length"):
            req.kv_stats = self.cache.slot_stats(req.slot, req.kv_tokens)
        self.close(req)
        req.status, req.finish_reason, req.error = Status.FINISHED, reason, error
        ev = self.event(req, list(token_ids), reason)
        req._done.set()
        return ev
