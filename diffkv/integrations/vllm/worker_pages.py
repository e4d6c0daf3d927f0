"""DiffKV's pages inside vLLM: one page pool for every layer and KV head of a worker, laid over the KV memory vLLM
granted, per-head page tables and key vectors (in the same memory: vLLM's KV budget counts them), and the requests'
slots. Imports nothing from vLLM.

A request is known by the id of its first vLLM block (``block_table[i, 0]``): no request reads vLLM's prefix cache
(it is off, or the DiffKV connector makes every request skip it), so a live request keeps that block and no other
live request holds it. Shared prefixes (:mod:`.worker_prefixes`): a prime request's prefix is stored into a slot of
its own, not keyed by a block; a reader's slot gets the prefix's pages before its first step
(:meth:`VllmKVStore.attach`), and that step appends the rest of its prompt.

A request ends (finished, aborted, preempted) when vLLM frees its blocks, which it does not tell an attention
backend; the store sees it when the block comes back:

* the block is the first block of a request that starts a prompt (a new request, or one resumed by recompute), or
* the block is in the block table of another request of the step.

Either way the ended request's slot and pages are released before the step runs. Until then an ended request keeps
its pages, unless the KV connector (:mod:`.connector`) reports it, which releases it at once
(:meth:`VllmKVStore.release`). Every request held, running or ended, has its own first block, so one slot per
vLLM block is enough.
"""

from __future__ import annotations

import torch

from diffkv.cache.kv_store import KVStore
from diffkv.cache.paged_kv import PagedKV
from diffkv.core.stats import tier_stats
from diffkv.integrations.vllm.settings import Settings
from diffkv.integrations.vllm.worker_prefixes import WorkerPrefixes

PREFILL, DECODE, EXTEND, PRIME = "prefill", "decode", "extend", "prime"
NEEDS = ("the DiffKV vLLM backend needs each request's tokens from its first on: start vLLM with the DiffKV KV "
         "connector (--kv-transfer-config, README), which keeps requests off vLLM's prefix cache, or with "
         "--no-enable-prefix-caching; without speculative decoding")


class ForwardPlan:
    """One forward's requests as DiffKV sees them: ``kinds[i]`` (prefill: a prompt or its first chunk; decode: one
    new token; extend: a later chunk of a prompt, chunked prefill, or a reader's prompt after its shared prefix;
    prime: a prefix's prime prompt, :mod:`.worker_prefixes`), ``slots[i]``, query rows ``starts[i]:starts[i +
    1]``, tokens ``lengths[i]`` (the prompt or chunk, or the tokens seen before the new ones)."""

    def __init__(self, kinds: list[str], slots: list[int], starts: list[int], lengths: list[int],
                 device: torch.device):
        self.kinds, self.slots, self.starts, self.lengths = kinds, slots, starts, lengths
        self.decode = [i for i, k in enumerate(kinds) if k == DECODE]
        # built once per step, read by every layer: the decode tokens' query rows [B]
        self.decode_rows = torch.tensor([starts[i] for i in self.decode], dtype=torch.int64, device=device)
        by_length: dict[int, list[int]] = {}  # extends of n tokens are appended together, one KVStore.extend each
        for i, kind in enumerate(kinds):
            if kind == EXTEND:
                by_length.setdefault(starts[i + 1] - starts[i], []).append(i)
        self.extends = [([slots[i] for i in group], torch.tensor([r for i in group for r in range(starts[i], starts[
            i + 1])], dtype=torch.int64, device=device), n) for n, group in by_length.items()]  # (slots, rows [B n], n)


