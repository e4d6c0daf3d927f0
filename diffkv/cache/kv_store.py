"""The DiffKV storage of one model, owned in one place: page pool, head tables, :class:`PagedKV`, the resolved
decode backend, the tokens each sequence has stored, and the per-step plan (the decode compressors of every layer,
built once per set of running sequences). The hosts (the transformers cache, the serving engine, the vLLM
plug-in) are thin adapters over it: they build no pool, tables or compressor themselves (docs/design.md §6).

Entry points: ``prefill`` stores prompts; ``extend(layer, slots, q, k, v)`` appends n >= 1 tokens to sequences that
hold tokens (decode is n = 1; chunked prefill and a conversation's next turn are n > 1: n decode steps, each token
placed by the decode rule); ``crop(slot, n)`` drops the newest n tokens. A host that plans its own steps (the
engine, the vLLM plug-in) may instead call ``reserve`` (the step's pages for every layer and head in one prefix-sum
pass), ``begin_step`` (every layer's compressor gets the step's positions; the step's ``DecodePlan``,
``diffkv.ops.decode_plan``, is built once for every layer) and ``decode(layer, ...)`` (no host sync and three
launches per layer on the Triton backend; the step's errors found on the device are raised after its last layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffkv.cache.compressor import LayerCompressor
from diffkv.cache.crop_log import CropLog
from diffkv.cache.paged_kv import PagedKV
from diffkv.cache.prefix import Shares, copy_due, freeze_scores, may_demote
from diffkv.cache.store_pages import StorePages
from diffkv.cache.undo import SCORED_CALL, record_step
from diffkv.core.config import DiffKVConfig
from diffkv.core.layout import PagePlan
from diffkv.memory import HeadSet, HeadTables, PagePool, release_slots, reserve
from diffkv.memory.arena import ALIGN, Arena, resolve_device
from diffkv.memory.sharing import release_shared
from diffkv.ops.decode_plan import DecodePlan, DecodeWorkspace, PlanBuffers, build_plan, storage_bytes
from diffkv.ops.decode_step import resolve_backend

MAX_PLANS = 4  # step plans kept at once


@dataclass(frozen=True)
class StepPlan:
    """The plan of a step, built once and read by every layer: the sequences' slots, their heads in every table
    layer (one set, for the one reserve pass), each table layer's compressor (its positions set per step) and the
    buffers their decode steps keep (per-layer error flags and outputs, ``diffkv.ops.decode_plan.PlanBuffers``)."""

    slots: tuple[int, ...]
    heads: HeadSet
    compressors: dict[int, LayerCompressor]
    buffers: PlanBuffers


class KVStore(StorePages):
    """Pages of ``num_layers`` attention layers of ``num_kv_heads`` heads for up to ``max_slots`` sequences of at
    most ``max_seq_len`` tokens.

    The pool is one of three kinds: laid over ``buffer`` (a host's own memory, e.g. vLLM's KV tensor); growing
    (``grow=True``: it starts with one page and grows up to ``budget_bytes`` of pages as the sequences need them);
    or fixed, with as many pages as fit in ``budget_bytes`` after the store's own tensors and ``other_bytes`` (what
    the host holds besides). attention_backend: "auto", "cpu", "torch" or "triton" (``resolve_backend``).
    layers: the table layers that hold pages (default all; a hybrid model's sliding-window layers are not).
    crop_depth: how many of each sequence's newest tokens :meth:`crop` may drop (0: no crop; the log it keeps is
    ``crop_depth * max_slots * num_kv_heads * 8`` bytes per layer, counted in :meth:`nbytes`).
    ``width_bucket`` (attribute, default 1): the decode plans' width bounds are rounded up to a multiple of it in
    tokens (``decode_plan.tier_bounds``), so that the steps of a set of sequences launch the same kernels with the
    same arguments for that many steps: what a captured CUDA graph needs (issue #59 item 3).
    """

    _explicit_end = False  # begin_step's: the host calls end_step (else the last layer's decode does)

    def __init__(self, config: DiffKVConfig, plan: PagePlan, *, num_layers: int, num_kv_heads: int, max_slots: int,
                 max_seq_len: int, device, budget_bytes: int | None = None, other_bytes: int = 0,
                 grow: bool = False, buffer: torch.Tensor | None = None, attention_backend: str = "auto",
                 layers: list[int] | None = None, crop_depth: int = 0):
        device = resolve_device(device) if buffer is None else buffer.device
        self.config, self.plan, self.num_kv_heads = config, plan, num_kv_heads
        self.layers = list(range(num_layers)) if layers is None else list(layers)  # table layers in use
        self.backend = resolve_backend(attention_backend, device)
        shape, arena = (config, plan, max_slots, num_layers, num_kv_heads, max_seq_len), None
        if buffer is not None:  # tables and key vectors in the buffer's tail, the pages in the rest
            arena, pages_view = self._carve(buffer, HeadTables.for_config(*shape, device="meta"), plan, config)
        tables = HeadTables.for_config(*shape, device=device, arena=arena)
        vectors = tables.num_items * plan.head_dim * 4 * config.key_vectors  # PagedKV's key centers / scales
        self.fixed_bytes = tables.nbytes() + vectors + PagePool.FIXED_BYTES
        max_pages = None
        if buffer is not None:
            pool = PagePool.over(pages_view, plan.page_bytes)
        elif grow:
            if budget_bytes is None or budget_bytes < plan.page_bytes:
                raise ValueError(f"a budget of {budget_bytes} bytes holds no {plan.page_bytes}-byte page")
            pool, max_pages = PagePool(plan.page_bytes, num_pages=1, device=device), budget_bytes // plan.page_bytes
        else:
            per_page = plan.page_bytes + PagePool.BYTES_PER_PAGE
            pages = ((budget_bytes or 0) - self.fixed_bytes - other_bytes) // per_page
            if pages < 1:
                raise ValueError(f"kv_budget_bytes={budget_bytes} holds no {plan.page_bytes}-byte page after the "
                                 f"{self.fixed_bytes + other_bytes} bytes of tables and bookkeeping for {max_slots} "
                                 "slots; raise the budget or lower max_slots / max_model_len")
            pool = PagePool(plan.page_bytes, num_pages=pages, device=device)
        self.kv = PagedKV(pool, tables, plan, config, max_pages=max_pages, arena=arena)
        self.seen: dict[int, int] = {}  # slot -> tokens its sequence has stored (prompt + decoded)
        self._plans: dict[tuple[int, ...], StepPlan] = {}  # by slots, kept while they stay (a few at most)
        self._extending: dict[tuple[int, ...], DecodePlan | None] = {}  # extends under way: decode plan, n > 1: None
        self._step: StepPlan | None = None  # the plan begin_step set: what decode(layer) runs
        self._decode: DecodePlan | None = None  # its decode plan, for this step
        self.workspace = DecodeWorkspace(tables.device)  # decode scratch shared by every decode call (step_bytes)
        self.width_bucket = 1  # decode plans' width bounds in multiples of it (class docstring)
        self.crop_log = CropLog(self.layers, max_slots, num_kv_heads, crop_depth, device) if crop_depth else None
        self.shares = Shares()  # slots reading a prefix another slot holds (diffkv.cache.prefix)
        self.words: dict[int, torch.Tensor] = {}  # slot -> its prompt's word starts [L] bool (score_spans)

    @staticmethod
    def _carve(buffer: torch.Tensor, tables: HeadTables, plan: PagePlan, config: DiffKVConfig):
        """Split a host's buffer: an arena at its end for the tables and key vectors (``tables``: a meta-device
        twin, for the sizes), the pages before it, as many as fit after the pool's own bookkeeping (which lives
        outside the buffer, so the buffer's unused head pays for it). Returns (arena, the pages' view)."""
        if not buffer.is_contiguous():
            raise ValueError("a store over a buffer needs a contiguous buffer")
        flat = buffer.view(-1).view(torch.uint8)
        vectors = [(PagedKV.key_vector_shape(tables, plan), torch.float32)] * config.key_vectors
        need = Arena.bytes_for(*tables.arena_tensors(), *vectors)
        start = max(flat.numel() - need, 0) // ALIGN * ALIGN  # the arena's first byte, aligned
        pages = (start - PagePool.FIXED_BYTES) // (plan.page_bytes + PagePool.BYTES_PER_PAGE)
        if pages < 1 or flat.numel() < need:
            raise ValueError(f"a buffer of {flat.numel()} bytes holds no {plan.page_bytes}-byte page after the {need} "
                             "bytes of tables and key vectors; grant more KV memory or lower max_slots / "
                             "max_model_len")
        return Arena(flat[start:]), flat[:pages * plan.page_bytes]

    # ---- sequences ----
    def open_slot(self) -> int:
        slot = self.kv.tables.acquire_slot()
        self.seen[slot] = 0
        return slot

    def release(self, slots: list[int]) -> None:
        """Give every page of ``slots`` back and retire them (a slot may hold no pages yet). A slot reading a shared
        prefix drops its references; a slot whose prefix others still read is refused (ValueError, nothing
        changed)."""
        slots = list(slots)
        busy = {s: r for s in slots if (r := [x for x in self.shares.readers(s) if x not in slots])}
        if busy:
            raise ValueError(f"release: slots {sorted(busy)} hold a prefix that slots {sorted(busy.values())} still "
                             "read; release the readers first")
        for s in slots:
            if s in self.shares.of:
                heads = self.kv.tables.select([s], layers=self.layers)
                release_shared(self.kv.pool, self.kv.tables, heads, self.shares.drop(s))
        if slots:
            release_slots(self.kv.pool, self.kv.tables, slots)
        for s in slots:
            self.seen.pop(s, None)
            self.words.pop(s, None)
            if self.crop_log is not None:
                self.crop_log.forget(s, -1)
        self._plans, self._step, self._decode, self._extending = {}, None, None, {}

    # ---- prefill ----
    def prefill_compressor(self, layer: int, slots: list[int], point: DiffKVConfig | None = None) -> LayerCompressor:
        """The compressor of one prefill of ``slots`` (batch row b = ``slots[b]``) at ``layer``; its ``prefill``
        stores the prompts (``prefill`` below does both and records the lengths). point: the operating point its
        tokens are placed by instead of the config (``LayerCompressor``; ``diffkv.core.points``)."""
        return LayerCompressor(self.kv, layer, list(slots), self.num_kv_heads, attention_backend=self.backend,
                               point=point)

    def set_word_starts(self, slot: int, starts: torch.Tensor) -> None:
        """The word starts of the prompt ``slot`` will prefill next (``DiffKVConfig.score_spans``): [L] bool from
        ``diffkv.core.spans.word_starts`` of its ids, L >= the tokens prefilled (a first chunk uses its part).
        Dropped once the last layer is prefilled (or the slot released)."""
        if starts.dim() != 1 or starts.dtype != torch.bool:
            raise ValueError(f"set_word_starts: starts must be a 1-D bool tensor, got {starts.dtype} of shape "
                             f"{tuple(starts.shape)}")
        self.words[slot] = starts

    def _word_starts(self, slots: list[int], valid: torch.Tensor) -> torch.Tensor | None:
        """[B, L] word starts of ``slots``' prompts, left-padded as ``valid``; None without ``score_spans``."""
        if not self.config.score_spans:
            return None
        rows = torch.ones(valid.shape, dtype=torch.bool)
        for b, (slot, n) in enumerate(zip(slots, valid.sum(1).tolist(), strict=True)):
            starts = self.words.get(slot)
            if starts is None or starts.numel() < n:
                raise ValueError(f"DiffKVConfig.score_spans: slot {slot} prefills {n} tokens but holds the word starts "
                                 f"of {None if starts is None else starts.numel()}; the host calls "
                                 "KVStore.set_word_starts(slot, diffkv.core.spans.word_starts(ids, edges)) first")
            rows[b, valid.shape[1] - n:] = starts[:n]
        return rows.to(valid.device)

    def prefill(self, layer: int, slots: list[int], query, keys, values, valid, scaling, repeat_scores=None,
                point: DiffKVConfig | None = None, fill_pages: bool = False):
        """Compress prompts into pages (``LayerCompressor.prefill``'s arguments; rows of ``slots``; point: the
        operating point they are placed by instead of the config; with ``score_spans`` the word starts of
        :meth:`set_word_starts`; fill_pages for a prefix frozen next, whose readers then share every page and copy
        none: ``diffkv.cache.prefix``). Returns the split it stored: the tier of every prompt token
        (``policy.PrefillSplit``)."""
        split = self.prefill_compressor(layer, slots, point).prefill(
            query, keys, values, valid, scaling, repeat_scores, self._word_starts(list(slots), valid), fill_pages)
        if self.crop_log is not None:
            self.crop_log.prefilled(layer, list(slots), valid.sum(1), split.n_high, split.n_low)
        if layer == self.layers[0]:  # the lengths are the same at every layer: one host read per prompt
            self._stored(slots, valid.sum(1).tolist())
        if layer == self.layers[-1]:  # the word starts are used once: not kept
            for s in slots:
                self.words.pop(s, None)
        return split

    def _stored(self, slots: list[int], lengths: list[int]) -> None:
        """Record that ``slots`` now hold ``lengths`` tokens (by :meth:`prefill`, the only writer of prompt
        lengths)."""
        self.seen.update(zip(slots, (int(n) for n in lengths), strict=True))

    # ---- decode: plan once per step, run per layer ----
    def reserve(self, slots: list[int]) -> None:
        """One prefix-sum pass taking this step's pages for every layer and head of ``slots`` (a growing pool grows
        first if short; otherwise :class:`~diffkv.memory.PoolExhausted`, nothing reserved)."""
        heads, positions = self._plan(slots).heads, [self.seen[s] for s in slots]
        copy_due(self, slots, positions)
        self.kv.with_room(reserve, self.kv.pool, self.kv.tables, heads, may_demote(self, heads, positions))

    def begin_step(self, slots: list[int], positions: list[int] | None = None,
                   explicit_end: bool = False) -> dict[int, LayerCompressor]:
        """Plan a decode step of ``slots`` (after :meth:`reserve`): every layer's compressor gets the index of each
        sequence's new token (``positions``, default: the tokens it has stored). Returns the compressors by table
        layer. explicit_end: the host calls :meth:`end_step` after its forward (the serving engine: the step's one
        host sync then lies outside the forward, which a CUDA graph can capture); otherwise the last layer's
        :meth:`decode` ends the step (a transformers cache sees no end of a forward)."""
        positions = [self.seen[s] for s in slots] if positions is None else [int(p) for p in positions]
        self._explicit_end = explicit_end
        self._step, self._decode = self._start(slots, positions)
        self.seen.update((s, p + 1) for s, p in zip(slots, positions, strict=True))
        return self._step.compressors

    def _start(self, slots: list[int], positions: list[int]) -> tuple[StepPlan, DecodePlan]:
        """The plan of ``slots`` with every layer's compressor at ``positions``, and the step's decode plan (one copy
        of the positions to the device, shared by every layer)."""
        plan = self._plan(slots)
        step = build_plan(self.kv, {i: c.items for i, c in plan.compressors.items()}, positions,
                          max(positions, default=0), self.num_kv_heads, backend=self.backend,
                          workspace=self.workspace, buffers=plan.buffers, bucket=self.width_bucket)
        for comp in plan.compressors.values():
            comp.begin_decode(step.seq_positions, step.longest, copy=False)
        return plan, step

    @property
    def step_plan(self) -> DecodePlan | None:
        """The decode plan of the step :meth:`begin_step` planned (None before)."""
        return self._decode

    def decode(self, layer: int, query, key, value, scaling) -> torch.Tensor:
        """One layer of the planned step (``LayerCompressor.decode`` with its pages reserved and the step's decode
        plan). Returns [B, H_q, D] fp32; on the Triton backend it is the step plan's buffer of this layer, rewritten
        by the layer's next step (use or copy it before). After the last layer, errors the device flagged in any
        layer of the step raise ValueError (``DecodePlan.finish``)."""
        if self._step is None:
            raise RuntimeError("KVStore.decode before begin_step: plan the step first")
        comp = self._step.compressors.get(layer)
        if comp is None:
            raise ValueError(f"KVStore.decode: layer {layer} holds no pages in this store (layers {self.layers})")
        out = comp.decode(query, key, value, scaling, reserved=True, plan=self._decode)
        if layer == self.layers[-1] and not self._explicit_end:
            self.end_step()
        return out

    def end_step(self) -> None:
        """End the step :meth:`begin_step` planned, after its last layer: the scores of the prefixes it read back
        to frozen, and the device's error flags read (the step's one host sync; ValueError naming the layers whose
        new token was not finite)."""
        if self._step is None:
            raise RuntimeError("KVStore.end_step before begin_step: plan the step first")
        self.refreeze(list(self._step.slots))
        self._decode.finish()

    def extend(self, layer: int, slots: list[int], query, key, value, scaling,
               each_layer: bool = False) -> torch.Tensor:
        """Append ``n >= 1`` new tokens to each sequence of ``slots`` at ``layer`` (every sequence holds tokens).

        query: [B, H_q, n, D]; key, value: [B, H_kv, n, D] post-RoPE (B = ``len(slots)``). Returns [B, H_q, n, D]
        fp32: token i attends over what the pages hold once tokens < i are stored, itself included; the result and
        the pages are those of n decode steps (each token placed by the decode rule, docs/algorithm.md §4.4).
        The call for the first table layer starts the step: it records the positions (and for one token reserves
        every layer's pages in one prefix-sum pass); the other layers must follow with the same ``slots`` and n.
        each_layer: every call reserves and plans its own layer's pages (the later layers have not stored their
        prompt yet: drafts sent with the prompt, ``DiffKVCache.set_prompt_length``); its tokens are drafts a crop
        may drop, so even one keeps its undo record.
        """
        n = key.shape[2]
        if n < 1 or query.shape[2] != n or value.shape[2] != n:
            raise ValueError(f"extend needs n >= 1 new tokens in query, key and value alike, got {query.shape[2]}, "
                             f"{key.shape[2]}, {value.shape[2]}")
        if layer == self.layers[0]:
            self._start_extend(slots, n, each_layer)
        elif tuple(slots) not in self._plans:
            raise RuntimeError(f"KVStore.extend at layer {layer} before layer {self.layers[0]} started the step")
        step = self._extending.get(tuple(slots))
        try:
            outs = self._extend_steps(layer, slots, step, query, key, value, scaling, n > 1 or each_layer)
        except BaseException:  # e.g. PoolExhausted mid-way: its steps' attention went into a read prefix's scores
            self.refreeze(slots)
            raise
        if layer == self.layers[-1]:
            self.refreeze(slots)
            self._extending.pop(tuple(slots), None)
            if step is not None:
                step.finish()
        return torch.stack(outs, 2)

    def _extend_steps(self, layer: int, slots: list[int], step: DecodePlan | None, query, key, value, scaling,
                      drafts: bool) -> list[torch.Tensor]:
        """:meth:`extend`'s decode steps at ``layer``, one per new token (``step``: the plan reserved for all layers
        of a one-token call, else each reserves its own pages); ``drafts``: keep undo records for a crop."""
        comp, n = self._plans[tuple(slots)].compressors[layer], key.shape[2]
        outs = []
        for i in range(n):
            if self.crop_log is not None:
                self.crop_log.record(layer, list(slots), comp.position, self.kv.tables.tokens_flat[comp.items])
                if drafts and i >= n - self.crop_log.depth:  # tokens a crop can reach: keep what each overwrites
                    self.crop_log.add_step(layer, record_step(self.kv, comp, n <= SCORED_CALL))
            demote = None if step is not None else may_demote(self, comp.heads, [self.seen[s] - n + i for s in slots])
            outs.append(comp.decode(query[:, :, i], key[:, :, i], value[:, :, i], scaling,
                                    reserved=step is not None, plan=step, may_demote=demote))
        return outs

    def _start_extend(self, slots: list[int], n: int, each_layer: bool = False) -> None:
        """First table layer of :meth:`extend`: record the positions, plan the step (for one token, reserve every
        layer's pages and plan the decode once)."""
        if read := [s for s in slots if self.shares.readers(s)]:
            raise ValueError(f"extend: slots {read} hold a prefix other slots read (frozen); extend the readers")
        starts = [self.seen[s] for s in slots]
        planned = n == 1 and not each_layer
        if planned:
            self.reserve(slots)
        else:
            copy_due(self, slots, [p + n - 1 for p in starts])
        if self.crop_log is not None:
            self.crop_log.positions(list(slots), starts, n, drafts=each_layer)
        _, step = self._start(slots, starts)  # its own plan: a host's planned decode step of other slots stays
        self._extending[tuple(slots)] = step if planned else None  # otherwise each call plans itself
        self.seen.update((s, p + n) for s, p in zip(slots, starts, strict=True))

    def refreeze(self, slots: list[int]) -> None:
        """Scores of the prefixes ``slots`` read back to frozen (``diffkv.cache.prefix``): after a step, whose
        attention added to them."""
        for source in {self.shares.of[s][0] for s in slots if s in self.shares.of}:
            freeze_scores(self, source)

    def crop(self, slots: int | list[int], n: int) -> None:
        """Drop the ``n`` newest tokens of each sequence of ``slots`` (assisted / speculative decoding: rejected
        drafts).

        Exact, or a ValueError with nothing changed: the tokens must be among the store's ``crop_depth`` newest,
        and either stored by one multi-token ``extend`` (its steps keep undo records, :mod:`diffkv.cache.undo`:
        what they pruned or demoted comes back) or by steps that only appended (:mod:`diffkv.cache.crop_log`; the
        prompt's protected window too). The scores of the remaining tokens keep the attention the dropped tokens'
        queries gave them. Pages stay with their heads and are filled again by the next tokens.
        """
        slots, n = [slots] if isinstance(slots, int) else list(slots), int(n)
        for slot in slots:
            if n < 0 or slot not in self.seen or n > self.seen[slot]:
                raise ValueError(f"crop: cannot drop {n} tokens of slot {slot} "
                                 f"({self.seen.get(slot, 'no sequence')} stored)")
        if n == 0 or not slots:
            return
        if self.crop_log is None:
            raise ValueError("crop: this store keeps no crop log; build it with crop_depth > 0")
        undo = [s for s in slots if self.crop_log.can_undo(s, self.seen[s], n)]
        counted = [s for s in slots if s not in undo]
        heads = {i: self.kv.tables.select(counted, layers=[i]).items for i in self.layers} if counted else {}
        now = {i: self.kv.tables.tokens_flat[items] for i, items in heads.items()}
        h = self.num_kv_heads
        for b, slot in enumerate(counted):
            self.crop_log.check(slot, self.seen[slot], n, {i: c[b * h:(b + 1) * h] for i, c in now.items()})
        for i, items in heads.items():  # steps that only appended: the n newest high slots go
            self.kv.tables.tokens_flat[items, 0] = now[i][:, 0] - n
        if undo:
            self.crop_log.undo(self.kv, {s: self.seen[s] - n for s in undo})
        for slot in slots:
            self.seen[slot] -= n
            self.crop_log.forget(slot, self.seen[slot])
        self._plans, self._step, self._decode, self._extending = {}, None, None, {}

    def compressor(self, layer: int, slots: list[int]) -> LayerCompressor:
        """The decode compressor of ``layer`` for ``slots`` (read-only use: its heads, backend)."""
        return self._plan(slots).compressors[layer]

    def _plan(self, slots: list[int]) -> StepPlan:
        """The plan of these slots, built once and kept while they stay (at most ``MAX_PLANS`` sets at once: a
        host's decode batch and the sequences it extends)."""
        key = tuple(slots)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:  # keep the planned decode step and the extends under way
                self._plans = {k: p for k, p in self._plans.items() if p is self._step or k in self._extending}
            comps = {i: LayerCompressor(self.kv, i, list(slots), self.num_kv_heads, attention_backend=self.backend,
                                        workspace=self.workspace) for i in self.layers}
            buffers = PlanBuffers(self.layers, self.kv.tables.device, keep_outputs=True)
            plan = self._plans[key] = StepPlan(key, self.kv.tables.select(list(slots), layers=self.layers), comps,
                                               buffers)
        return plan

    # ---- accounting ----
    def prompt_pages(self, num_tokens: int) -> int:
        """Most pages a prompt of ``num_tokens`` tokens takes over every table layer in use and head: every token in
        the tier with the fewest tokens per page, plus one page of the other tier per head (what ``allocate``'s
        worst case reserves; the exact split takes at most this)."""
        return self.kv.tables.worst_pages(int(num_tokens)) * len(self.layers) * self.num_kv_heads

    def step_pages(self) -> int:
        """Most pages one decode step adds to one sequence: a page per tier, head and table layer in use."""
        return (1 + int(self.kv.tables.two_tier)) * len(self.layers) * self.num_kv_heads

    def held(self, slots: list[int] | None = None) -> dict[str, int]:
        """What ``slots`` (default: every sequence) hold over the table layers in use and every head: tokens per
        tier (``tokens_high``, ``tokens_low``), ``pages`` and ``bytes_in_pages`` (their pages plus their key centers
        and scales)."""
        tables = self.kv.tables
        slots = sorted(self.seen) if slots is None else list(slots)
        index = torch.tensor(slots, dtype=torch.int64, device=tables.device)
        layers = torch.tensor(self.layers, dtype=torch.int64, device=tables.device)
        counts = tables.counts[:, index][:, :, layers].long().sum((1, 2, 3)).tolist()  # [4]: n_hi, n_lo, p_hi, p_lo
        vectors = len(slots) * len(self.layers) * self.num_kv_heads * self.plan.head_dim * 4 * self.config.key_vectors
        pages = counts[2] + counts[3]
        return {"tokens_high": counts[0], "tokens_low": counts[1], "pages": pages,
                "bytes_in_pages": pages * self.plan.page_bytes + vectors}

    def step_bytes(self) -> int:
        """Bytes of the step plans kept (head sets, each layer's positions, error flags and outputs), the decode
        plans under way (their positions) and the decode workspace: their storages, each once."""
        tensors = list(self.workspace.tensors())
        for p in self._plans.values():
            h = p.heads
            tensors += [h.items, h.slot_index, h.count_index, h.edge_cells, *p.buffers.tensors()]
            for c in p.compressors.values():
                tensors += c.tensors()
        for step in (self._decode, *self._extending.values()):
            tensors += [] if step is None else step.tensors()
        return storage_bytes(tensors)

    def nbytes(self) -> int:
        """Every byte the store holds: pool (pages, ring), tables, key vectors and the step plan."""
        return (self.kv.nbytes() + self.step_bytes() + self.shares.nbytes()
                + (0 if self.crop_log is None else self.crop_log.nbytes()))
