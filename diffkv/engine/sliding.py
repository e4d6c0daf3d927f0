"""Sliding-window layers of a hybrid model (Gemma-3) in the engine: each keeps only its window, uncompressed, in
pages of the engine's one page pool.

A query at position p of a sliding layer attends to positions ``p - window + 1 .. p`` (transformers' convention,
the query included), so a slot keeps its last ``window - 1`` tokens between steps. Token t of a slot lives in block
``t // tokens_per_page``, row ``t % tokens_per_page``; a block is one pool page per (sliding layer, KV head), its
bytes viewed as K and V at ``dtype``: [2, tokens_per_page, head_dim]. A slot's live blocks sit in a ring of
``max_blocks`` entries (``pages``: int32 [max_slots, max_blocks, L_s, H_kv], -1 when unused): before each decode
step the blocks wholly outside the window go back to the pool and at most one block is added (:meth:`reserve`).
Block bookkeeping (live block range, tokens written) is on the host; page ids and bytes on the pool's device.
"""

from __future__ import annotations

import torch

from diffkv.memory import PagePool


class SlidingWindowStore:
    """The sliding layers ``layers`` (model layer indices) of up to ``max_slots`` requests in pages of
    ``page_bytes``; ``pool`` is set once the engine's pool exists (its size depends on :meth:`nbytes`)."""

    def __init__(self, page_bytes: int, layers: list[int], num_kv_heads: int, head_dim: int, window: int,
                 dtype: torch.dtype, max_slots: int, device):
        size = torch.empty(0, dtype=dtype).element_size()
        self.tokens_per_page = page_bytes // (2 * head_dim * size)
        if self.tokens_per_page < 1 or page_bytes % size:
            raise ValueError(f"a {page_bytes}-byte page cannot hold one {dtype} token of K and V at head_dim "
                             f"{head_dim} for the sliding-window layers; use a 16-bit raw_dtype")
        if window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {window}")
        self.layers, self.window, self.dtype = list(layers), window, dtype
        self.page_elements = page_bytes // size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        n = self.tokens_per_page
        self.max_blocks = (window + n - 2) // n + 1  # blocks that ``window`` consecutive positions can touch
        self.pages = torch.full((max_slots, self.max_blocks, len(self.layers), num_kv_heads), -1, dtype=torch.int32,
                                device=device)
        self.first, self.end, self.length = [0] * max_slots, [0] * max_slots, [0] * max_slots  # blocks, tokens
        self.held = 0  # pool pages owned now
        self.pool: PagePool | None = None

    @property
    def pages_per_block(self) -> int:
        return len(self.layers) * self.num_kv_heads

    def nbytes(self) -> int:
        """Bytes of the block table (the pages themselves are the pool's)."""
        return self.pages.nbytes

    def max_pages(self, num_tokens: int) -> int:
        """Most pages a request of ``num_tokens`` tokens holds at once (prefill or any decode step)."""
        return self.pages_per_block * min(-(-num_tokens // self.tokens_per_page), self.max_blocks)

    def growth_pages(self, num_tokens: int, ahead: int) -> int:
        """Most pages a request holding ``num_tokens`` tokens (or counted at :meth:`max_pages` for its prefill) adds
        while ``ahead`` more tokens are written: its window grows by min(ahead, window - fill) tokens, and once it
        is full a block leaves as one enters, so at most the one boundary block more (a full window holds
        ``max_blocks`` or one fewer; it holds at least the blocks of its last ``min(num_tokens, window - 1)``)."""
        if ahead <= 0:
            return 0
        least = -(-min(num_tokens, self.window - 1) // self.tokens_per_page) * self.pages_per_block
        return max(0, self.max_pages(num_tokens + ahead) - least)

    # ---- pages ----
    def _blocks(self, lo: int, hi: int) -> range:
        return range(lo // self.tokens_per_page, (hi - 1) // self.tokens_per_page + 1) if hi > lo else range(0)

    def _add_blocks(self, wanted: dict[int, range]) -> None:
        ids = self.pool.take_pages(sum(len(r) for r in wanted.values()) * self.pages_per_block,
                                   op="allocate (sliding window)")
        ids = ids.view(-1, len(self.layers), self.num_kv_heads).int()
        at = 0
        for slot, blocks in wanted.items():
            if len(blocks):
                ring = torch.tensor([b % self.max_blocks for b in blocks], device=self.pages.device)
                self.pages[slot, ring] = ids[at:at + len(blocks)]
                at += len(blocks)
                self.first[slot] = min(self.first[slot], blocks.start) if self.end[slot] else blocks.start
                self.end[slot] = blocks.stop
        self.held += at * self.pages_per_block

    def _drop_blocks(self, slot: int, stop: int) -> None:
        """Give back the blocks of ``slot`` below ``stop``."""
        blocks = range(self.first[slot], min(stop, self.end[slot]))
        if len(blocks):
            ring = torch.tensor([b % self.max_blocks for b in blocks], device=self.pages.device)
            self.pool.give_pages(self.pages[slot, ring].reshape(-1))
            self.pages[slot, ring] = -1
            self.held -= len(blocks) * self.pages_per_block
        self.first[slot] = max(self.first[slot], min(stop, self.end[slot]))

    def prefill(self, slots: list[int], lengths: list[int]) -> None:
        """Pages for the last ``window - 1`` tokens of each prompt (``lengths``), taken at once (PoolExhausted:
        none taken)."""
        wanted = {s: self._blocks(max(0, n - self.window + 1), n) for s, n in zip(slots, lengths, strict=True)}
        if any(self.end[s] for s in slots):
            raise RuntimeError(f"slots {[s for s in slots if self.end[s]]} already hold sliding-window pages")
        self._add_blocks(wanted)
        for s, n in zip(slots, lengths, strict=True):
            self.length[s] = n

    def reserve(self, slots: list[int]) -> list[int]:
        """Before a decode step: give back each slot's blocks wholly outside its next query's window, then add a
        block where the next token starts one (PoolExhausted: none added). Returns the slots given a block."""
        wanted = {}
        for s in slots:
            p = self.length[s]  # the next token's position
            self._drop_blocks(s, max(0, p - self.window + 1) // self.tokens_per_page)
            if p // self.tokens_per_page >= self.end[s]:
                wanted[s] = range(p // self.tokens_per_page, p // self.tokens_per_page + 1)
        self._add_blocks(wanted)
        return list(wanted)

    def unreserve(self, slots: list[int]) -> None:
        """Undo :meth:`reserve` for ``slots`` (its return value): give their newest block back."""
        for s in slots:
            ring = (self.end[s] - 1) % self.max_blocks
            self.pool.give_pages(self.pages[s, ring].reshape(-1))
            self.pages[s, ring] = -1
            self.end[s] -= 1
            self.held -= self.pages_per_block

    def release(self, slot: int) -> None:
        """Give every page of ``slot`` back (it may hold none)."""
        self._drop_blocks(slot, self.end[slot])
        self.first[slot] = self.end[slot] = self.length[slot] = 0

    def owned_pages(self) -> torch.Tensor:
        """Page ids held now: int64 [held] (tests: with the DiffKV tables, every page is free or owned once)."""
        return self.pages[self.pages >= 0].long()

    # ---- K/V ----
    def flat(self) -> torch.Tensor:
        """The pool's bytes as one flat ``dtype`` tensor: page p's K row r starts at element
        ``p * page_elements + r * head_dim``, its V row :attr:`v_offset` after it."""
        return self.pool.data.view(self.dtype).view(-1)

    def locate(self, layer: int, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat element indices int64 [..., H_kv, head_dim] of the K rows of ``positions`` (int64 [...]) of
        ``slots`` (same shape) in sliding layer ``layer`` (a model layer index); add :attr:`v_offset` for V."""
        block = (positions // self.tokens_per_page) % self.max_blocks
        pages = self.pages[slots, block, self.index[layer]].long()  # [..., H]
        row = (positions % self.tokens_per_page)[..., None]
        start = pages * self.page_elements + row * self.head_dim
        return start[..., None] + torch.arange(self.head_dim, device=start.device)

    @property
    def v_offset(self) -> int:
        return self.tokens_per_page * self.head_dim

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Store K/V [N, H_kv, D] of token ``positions`` [N] of ``slots`` [N] (their blocks must exist)."""
        at, flat = self.locate(layer, slots, positions), self.flat()
        flat[at] = keys.to(self.dtype)
        flat[at + self.v_offset] = values.to(self.dtype)

    def write_prompt(self, layer: int, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the window's part of one prompt's K/V [H_kv, n, D] (its last ``window - 1`` tokens)."""
        n = keys.shape[1]
        pos = torch.arange(max(0, n - self.window + 1), n, device=keys.device)
        slots = torch.full_like(pos, slot)
        self.write(layer, slots, pos, keys[:, pos].transpose(0, 1), values[:, pos].transpose(0, 1))

    # ---- steps ----
    def prefill_step(self, slots: list[int], lengths: list[int]) -> SlidingPrefill:
        """Take the pages of a prefill of ``slots`` (prompts of ``lengths``) and the handle its layers write with."""
        self.prefill(slots, lengths)
        return SlidingPrefill(self, list(slots))

    def decode_step(self, slots: list[int], positions: list[int]) -> SlidingDecode:
        """The handle of one decode step (the new token of each slot at ``positions``; its block was reserved)."""
        wrong = [s for s, p in zip(slots, positions, strict=True) if self.length[s] != p
                 or p // self.tokens_per_page >= self.end[s]]
        if wrong:
            raise RuntimeError(f"sliding-window slots {wrong}: decode position differs from the tokens stored, or "
                               "no block was reserved (call reserve_step first)")
        for s in slots:
            self.length[s] += 1
        return SlidingDecode(self, slots, positions)


class SlidingPrefill:
    """A prefill's handle: the packed prompts' slots, in order."""

    def __init__(self, store: SlidingWindowStore, slots: list[int]):
        self.store, self.slots = store, slots


class SlidingDecode:
    """A decode step's handle: slots [B], positions [B] of the new tokens, and their windows' positions
    [B, width] (width = min(window, longest + 1); ``mask`` [B, 1, 1, width] marks the real ones, None if all)."""

    def __init__(self, store: SlidingWindowStore, slots: list[int], positions: list[int]):
        dev = store.pages.device
        self.store = store
        self.slots = torch.tensor(slots, dtype=torch.int64, device=dev)
        self.positions = torch.tensor(positions, dtype=torch.int64, device=dev)
        width = min(store.window, max(positions) + 1)
        pos = self.positions[:, None] - width + 1 + torch.arange(width, device=dev)
        self.mask = None if min(positions) + 1 >= width else (pos >= 0)[:, None, None, :]
        self.window = torch.where(pos >= 0, pos, self.positions[:, None])
        self.window_slots = self.slots[:, None].expand_as(self.window)

    def append_and_read(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """Store the new K/V [B, H_kv, D] of ``layer``; return the windows' K, V [B, H_kv, width, D] and mask."""
        self.store.write(layer, self.slots, self.positions, keys, values)
        at, flat = self.store.locate(layer, self.window_slots, self.window), self.store.flat()  # [B, width, H, D]
        return flat[at].transpose(1, 2), flat[at + self.store.v_offset].transpose(1, 2), self.mask
