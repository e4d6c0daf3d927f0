"""One layer of DiffKV: prefill compression and the decode step, over all (sequence, KV head) items at once.

Framework-agnostic (used by the transformers cache; an engine can drive it too). Data path (docs/design.md §2):
prefill = importance from the last ``score_window`` queries (:mod:`diffkv.cache.scoring`) -> tier split ->
allocate exactly the split's pages -> (``smooth_keys``: keys centered and scaled per channel by the prompt's range,
:func:`key_transform`; ``rotate_values``: values rotated, ``diffkv.core.rotation``) -> quantize into pages -> trim
(moves the low pages to the row's right end); decode = reserve -> placement (docs/algorithm.md §4.4) -> demote /
store the new token -> attention over both tiers -> score accumulation (``diffkv.ops.decode_step``: torch
reference, compiled CPU or Triton).
"""

from __future__ import annotations

import torch

from diffkv.cache.paged_kv import PagedKV
from diffkv.cache.scoring import prompt_scorer
from diffkv.core import bookkeeping, policy, rotation, spans
from diffkv.core.config import DiffKVConfig
from diffkv.core.points import check_same_storage
from diffkv.memory import LOW_COL, STORED_TIERS, allocate, reserve, trim
from diffkv.ops.decode_plan import DecodePlan, DecodeWorkspace, PlanBuffers, build_plan, storage_bytes
from diffkv.ops.decode_step import decode_step, decode_step_planned, resolve_backend


