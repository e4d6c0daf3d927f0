"""Requests of the serving engine: sampling parameters, state, generated tokens and text, and their events.

A request is created by :meth:`diffkv.engine.Engine.add_request` and lives in the engine thread; other threads
read it only through its listener events (``RequestEvent``) or after it finished.
"""

from __future__ import annotations

import enum
import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_NEW_TOKENS_LIMIT = 1 << 20
_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to generate. ``temperature == 0`` is greedy; otherwise sampling from softmax(logits / temperature)
    restricted to the top-p nucleus, reproducible with ``seed``. Generation ends at ``max_new_tokens``, at the
    end-of-sequence token (unless ``ignore_eos``) or when the text contains one of ``stop`` (cut before it)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ValueError(f"max_new_tokens must be an int in [1, {MAX_NEW_TOKENS_LIMIT}], "
                             f"got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and 0 <= self.temperature <= 100):
            raise ValueError(f"temperature must be a number in [0, 100] (0 = greedy), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not all(isinstance(s, str) and s for s in self.stop) or len(self.stop) > 16:
            raise ValueError(f"stop must be at most 16 non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestEvent:
    """What happened to a request in one engine step: new text (``delta``) and/or the end (``finish_reason``:
    "length", "stop", "cancelled" or "error"; ``error`` says why for the last)."""

    request: Request
    delta: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    """One generation request. ``prompt_ids``: the prompt's token ids; ``output_ids`` grow as tokens are made.

    listener: called from the engine thread with each :class:`RequestEvent` (keep it cheap and thread-safe).
    """

    prompt_ids: list[int]
    params: SamplingParams
    listener: Callable[[RequestEvent], None] | None = None
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    slot: int | None = None  # KV table slot while running
    preemptions: int = 0
    prefix_tokens: int | None = None  # its first prompt tokens are a prefix other requests share (prefix cache)
    generator: object | None = None  # torch.Generator of a seeded sampled request (made on first use)
    kv_tokens: int = 0  # tokens its KV cache holds (set when a step's new token is sampled)
    kv_stats: dict | None = None  # what its KV cache held when it finished (``stop`` / ``length``): slot_stats
    _emitted: int = 0  # characters of ``text`` already sent in events
    _cancel: threading.Event = field(default_factory=threading.Event)
    _done: threading.Event = field(default_factory=threading.Event)

    @property
    def num_tokens(self) -> int:
        """Tokens the KV cache must hold to continue: prompt + generated."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def cancel(self) -> None:
        """Ask the engine to stop this request (thread-safe); its pages are freed at the next step."""
        self._cancel.set()

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request finished (any reason). Returns False on timeout."""
        return self._done.wait(timeout)
