"""Shared prefixes compressed once inside vLLM, scheduler side (issue #45): which prefixes the workers hold, which
requests read them, and what to tell the workers each step. Imports nothing from vLLM, so CI tests it.

A client names a prefix through ``kv_transfer_params`` (``SamplingParams(extra_args={"kv_transfer_params": ...})``,
or the OpenAI server's ``kv_transfer_params`` field):

* ``{"diffkv_prime": n}`` on a *prime* request whose prompt is ``prefix + bridge + prefix`` (n: the prefix's
  tokens; :func:`prime_prompt` builds it) and ``max_tokens=1``. The workers compute it in one forward like any
  prompt, and store only the first copy, scored by the attention the second copy's queries give it (repeat
  scores: the prefix is scored without any question, so it is the same whoever reads it), frozen. The prime's own
  output is not used.
* ``{"diffkv_prefix": n}`` on a *reader* whose first n prompt tokens are that prefix. Once the prime has finished,
  the connector tells vLLM that those n tokens are computed (an external hit: vLLM skips their forward) and the
  workers give the reader the prefix's pages (shared; a partial one copied when the reader first writes there),
  then append the rest of its prompt with ``KVStore.extend``. A reader that arrives while its prefix is being
  primed waits; one whose prefix was never primed is computed whole, as without a prefix.

With ``LLM`` (``tok = llm.get_tokenizer()``; ``benchmarks/serve/prefix/vllm_run.py`` runs this)::

    prime, params = prime_prompt(prefix_ids, tok(BRIDGE, add_special_tokens=False).input_ids)
    llm.generate([{"prompt_token_ids": prime}], SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}))
    llm.generate([{"prompt_token_ids": prefix_ids + q} for q in questions],
                 SamplingParams(max_tokens=64, extra_args={"kv_transfer_params": reader_params(len(prefix_ids))}))

Prefixes are keyed by a hash of their token ids. At most ``max_prefixes`` are held: priming one more drops the
least recently read prefix no unfinished request reads (with none such, the prime is ignored, with a warning).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from diffkv.hf.repeat_scores import BRIDGE

PRIME, PREFIX = "diffkv_prime", "diffkv_prefix"  # the keys of kv_transfer_params

__all__ = ["BRIDGE", "PREFIX", "PRIME", "Prime", "PrefixMap", "prefix_key", "prime_prompt", "reader_params"]


def prefix_key(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def prime_prompt(prefix_ids: list[int], bridge_ids: list[int]) -> tuple[list[int], dict]:
    """The prime request of a prefix: (prompt ids ``prefix + bridge + prefix``, its ``kv_transfer_params``).
    bridge_ids: the tokenizer's ids of :data:`BRIDGE` (``add_special_tokens=False``). Send it with max_tokens=1."""
    return list(prefix_ids) + list(bridge_ids) + list(prefix_ids), {PRIME: len(prefix_ids)}


def reader_params(prefix_tokens: int) -> dict:
    """The ``kv_transfer_params`` of a request whose first ``prefix_tokens`` prompt tokens are a primed prefix."""
    return {PREFIX: prefix_tokens}


@dataclass(frozen=True)
class Prime:
    """What a worker needs to store a prime: the prefix's key and tokens n, where its second copy starts and the
    prime prompt's length (a prime split by chunked prefill cannot be scored)."""

    key: str
    tokens: int
    copy_start: int
    total: int


@dataclass
class Entry:
    tokens: int
    ready: bool = False  # its prime has finished: the workers hold it
    readers: set = field(default_factory=set)  # request ids that read it and have not finished