class LayerCompressor:
    """DiffKV state of one layer for the sequences in ``slots`` (batch row b uses table slot ``slots[b]``).

    attention_backend: "auto", "torch", "cpu" or "triton" (``diffkv.ops.decode_step.resolve_backend``); the Triton
    backend also computes the prefill scores with its kernels. point: the operating point this compressor's prefill
    places tokens by, instead of the store's config (``diffkv.core.points``: e.g. ``context_point(config)`` for a
    shared prefix compressed before its question; it may change only the scoring fields).
    workspace: the decode scratch to use (``diffkv.ops.decode_plan.DecodeWorkspace``, e.g. a store's, shared by its
    compressors); default: one of its own, made at the first decode.
    """

    def __init__(self, kv: PagedKV, layer_idx: int, slots: list[int], num_kv_heads: int, *,
                 attention_backend: str = "auto", point: DiffKVConfig | None = None,
                 workspace: DecodeWorkspace | None = None):
        self.kv, self.layer_idx, self.slots, self.num_kv_heads = kv, layer_idx, list(slots), num_kv_heads
        self.backend = resolve_backend(attention_backend, kv.pool.device)
        self.heads = kv.tables.select(self.slots, layers=[layer_idx])  # slot-major: item b * H + h
        self.position = torch.zeros(len(slots), dtype=torch.int64, device=kv.tables.device)  # tokens seen per seq
        self.longest = 0  # >= max of position, kept on the host (length limit, decode plan bounds; no device sync)
        self.workspace = workspace
        self._buffers: PlanBuffers | None = None  # the error flag of decode calls without a step's plan
        if point is not None:
            check_same_storage(kv.config, point, f"layer {layer_idx}: ")
        self.point = kv.config if point is None else point  # what the prefill scores and places tokens by
        self.scorer = prompt_scorer(self.point, self.backend, where=f"layer {layer_idx}: ")  # prompt importance

    def nbytes(self) -> int:
        """Bytes of this layer's own tensors (positions, head-set indices, decode flag and scratch; the pages are
        the PagedKV's): their storages, each once."""
        return storage_bytes(self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this layer holds: positions (maybe a view of a decode plan's), head-set indices, and its own
        decode flag and scratch (or the shared workspace it was given)."""
        h = self.heads
        own = [] if self._buffers is None else self._buffers.tensors()
        scratch = [] if self.workspace is None else self.workspace.tensors()
        return [self.position, h.items, h.slot_index, h.count_index, h.edge_cells, *own, *scratch]

    @property
    def items(self) -> torch.Tensor:
        return self.heads.items

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        tok = self.kv.tables.tokens_flat[self.items].long()
        return tok[:, 0], tok[:, 1]

    def prefill(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                scaling: float, repeat_scores: torch.Tensor | None = None,
                word_starts: torch.Tensor | None = None, fill_pages: bool = False) -> policy.PrefillSplit:
        """Compress a prompt into pages.

        query: [B, H_q, L, D]; keys, values: [B, H_kv, L, D] post-RoPE; valid: [B, L] bool (False = left padding).
        repeat_scores: [B, H_kv, L] peak attention each prompt token receives from a re-read copy of the prompt
        (``diffkv.hf.repeat_scores``), required with ``prompt_scores="repeat"``: a token keeps the larger of it and
        its peak from the scoring window. word_starts: [B, L] bool, True where a word starts (left-padded like
        ``valid``; ``diffkv.core.spans.word_starts``), required with ``score_spans``: scores are pooled over words.
        fill_pages: nothing will follow these prompts in their pages (a shared prefix, frozen next): each item's
        partly filled last page of a tier is filled with its best tokens of the tiers below
        (``policy.fill_last_pages``).
        Returns the split it stored (``policy.split_prefill``'s, docs/algorithm.md §4.3): ``tier`` int8 [B, H_kv, L],
        the tier of every prompt column per KV head (``policy.HIGH`` 2, ``LOW`` 1, ``PRUNED`` 0, ``PAD`` -1 at left
        padding), and ``n_high``, ``n_low`` int32 [B, H_kv], the tokens each item's tiers now hold. Nothing keeps it.
        """
        if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
            raise ValueError(f"layer {self.layer_idx}: prompt keys/values contain NaN or Inf; cannot quantize them")
        cfg, lengths = self.point, valid.sum(1)
        longest = keys.shape[2]  # padded length >= every prompt: checks and decode bounds without a sync
        self._check_length(longest)
        score = self.scorer.score(query, keys, valid, scaling, repeat_scores)  # [B, H_kv, L] (diffkv.cache.scoring)
        if cfg.score_spans:
            if word_starts is None or tuple(word_starts.shape) != tuple(valid.shape):
                raise ValueError(f"layer {self.layer_idx}: DiffKVConfig.score_spans needs the prompt's word starts of "
                                 f"shape {tuple(valid.shape)} (KVStore.set_word_starts before the prefill), got "
                                 f"{None if word_starts is None else tuple(word_starts.shape)}")
            score = spans.pool_spans(score, word_starts, valid)
        keys, values = self._transform(keys, values, valid)
        split = policy.split_prefill(score, lengths, *cfg.alphas(self.layer_idx), cfg.recent_window,
                                     cfg.score_window, two_tier=cfg.two_tier, peak=cfg.peak, min_kept=cfg.min_kept,
                                     min_high=cfg.min_high,
                                     fill_pages=self.kv.tables.tokens_per_page_hl if fill_pages else None)
        self._store(split, score, keys, values, lengths)
        self.position = lengths.to(torch.int64)
        self.longest = longest
        return split

    def _transform(self, keys: torch.Tensor, values: torch.Tensor,
                   valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's keys and values as they are stored. keys, values: [B, H_kv, L, D]; valid: [B, L] bool.

        ``key_vectors``: records each item's key center (and scale, :func:`key_transform`) in the pages' key
        transform (decode scales queries to match, ``PagedKV``) and returns the keys centered (and scaled), in their
        dtype; ``rotate_values``: returns the values rotated (decode rotates the attention output back). Returns
        (keys, values), both [B, H_kv, L, D].
        """
        cfg = self.kv.config
        b, h = keys.shape[:2]
        if cfg.key_vectors:
            center, scale = key_transform(keys, valid, cfg.smooth_keys)
            self.kv.set_key_transform(self.items, center.reshape(b * h, -1),
                                      None if scale is None else scale.reshape(b * h, -1))
            stored = keys.float() - center[:, :, None, :]
            keys = (stored if scale is None else stored / scale[:, :, None, :]).to(keys.dtype)
        if cfg.rotate_values:
            values = rotation.rotate(values)
        return keys, values

    def _store(self, split: policy.PrefillSplit, score: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               lengths: torch.Tensor) -> None:
        """Store the prompt as ``split`` says (docs/design.md §2.1 step 5).

        split: tiers [B, H_kv, L] and counts [B, H_kv]; score: [B, H_kv, L] fp32; keys, values: [B, H_kv, L, D] as
        stored (:meth:`_transform`); lengths: [B] valid prompt lengths. Allocates exactly each item's pages, sets its
        token counts, quantizes each tier into its pages in sequence order with its bookkeeping (sums, compact means
        or peaks), then trims (moves the low pages to the row's right end).
        """
        cfg, tables = self.kv.config, self.kv.tables
        b, h, length = score.shape
        per_page = tables.tokens_per_page.to(torch.int64)
        pages = (-(-split.n_high.view(-1).long() // per_page[0])) + (-(-split.n_low.view(-1).long() // per_page[1]))
        self.kv.with_room(allocate, self.kv.pool, tables, self.heads, lengths.tolist(), pages=pages)  # exact pages
        tables.tokens_flat[self.items] = torch.stack([split.n_high, split.n_low], -1).view(-1, 2)
        pos = policy.prefill_positions(lengths, length, cfg.score_window, cfg.score_lag)  # [B, L]
        grid = self.items.view(b, h)
        for tier, label in enumerate(STORED_TIERS):  # tier: the column of the tier axis; label: its Tier
            mask = split.tier == label  # [B, H, L]
            if tier == LOW_COL and not cfg.two_tier:
                continue
            bi, hi, ti = mask.nonzero(as_tuple=True)
            index = (mask.cumsum(-1) - 1)[bi, hi, ti]
            stored = bookkeeping.encode_prefill(score[bi, hi, ti], pos[bi, ti], lengths[bi], cfg.score_lag,
                                                self.kv.compact, cfg.peak)  # sums, compact means, or peaks
            self.kv.write(tier, grid[bi, hi], index, keys[bi, hi, ti], values[bi, hi, ti], stored, pos[bi, ti],
                          before_trim=True)
        trim(self.kv.pool, tables, self.heads)

    def begin_decode(self, positions: torch.Tensor, longest: int, *, copy: bool = True) -> None:
        """Decode sequences whose tokens are already in the pages (stored by another compressor of this layer: a
        host that builds its compressors per step, as the engine and the vLLM store do), from these positions on.

        positions: int [B] tokens each sequence has seen (= the index of its next token), B = ``len(slots)``;
        copied (int64, on the tables' device; ``copy=False``: kept as it is when already so, for a caller that
        shares one tensor between layers and never changes it in place). longest: their max, a host int (the length
        check and the decode plan's bounds use it without a device sync; an upper bound is enough). Raises
        ValueError, nothing changed, when ``positions`` is not [B].
        """
        if tuple(positions.shape) != (len(self.slots),):
            raise ValueError(f"layer {self.layer_idx}: begin_decode needs positions of shape ({len(self.slots)},), "
                             f"got {tuple(positions.shape)}")
        position = positions.to(device=self.kv.tables.device, dtype=torch.int64)
        self.position = position.clone() if copy and position is positions else position
        self.longest = int(longest)

    def decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, *,
               reserved: bool = False, plan: DecodePlan | None = None,
               may_demote: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step. query: [B, H_q, D]; key, value: [B, H_kv, D] of the new token. Returns [B, H_q, D] fp32.

        Decides placements from the stored scores, writes the demoted and the new token into their pages, attends
        over exactly the stored (quantized) cache and adds the probabilities to the scores
        (``diffkv.ops.decode_step`` with this compressor's backend).
        ``reserved``: the caller already reserved this step's pages for these heads (e.g. once for all layers);
        otherwise they are reserved here, with ``may_demote`` (bool [K] or None, ``diffkv.memory.reserve``).
        ``plan``: the step's ``DecodePlan`` (``diffkv.ops.decode_plan``, built once for every layer; it must be for
        this layer, heads and batch, else ValueError) whose ``finish`` the caller runs after the step's last layer;
        default: a plan of this call alone, finished here. On the Triton backend a planned layer makes no host sync
        and three launches; a non-finite new key or value is then reported by ``finish`` (the torch backend checks
        here, the compiled CPU step in C, both before writing).
        """
        kv = self.kv
        b, h, d = key.shape
        own = plan is None
        if own:
            plan = self.plan_call()
        plan.check(self.layer_idx, self.items, query, key, value)
        if self.backend == "torch" and not torch.isfinite(torch.stack([key, value])).all():
            raise ValueError(f"layer {self.layer_idx}: the new token's keys/values contain NaN or Inf")
        self._check_length(self.longest + 1)
        if not reserved:
            kv.with_room(reserve, kv.pool, kv.tables, self.heads, may_demote)
        out = self._step(plan, query, key.reshape(b * h, d), value.reshape(b * h, d), scaling)
        plan.ran(self.layer_idx)
        self.position = plan.next_positions  # a new tensor: positions shared between layers are never changed
        self.longest += 1
        if own:
            plan.finish()
        return out

    def _step(self, plan: DecodePlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              scaling: float) -> torch.Tensor:
        """Place, store and attend with this compressor's backend. key, value: [K, D]. Returns [B, H_q, D] fp32."""
        kv = self.kv
        if kv.config.rotate_values:
            value = rotation.rotate(value)
        alphas = kv.config.alphas(self.layer_idx)
        if self.backend == "triton":
            out = decode_step_planned(kv, plan, self.layer_idx, query, key, value, *alphas, scaling)
        else:
            key, query = kv.stored_keys(self.items, key), kv.stored_queries(self.items, query)
            out = decode_step(kv, self.items, query, key, value, plan.positions, *alphas, scaling,
                              backend=self.backend)
        if kv.config.rotate_values:  # attention over rotated values is the rotated output (diffkv.core.rotation)
            out = rotation.unrotate(out)
        return out

    def plan_call(self) -> DecodePlan:
        """A decode plan of this layer alone at its current positions (what :meth:`decode` builds when it is given
        none): two launches (positions per head, + 1), no sync."""
        if self.workspace is None:
            self.workspace = DecodeWorkspace(self.kv.tables.device)
        if self._buffers is None:
            self._buffers = PlanBuffers([self.layer_idx], self.kv.tables.device, keep_outputs=False)
        return build_plan(self.kv, {self.layer_idx: self.items}, self.position, self.longest, self.num_kv_heads,
                          backend=self.backend, workspace=self.workspace, buffers=self._buffers)

    def _check_length(self, tokens: int) -> None:
        if self.kv.compact and tokens > bookkeeping.COMPACT_MAX_TOKENS:
            raise ValueError(f"layer {self.layer_idx}: a sequence of {tokens} tokens is longer than compact metadata "
                             f"allows ({bookkeeping.COMPACT_MAX_TOKENS}: positions are kept mod 2^16); use "
                             "DiffKVConfig(compact_meta=False)")


SMOOTH_FLOOR = 1 / 64  # a channel's scale is at least this fraction of its head's widest channel


def key_transform(keys: torch.Tensor, valid: torch.Tensor, smooth: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-channel key center (and scale) of each head's prompt. keys: [B, H, L, D]; valid: [B, L] bool.

    Returns (center [B, H, D] fp32, scale [B, H, D] fp32 or None). Without ``smooth``: the per-channel median (not
    the mean: a few outlier tokens, attention sinks, drag the mean far enough that every other key gets a large
    offset and 4-bit keys break; measured KL 1.1 vs 0.002 on qwen2.5). With ``smooth``: the mid-range and the
    half-range, floored at ``SMOOTH_FLOOR`` of the head's widest channel (and, for a one-token prompt, at 1/1024 of
    its largest magnitude) so that stored keys stay well inside fp16.
    """
    keys, mask = keys.float(), valid[:, None, :, None]
    if not smooth:
        center = keys.masked_fill(~mask, float("nan")).nanmedian(dim=2).values.nan_to_num(0.0)
        return center, None
    hi = keys.masked_fill(~mask, float("-inf")).amax(2)
    lo = keys.masked_fill(~mask, float("inf")).amin(2)
    hi, lo = torch.where(hi >= lo, hi, 0.0), torch.where(hi >= lo, lo, 0.0)  # rows without a valid token: 0
    half = (hi - lo) / 2
    floor = torch.maximum(half.amax(-1, keepdim=True) * SMOOTH_FLOOR,
                          torch.maximum(hi.abs(), lo.abs()).amax(-1, keepdim=True) / 1024).clamp_min(1e-6)
    return (hi + lo) / 2, torch.maximum(half, floor)