class VllmKVStore:
    """DiffKV state of one worker: ``buffer`` is vLLM's KV memory (all layers), ``num_layers`` attention layers of
    ``num_kv_heads`` heads of ``head_size``; at most ``max_slots`` requests of ``max_model_len`` tokens."""

    def __init__(self, settings: Settings, buffer: torch.Tensor, num_layers: int, num_kv_heads: int, head_size: int,
                 max_slots: int, max_model_len: int, attention_backend: str = "auto"):
        self.settings, self.num_kv_heads, self.head_size = settings, num_kv_heads, head_size
        self.store = KVStore(settings.config, settings.plan, num_layers=num_layers, num_kv_heads=num_kv_heads,
                             max_slots=max_slots, max_seq_len=max_model_len, device=buffer.device, buffer=buffer,
                             attention_backend=attention_backend)
        self.backend = self.store.backend
        self.buffer_bytes = buffer.nbytes
        self.slot_of: dict[int, int] = {}  # first vLLM block id -> slot
        self.tokens_of: dict[int, int] = {}  # first vLLM block id -> tokens of the request after its last step
        self.prefixes = WorkerPrefixes(self.store)

    # ---- requests ----
    def plan_step(self, block_table: torch.Tensor, block_size: int, query_start_loc: list[int],
                  seq_lens: list[int]) -> ForwardPlan:
        """Release the requests that ended, open slots for the prompts of this step and reserve the decode pages of
        every layer and head in one prefix-sum pass. block_table: int [R, max_blocks] vLLM block ids of blocks of
        ``block_size`` tokens."""
        n = len(seq_lens)
        rows = block_table[:n].tolist()
        kinds, firsts = [], []
        self.prefixes.finish()
        for i in range(n):
            queries, total = query_start_loc[i + 1] - query_start_loc[i], seq_lens[i]
            first = rows[i][0]
            if queries == total:
                kinds.append(PRIME if first in self.prefixes.expected else PREFILL)
            elif queries == 1 and first in self.slot_of:
                kinds.append(DECODE)
            elif first in self.slot_of and self.tokens_of.get(first) == total - queries:  # a later chunk
                kinds.append(EXTEND)
            else:
                raise RuntimeError(f"{NEEDS} (a request arrived with {queries} new of {total} tokens)")
            firsts.append(first)
        owner = {b: row[0] for row, length in zip(rows, seq_lens, strict=True) for b in row[:-(-length // block_size)]}
        ended = [f for f in self.slot_of if owner.get(f, f) != f]  # f's block now serves another request
        ended += [f for i, f in enumerate(firsts) if kinds[i] in (PREFILL, PRIME) and f in self.slot_of]
        self.release(ended)
        slots = []
        for i, f in enumerate(firsts):
            if kinds[i] == PRIME:  # its prefix's own slot, held under the prefix's key (not the request's)
                slots.append(self.prefixes.open(f, seq_lens[i]))
                continue
            if kinds[i] == PREFILL:
                if len(self.slot_of) == self.store.max_slots:
                    raise RuntimeError(f"DiffKV holds {len(self.slot_of)} requests, as many as it has slots: with the "
                                       "DiffKV KV connector it keeps 2 x --max-num-seqs; check that the connector "
                                       "reports ended requests")
                self.slot_of[f] = self.store.open_slot()
            slots.append(self.slot_of[f])
        self.tokens_of.update((f, t) for f, t, k in zip(firsts, seq_lens, kinds, strict=True) if k != PRIME)
        lengths = [seq_lens[i] if kinds[i] == PREFILL else seq_lens[i] - (query_start_loc[i + 1] - query_start_loc[i])
                   for i in range(n)]
        plan = ForwardPlan(kinds, slots, list(query_start_loc[:n + 1]), lengths, self.store.device)
        if plan.decode:  # the step's pages and positions, once for every layer
            decode_slots = [slots[i] for i in plan.decode]
            self.store.reserve(decode_slots)
            self.store.begin_step(decode_slots, [lengths[i] for i in plan.decode])
        return plan

    @property
    def kv(self) -> PagedKV:
        """The pages and tables (the store's)."""
        return self.store.kv

    def release(self, firsts) -> None:
        """Give back every page of the requests whose first blocks are ``firsts`` and free their slots."""
        self.prefixes.forget(firsts)
        slots = [self.slot_of.pop(f) for f in dict.fromkeys(firsts) if f in self.slot_of]
        for f in firsts:
            self.tokens_of.pop(f, None)
        if slots:
            self.store.release(slots)

    def attach(self, first: int, key: str) -> None:
        """The request whose first block is ``first`` starts with the held prefix ``key`` (vLLM counts those tokens
        computed): open its slot with the prefix's pages; its first step appends the rest of its prompt."""
        self.release([first])
        slot = self.store.open_slot()
        try:
            tokens = self.prefixes.attach(slot, key)
        except BaseException:
            self.store.release([slot])
            raise
        self.slot_of[first], self.tokens_of[first] = slot, tokens

    def update_prefixes(self, primes: dict, attach: dict[int, str], drops: list[str]) -> None:
        """The connector's word for this step (:mod:`.prefix_map`): drop prefixes, expect primes (first block ->
        ``Prime``), attach readers (first block -> prefix key)."""
        self.prefixes.drop(drops)
        self.prefixes.expect(primes)
        for first, key in attach.items():
            self.attach(first, key)

    # ---- one layer of a step ----
    def attend(self, layer: int, plan: ForwardPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float, output: torch.Tensor) -> None:
        """query [tokens, H_q, D], key/value [tokens, H_kv, D] of this step -> output [tokens, H_q, D]: prompts run
        causal attention over themselves and are compressed into pages; decode tokens run DiffKV's decode step over
        their request's pages (all decode requests in one batch)."""
        for i, kind in enumerate(plan.kinds):
            if kind not in (PREFILL, PRIME):
                continue
            s, e = plan.starts[i], plan.starts[i + 1]
            q, k, v = (x[s:e].transpose(0, 1)[None] for x in (query, key, value))  # [1, H, L, D]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                   enable_gqa=True)
            output[s:e] = out[0].transpose(0, 1).to(output.dtype).view_as(output[s:e])
            if kind == PRIME:
                self.prefixes.store_prime(layer, plan.slots[i], q, k, v, scale)
                continue
            self.store.prefill(layer, [plan.slots[i]], q, k, v, torch.ones(1, e - s, dtype=torch.bool,
                                                                           device=key.device), scale)
        if plan.decode:
            rows = plan.decode_rows
            q, k, v = (x.index_select(0, rows) for x in (query, key, value))
            out = self.store.decode(layer, q, k, v, scale)  # [B, H_q, D] fp32, the step planned in plan_step
            output.index_copy_(0, rows, out.to(output.dtype))
        for slots, rows, n in plan.extends:  # later chunks of prompts, readers' prompts: KVStore.extend
            q, k, v = (x.index_select(0, rows).view(len(slots), n, *x.shape[1:]).transpose(1, 2)
                       for x in (query, key, value))  # [B, H, n, D]
            out = self.store.extend(layer, slots, q, k, v, scale)  # [B, H_q, n, D]
            output.index_copy_(0, rows, out.transpose(1, 2).reshape(len(rows), *output.shape[1:]).to(output.dtype))

    # ---- accounting ----
    def prompt_pages(self) -> tuple[float, int]:
        """(a, b): a prompt of n tokens takes at most ``ceil(a * n) + b`` pages (every token in the high tier, a
        partial page per head and tier); b is also the most pages one decode step adds to a request."""
        heads = len(self.store.layers) * self.store.num_kv_heads
        return heads / min(self.store.tokens_per_page), self.store.step_pages()

    def free_pages(self) -> int:
        return self.store.free_pages()

    def pages_per_token(self, free: int) -> float:
        """Observed pages held per token of the requests holding them (0.0 when none are held)."""
        tokens = sum(self.tokens_of.values())
        return (self.store.num_pages - free) / tokens if tokens else 0.0

    def stats(self) -> dict:
        """Requests held, pages and free pages, tokens held per tier (over every layer and head), and bytes: the
        pages, the tables and the key vectors (all inside vLLM's buffer, ``buffer_bytes``); with the fields every
        host reports (``diffkv.core.stats.tier_stats``) over the tokens of the requests and the prefixes held: cells
        pruned, ``fp16_bytes`` and the physical compression (``fp16_bytes`` / ``bytes_in_pages``)."""
        store = self.store
        free = self.free_pages()
        held = store.held(list(self.slot_of.values()) + self.prefixes.held_slots())
        high, low = held["tokens_high"], held["tokens_low"]
        seen = sum(self.tokens_of.values()) + sum(self.prefixes.tokens[k] for k in self.prefixes.slots)
        cells = seen * len(store.layers) * store.num_kv_heads
        fp16 = cells * 4 * store.plan.head_dim
        return {"requests": len(self.slot_of), "prefixes": len(self.prefixes.held_slots()), "pages": store.num_pages,
                "free_pages": free,
                "tokens_high": high, "tokens_low": low,
                **tier_stats(store.config, cells, high, low, fp16, held["bytes_in_pages"]),
                "bytes_in_pages": held["bytes_in_pages"],
                "page_bytes": store.page_bytes, "pool_bytes": store.num_pages * store.page_bytes,
                "table_bytes": store.table_bytes(), "key_vector_bytes": store.key_vector_bytes(),
                "buffer_bytes": self.buffer_bytes}