class PrefixMap:
    """The scheduler's view of the prefixes. ``max_step_tokens``: vLLM's ``max_num_batched_tokens`` (a prime must
    run in one step). ``refuse_primes``: why primes cannot be stored with this config (None: they can)."""

    def __init__(self, max_prefixes: int = 8, max_step_tokens: int | None = None, refuse_primes: str | None = None):
        self.max_prefixes, self.max_step_tokens, self.refuse_primes = max_prefixes, max_step_tokens, refuse_primes
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # least recently read first
        self.primes: dict[str, Prime] = {}  # request id -> its prime, until it finishes
        self.reading: dict[str, str] = {}  # request id -> key of the prefix it names
        self.attach: dict[int, str] = {}  # first block of a reader allocated this step -> key
        self.drops: list[str] = []
        self.hits = self.hit_tokens = 0

    def arrived(self, req_id: str, prompt: list[int], params: dict | None, max_tokens: int | None) -> str | None:
        """Record a new request's prefix role. Returns a warning to log when its params are ignored, else None."""
        params = params or {}
        if PRIME in params:
            return self._prime(req_id, prompt, params[PRIME], max_tokens)
        if PREFIX in params:
            n = params[PREFIX]
            if not isinstance(n, int) or not 0 < n < len(prompt):
                return f"{PREFIX}={n!r} ignored: it must be an int in [1, {len(prompt) - 1}] (the prompt's tokens - 1)"
            self.reading[req_id] = prefix_key(prompt[:n])
        return None

    def _prime(self, req_id: str, prompt: list[int], n, max_tokens: int | None) -> str | None:
        if self.refuse_primes:
            return f"{PRIME} ignored: {self.refuse_primes}"
        if not isinstance(n, int) or not 0 < n <= len(prompt) // 2 or prompt[:n] != prompt[len(prompt) - n:]:
            return (f"{PRIME}={n!r} ignored: the prompt must be prefix + bridge + prefix with n the prefix's tokens "
                    "(diffkv.integrations.vllm.prefix_map.prime_prompt)")
        if max_tokens != 1:
            return f"{PRIME} ignored: a prime request must have max_tokens=1 (got {max_tokens})"
        if self.max_step_tokens is not None and len(prompt) > self.max_step_tokens:
            return (f"{PRIME} ignored: the prime prompt has {len(prompt)} tokens, more than one step takes "
                    f"({self.max_step_tokens}); raise --max-num-batched-tokens")
        key = prefix_key(prompt[:n])
        if key in self.entries:
            return None  # held or being primed: computed as a plain request
        if not self._make_room():
            return (f"{PRIME} ignored: {self.max_prefixes} prefixes are held and every one is being primed or read "
                    "(raise DIFFKV_VLLM_PREFIXES or prime it again later)")
        self.entries[key] = Entry(n)
        self.primes[req_id] = Prime(key, n, len(prompt) - n, len(prompt))
        return None

    def _make_room(self) -> bool:
        """Room for one more prefix: drop the least recently read one no request reads if the map is full.
        Returns False when it is full of prefixes being primed or read."""
        if len(self.entries) < self.max_prefixes:
            return True
        for key, entry in self.entries.items():
            if entry.ready and not entry.readers:
                del self.entries[key]
                self.drops.append(key)
                return True
        return False

    def matched(self, req_id: str) -> int | None:
        """Prompt tokens the workers hold for this request: n for a reader of a held prefix, None while its prefix
        is being primed (it waits), 0 otherwise."""
        entry = self.entries.get(self.reading.get(req_id, ""))
        if entry is None:
            return 0
        return entry.tokens if entry.ready else None

    def allocated(self, req_id: str, first_block: int, external_tokens: int) -> None:
        """vLLM gave the request its blocks (first: ``first_block``) with ``external_tokens`` marked computed."""
        key = self.reading.get(req_id)
        if key in self.entries and external_tokens:
            self.entries[key].readers.add(req_id)
            self.entries.move_to_end(key)
            self.attach[first_block] = key
            self.hits += 1
            self.hit_tokens += external_tokens

    def prime_of(self, req_id: str) -> Prime | None:
        return self.primes.get(req_id)

    def finished(self, req_id: str, computed: bool) -> None:
        """The request finished (or was aborted); ``computed``: its prompt ran."""
        prime = self.primes.pop(req_id, None)
        if prime is not None and prime.key in self.entries:
            if computed:
                self.entries[prime.key].ready = True
            else:  # aborted before its forward: nothing held
                del self.entries[prime.key]
        key = self.reading.pop(req_id, None)
        if key in self.entries:
            self.entries[key].readers.discard(req_id)

    def take(self) -> tuple[dict[int, str], list[str]]:
        """This step's (readers to attach: first block -> key, prefixes to drop), cleared."""
        attach, drops = self.attach, self.drops
        self.attach, self.drops = {}, []
        return attach, drops
