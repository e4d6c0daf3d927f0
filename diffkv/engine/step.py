"""What one engine step does, decided before any forward runs (issue #61): the :class:`Step` the planner
(:mod:`diffkv.engine.planner`) builds and the engine runs, the prompt work of a step (:class:`PromptWork`) and what
a request's prompt still owes between steps (:class:`PromptProgress`, kept by :class:`~diffkv.engine.chunks.Chunker`,
not by the request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffkv.cache.staging import PromptStage
from diffkv.engine.request import Request


@dataclass
class PromptProgress:
    """A prompt prefilled over several steps: ``pending`` its token ids still to feed; ``stage`` its staged chunks
    (``chunked_prefill="deferred"``) and ``stage_pages`` the int64 [n] pool pages that count their bytes;
    ``held_token`` its first token while the staged prompt is being stored."""

    pending: list[int] = field(default_factory=list)
    stage: PromptStage | None = None
    stage_pages: object | None = None
    held_token: int | None = None


@dataclass(frozen=True)
class PromptWork:
    """Prompt tokens a step feeds for ``req``: ``ids`` at positions ``pos ..``, the next of its ``pending`` ones;
    ``stage``: the request's staged prompt (None: appended to its pages by ``KVStore.extend``)."""

    req: Request
    ids: list[int]
    pos: int
    stage: PromptStage | None
    pending: list[int]

    def __post_init__(self):
        if not self.ids or self.ids != self.pending[:len(self.ids)]:
            raise ValueError(f"a chunk must be the next {len(self.ids)} pending tokens of its request "
                             f"({len(self.pending)} pending)")
        if self.pos < 0 or self.pos + len(self.ids) > len(self.req.prompt_ids) + len(self.req.output_ids):
            raise ValueError(f"chunk positions {self.pos}..{self.pos + len(self.ids) - 1} run past the prompt")

    @property
    def last(self) -> bool:
        """Whether this is the prompt's last chunk (its logits give the first token)."""
        return len(self.ids) == len(self.pending)


@dataclass(frozen=True)
class Step:
    """One engine step, in the order the engine runs it: ``prefixed`` (admitted now, naming a shared prefix: the
    prefix attached, the rest of the prompt pending), then one forward of ``prefills`` (admitted now, each whole or
    its first chunk), ``chunk`` and ``decodes`` (one token per decoding request, pages reserved) packed in that
    order (the prefills or the chunk in a forward of their own where they may not ride along), then ``store`` (a
    staged prompt whose layers are stored after the forward, a few per step). ``staged``: admitted now, prompts fed
    in chunks from the next step on (or from this step's chunk); ``preempted``: sent back to the queue by the
    decodes' reservation. A request has one role per step; raises ValueError otherwise."""

    decodes: tuple[Request, ...] = ()
    chunk: PromptWork | None = None
    prefills: tuple[Request, ...] = ()
    prefixed: tuple[Request, ...] = ()
    staged: tuple[Request, ...] = ()
    store: Request | None = None
    preempted: tuple[Request, ...] = ()

    def __post_init__(self):
        roles = [*self.decodes, *self.prefills, *self.prefixed, *self.staged, *self.preempted,
                 *([self.chunk.req] if self.chunk is not None else [])]
        twice = {r.id for r in roles if sum(x is r for x in roles) > 1}
        if twice:
            raise ValueError(f"request(s) {sorted(twice)} given two roles in one step (e.g. both decode and feed a "
                             "chunk)")
        if self.store is not None and self.store in roles and (self.chunk is None or self.store is not self.chunk.req):
            raise ValueError(f"request {self.store.id} cannot be stored and run in one step (only after its last "
                             "chunk)")



@dataclass
class Counters:
    """Where an engine's work and time went (its ``metrics()`` and the benchmarks read them)."""

    prefill_seconds: float = 0.0  # model calls included
    decode_seconds: float = 0.0
    prefilled_tokens: int = 0
    recomputed_tokens: int = 0  # generated tokens prefilled again (after a preemption)
    prefill_forwards: int = 0  # forwards of their own (not counting prefills in a decode forward)
    mixed_prefills: int = 0  # steps whose admitted prompts rode in the decode forward
    prefill_fallbacks: int = 0  # batches prefilled again one at a time
    prefill_chunks: int = 0  # forwards of a long prompt's later chunks
    decode_steps: int = 0
    decoded_rows: int = 0  # for the mean decode batch size
    tokens_generated: int = 0
    preemptions: int = 0
