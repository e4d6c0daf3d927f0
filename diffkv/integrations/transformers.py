"""``DiffKVCache``: a transformers ``Cache`` whose full-attention layers keep K/V in DiffKV pages.

    model.generate(ids, past_key_values=DiffKVCache(model, DiffKVConfig()))

Each full-attention layer is a :class:`DiffKVLayer`; sliding-window layers (Gemma-3) stay in transformers'
``DynamicSlidingWindowLayer`` (never attend outside their window) and are reported as uncompressed in ``stats()``.
The pool, tables and slots are created at the first ``update``, sized for that batch.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from diffkv.cache.compressor import LayerCompressor
from diffkv.cache.hosting import check_config
from diffkv.cache.kv_store import KVStore
from diffkv.cache.paged_kv import PagedKV
from diffkv.cache.staging import PromptStage
from diffkv.core.config import DiffKVConfig
from diffkv.core.layout import plan_for_config
from diffkv.core.points import context_point
from diffkv.core.policy import PrefillSplit
from diffkv.core.stats import cache_stats
from diffkv.hf.auto_repeat import RepeatOnFirstForward
from diffkv.hf.auto_words import WordsOnFirstForward
from diffkv.hf.layer import RoutedLayer, cache_layers
from diffkv.hf.repeat_scores import repeat_prefill
from diffkv.hf.routing import install_router, sdpa_attention_forward, valid_from_mask
from diffkv.hf.shape import kv_shape
from diffkv.integrations.context import can_share, sharing_fork
from diffkv.ops.decode_step import resolve_backend

CHUNKED_PREFILL = ("extend", "deferred")
PROMPT_WITH_DRAFTS = ("DiffKVCache.crop: the dropped tokens came with the prompt in its first call (assisted or "
                      "prompt-lookup decoding), so the prompt was scored and split with them in its window: the "
                      "text can differ from plain decoding. For plain decoding's tokens build the cache with "
                      "chunked_prefill='deferred' and run generate() inside diffkv.engine.invariance.invariant_rows"
                      "(model) (benchmarks/serve/batch_invariance.md)")
_UNSUPPORTED = "DiffKVCache does not support {what} (tokens are pruned per head); use a DynamicCache for it"


class DiffKVLayer(RoutedLayer):
    """One full-attention layer: the prompt goes through SDPA, then into pages; decode reads the pages.

    prefill_listeners: callables ``f(layer, split)``, each run once right after the prompt is stored in pages and
    before any decode step, with the :class:`~diffkv.core.policy.PrefillSplit` that ``LayerCompressor.prefill``
    stored (tier int8 [B, H_kv, L] per prompt column, -1 at left padding; n_high, n_low int32 [B, H_kv]). The layer
    keeps nothing of the split; a listener keeps what it needs (``diffkv.viz.tiers``).
    """

    def __init__(self, cache: DiffKVCache, layer_idx: int):
        super().__init__(layer_idx)
        self.cache = cache
        self.filled = False  # the prompt is in the pages
        self.prefill_listeners: list[Callable[[DiffKVLayer, PrefillSplit], None]] = []

    @property
    def router(self):
        return self.cache.router

    def next_phase(self, q: int) -> str:
        """"prefill" for the first call (and, with ``chunked_prefill="deferred"``, every multi-token call while
        the prompt is staged), then "extend" (one token or several: a chunk, a new turn, draft tokens to verify)."""
        if self.processed == 0 or (q > 1 and self.layer_idx in self.cache.stage.layers):
            return "prefill"
        return "extend"

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        """Called by the attention function for this layer's pending update. Returns ([B, q, H_q, D], None)."""
        valid = valid_from_mask(attention_mask, key.shape[0], key.shape[2], key.device)  # [B, q] the new columns
        if self.phase == "prefill":
            store = self.cache._store_for(key)
            if self.cache.chunked_prefill == "deferred":  # attend over the prompt so far, store it when complete
                allowed = None if attention_mask is None else (
                    attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0)
                return self.cache.stage.attend(self.layer_idx, query, key, value, valid, scaling, allowed), None
            n = self.cache.prompt_length
            if n is not None and n < key.shape[2]:  # drafts sent with the prompt (set_prompt_length)
                return self._prompt_then_drafts(module, query, key, value, attention_mask, valid, scaling, n, **kwargs)
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
            if not bool(valid.any(1).all()):
                raise ValueError("DiffKVCache: a row of the first call is all padding (left padding longer "
                                 "than the first chunk); use chunked_prefill='deferred' or larger chunks")
            self.prompt_stored(store.prefill(self.layer_idx, self.cache.slots, query, key, value, valid, scaling,
                                             self.cache._repeat_scores(self.layer_idx)))
            return out, None
        if self.cache.stage:  # the first token after a staged prompt: store the whole prompt first
            self.cache.finish_prefill()
        if key.shape[2] > 1 and not bool(valid.all()):
            raise ValueError("DiffKVCache: the new tokens of a filled cache must not be padding (left padding "
                             "belongs to the first call); pass one conversation per row with its tokens valid")
        self.cache.extended = True
        out = self.cache.store.extend(self.layer_idx, self.cache.slots, query, key, value, scaling)  # [B, H_q, n, D]
        return out.to(query.dtype).transpose(1, 2), None

    def _prompt_then_drafts(self, module, query, key, value, attention_mask, valid, scaling, n: int, **kwargs):
        """A first call of the prompt's ``n`` columns and draft tokens after them: the prompt attended and stored as
        if it came alone, the drafts appended by ``KVStore.extend`` (a decode step each, as plain decoding stores
        its tokens), so a crop drops them exactly. Returns ([B, q, H_q, D], None)."""
        if not bool(valid[:, n:].all()) or not bool(valid[:, :n].any(1).all()):
            raise ValueError(f"DiffKVCache.set_prompt_length({n}): the first call's columns after the prompt must be "
                             "draft tokens (no padding), and every row must hold prompt tokens")
        mask = None if attention_mask is None else attention_mask[:, :, :n, :n]
        head, _ = sdpa_attention_forward(module, query[:, :, :n], key[:, :, :n], value[:, :, :n], mask,
                                         scaling=scaling, **kwargs)
        store, slots = self.cache._store_for(key), self.cache.slots
        self.prompt_stored(store.prefill(self.layer_idx, slots, query[:, :, :n], key[:, :, :n], value[:, :, :n],
                                         valid[:, :n], scaling, self.cache._repeat_scores(self.layer_idx)))
        self.cache.extended = True
        tail = store.extend(self.layer_idx, slots, query[:, :, n:], key[:, :, n:], value[:, :, n:], scaling,
                            each_layer=True)  # the next layers store their prompt after this call
        return torch.cat([head, tail.to(query.dtype).transpose(1, 2)], 1), None

    def prompt_stored(self, split: PrefillSplit) -> None:
        """The prompt is in the pages: tell the listeners."""
        self.filled = True
        for listener in self.prefill_listeners:
            listener(self, split)

    @property
    def compressor(self) -> LayerCompressor | None:
        """This layer's compressor for the cache's sequences (None before the prompt); the store owns it."""
        return self.cache.store.compressor(self.layer_idx, self.cache.slots) if self.filled else None

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError(_UNSUPPORTED.format(what="beam search / cache reordering"))

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the newest columns (``DiffKVCache.crop`` has dropped their tokens from the store first)."""
        self.processed -= _drop_count(tokens_to_remove, self.processed)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(_UNSUPPORTED.format(what="expanding a filled cache"))

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError(_UNSUPPORTED.format(what="selecting batch rows of a filled cache"))

    def reset(self) -> None:
        raise NotImplementedError("reset is not supported; call cache.release() and build a new DiffKVCache")


class DiffKVCache(Cache):
    """transformers cache storing full-attention layers in DiffKV pages.

    Parameters
    ----------
    model: the transformers causal LM (its attention is routed through ``diffkv``; see :mod:`diffkv.hf.routing`).
    config: :class:`DiffKVConfig` (defaults: K8V4 / K4V2, alpha_high 1.0, alpha_low 0.02).
    max_seq_len: most tokens per sequence (sizes the page tables); default min(model max positions, 32768).
    kv_budget_bytes: most bytes of pages the pool may grow to; default: room for every sequence of the batch at
        ``max_seq_len`` all in the high tier. The pool starts empty and grows with what the cache holds (each
        prefill allocates exactly its tier split; growth adds at least 2 % at a time), so it is not preallocated.
    attention_backend: "auto" (the compiled CPU step on CPU, the Triton kernels on CUDA), "cpu", "triton" (on CPU
        only under ``TRITON_INTERPRET=1``, for tests) or "torch" (the reference); checked here
        (``diffkv.ops.decode_step.resolve_backend``).
    chunked_prefill: how a prompt that arrives in several calls is stored. "extend" (default): the first call is
        compressed at once and later ones are appended by ``KVStore.extend`` (bounded memory). "deferred": every
        multi-token call before the first single-token one is held at full precision (:mod:`diffkv.cache.staging`,
        counted in ``nbytes``) and stored as one prompt at the first single-token call, a :meth:`crop` (drafts
        verified with the prompt: the rejected ones are dropped first) or :meth:`finish_prefill`: the same split as a
        whole prefill, at the peak memory of the uncompressed prompt. Its attention runs in fixed blocks of query
        rows (``diffkv.ops.row_blocks.blocked_attention``), so a row's bits do not depend on the chunking or on
        draft tokens sent with the prompt: with the linear layers in fixed row blocks too
        (``with invariant_rows(model):``), assisted and prompt-lookup decoding give plain decoding's tokens, unless
        a draft sent with the prompt is accepted (it is then stored as part of the prompt; :meth:`set_prompt_length`
        on an ``"extend"`` cache covers that case too).
    tokenizer, bridge_ids: with ``prompt_scores="repeat"``, the cache scores the prompt by a re-read pass before
        the model's first forward through it (:mod:`diffkv.hf.auto_repeat`); the tokenizer gives the bridge's ids
        (default: loaded from the model's folder). Not needed after ``set_prompt_scores``. With ``score_spans`` the
        tokenizer also gives each prompt's words (:mod:`diffkv.hf.auto_words`; or :meth:`set_word_starts`).

    The cache lives as long as a conversation: a later call with n >= 1 new tokens (chunked prefill, the next
    turn of a chat, draft tokens to verify) is appended by ``KVStore.extend``; :meth:`crop` drops rejected drafts.
    """

    def __init__(self, model, config: DiffKVConfig | None = None, *, max_seq_len: int | None = None,
                 kv_budget_bytes: int | None = None, attention_backend: str = "auto",
                 chunked_prefill: str = "extend", tokenizer=None, bridge_ids: list[int] | None = None):
        self.config = config or DiffKVConfig()
        self.shape = shape = kv_shape(model)
        self.max_forks = 0  # forks that may share this cache's pages (for_context)
        self.num_layers, self.num_kv_heads, self.head_dim = shape.num_layers, shape.num_kv_heads, shape.head_dim
        check_config(self.config, num_layers=self.num_layers, head_dim=self.head_dim)
        if chunked_prefill not in CHUNKED_PREFILL:
            raise ValueError(f"chunked_prefill must be one of {CHUNKED_PREFILL}, got {chunked_prefill!r}")
        if chunked_prefill == "deferred" and self.config.prompt_scores == "repeat":
            raise ValueError("chunked_prefill='deferred' with prompt_scores='repeat' is not supported: the re-read "
                             "pass needs the whole prompt in one call; use chunked_prefill='extend'")
        if chunked_prefill == "deferred" and self.config.score_spans:
            raise ValueError("chunked_prefill='deferred' with score_spans is not supported: the words are read from "
                             "the first call's ids; use chunked_prefill='extend'")
        self.chunked_prefill = chunked_prefill
        self.stage = PromptStage(self.config.score_window, spare=max(self.config.recent_window, 1))
        self.max_seq_len = max_seq_len or min(shape.max_position_embeddings or 32768, 32768)
        self.kv_budget_bytes = kv_budget_bytes
        self.attention_backend = resolve_backend(attention_backend, next(model.parameters()).device)
        super().__init__(layers=cache_layers(shape, lambda i: DiffKVLayer(self, i)))
        self.router = install_router(model)
        self.plan = plan_for_config(self.config, self.head_dim)
        self.store: KVStore | None = None
        self.slots: list[int] = []
        self.extended = False  # a call after the prompt's went to KVStore.extend
        self.prompt_length: int | None = None  # set_prompt_length
        self.prompt_scores: list[torch.Tensor | None] | None = None  # prompt_scores="repeat": per model layer
        self._repeat_hook = RepeatOnFirstForward(model, self, tokenizer, bridge_ids) \
            if self.config.prompt_scores == "repeat" else None
        self.word_starts: list[torch.Tensor] | None = None  # score_spans: each row's prompt word starts
        self._words_hook = WordsOnFirstForward(model, self, tokenizer) if self.config.score_spans else None

    def set_word_starts(self, starts: list[torch.Tensor]) -> None:
        """Word starts of the next prompt (``config.score_spans``): per batch row, [L_b] bool over the row's tokens
        without its padding (``diffkv.core.spans.word_starts``). A cache built with ``tokenizer=`` sets them
        itself from the first call's ``input_ids``."""
        if not self.config.score_spans:
            raise ValueError("set_word_starts needs DiffKVConfig(score_spans=True)")
        self.word_starts = list(starts)
        if self.store is not None and not self.holds_tokens():
            self._hand_word_starts()

    def _hand_word_starts(self) -> None:
        if self.word_starts is None:
            return
        if len(self.word_starts) != len(self.slots):
            raise ValueError(f"set_word_starts: one entry per batch row ({len(self.slots)}), got "
                             f"{len(self.word_starts)}")
        for slot, starts in zip(self.slots, self.word_starts, strict=True):
            self.store.set_word_starts(slot, starts.to(torch.bool).cpu())

    def set_prompt_length(self, n: int) -> None:
        """Assisted and prompt-lookup decoding send the prompt and its first drafts in one call. Before that call,
        say that its first ``n`` columns (left padding included) are the prompt: it is then prefilled as if it came
        alone and the drafts are appended as decode steps, so a crop drops them exactly and, with the linear layers
        in fixed row blocks (``diffkv.engine.invariance.invariant_rows``), the tokens are plain decoding's
        (benchmarks/serve/batch_invariance.md). Not with ``chunked_prefill="deferred"``, ``score_spans`` or repeat
        prompt scores (they read the first call whole)."""
        if self.holds_tokens() or int(n) < 1:
            raise ValueError(f"set_prompt_length({n}): call it before the first call, with n >= 1")
        if self.chunked_prefill == "deferred" or self.config.score_spans or self.config.prompt_scores == "repeat":
            raise ValueError("set_prompt_length needs chunked_prefill='extend' and a config without score_spans or "
                             "repeat prompt scores")
        self.prompt_length = int(n)

    def set_prompt_scores(self, scores: list[torch.Tensor | None]) -> None:
        """Repeat scores for the next prompt (``config.prompt_scores="repeat"``): per model layer, [B, H_kv, L] of
        the prompt as the model will receive it (left padding included, 0 there), from
        ``diffkv.hf.repeat_scores``; None for layers the cache does not page."""
        if self.config.prompt_scores != "repeat":
            raise ValueError("set_prompt_scores needs DiffKVConfig(prompt_scores='repeat', importance='peak')")
        if len(scores) != self.num_layers:
            raise ValueError(f"set_prompt_scores: one entry per model layer ({self.num_layers}), got {len(scores)}")
        self.prompt_scores = list(scores)

    def _repeat_scores(self, layer_idx: int) -> torch.Tensor | None:
        if self.config.prompt_scores != "repeat":
            return None
        if self.prompt_scores is None:
            raise ValueError("DiffKVConfig(prompt_scores='repeat'): build the cache with tokenizer= (it then scores "
                             "the prompt itself), or call cache.set_prompt_scores("
                             "diffkv.hf.repeat_scores.repeat_scores(model, ids, mask, bridge_ids)) before the prompt")
        scores, self.prompt_scores[layer_idx] = self.prompt_scores[layer_idx], None  # used once: not kept
        return scores

    @property
    def kv(self) -> PagedKV | None:
        """The pages and tables (the store's; None before the first prompt)."""
        return None if self.store is None else self.store.kv

    @classmethod
    def for_context(cls, model, ids: torch.Tensor, config: DiffKVConfig | None = None, *, max_forks: int = 4,
                    scores: str = "context", **kwargs) -> DiffKVCache:
        """A cache holding the context ``ids`` ([B, L] token ids, no padding), compressed once: ask questions of it
        through :meth:`fork`; up to ``max_forks`` forks at a time share its pages. scores: "context" (default) runs
        the cache at ``config``'s context point (``diffkv.core.points.context_point``: repeat scores, which score the
        context without any question, for one context row in the same forward that stores it, ``repeat_prefill``;
        peak importance; thresholds x ``context_scale``), "window" at ``config`` itself (the context's own last
        queries: for a context that ends with its question). The repeat pass needs the bridge's ids: ``tokenizer=``
        or ``bridge_ids=`` for a model without a tokenizer in its folder."""
        if scores not in ("context", "window"):
            raise ValueError(f"for_context: scores must be 'context' or 'window', got {scores!r}")
        config = config or DiffKVConfig()
        cache = cls(model, context_point(config) if scores == "context" else config, **kwargs)
        cache.max_forks = int(max_forks)
        hook = cache._repeat_hook  # repeat scores of one context: its re-read pass stores it too (repeat_prefill)
        bridge = hook.bridge() if hook is not None and ids.dim() == 2 and ids.shape[0] == 1 else None
        if hook is not None and bridge is None and ids.dim() == 2 and ids.shape[0] == 1:
            cache.release()
            raise ValueError("for_context scores the context by a re-read pass, whose bridge needs the tokenizer: "
                             "pass tokenizer= or bridge_ids= (or scores='window' for a context that ends with its "
                             "question)")
        with torch.no_grad():
            if bridge is not None:
                repeat_prefill(model, cache, ids, bridge)
            else:
                model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.finish_prefill()
        return cache

    def fork(self) -> DiffKVCache:
        """A cache for one more question of this one's context. Built by :meth:`for_context` with a fork slot free
        (and only full-attention layers), the fork reads this cache's pages (:mod:`diffkv.integrations.context`): it
        costs a few copied pages, and this cache's tokens are frozen from then on (extend the forks, not it; release
        the forks before it). Otherwise an independent copy, pages included: the bytes the cache holds, not a
        prefill. Every fork must be released."""
        if can_share(self, DiffKVLayer):
            return sharing_fork(self, DiffKVLayer)
        hooks = self._repeat_hook, self._words_hook  # the copy's prompt is stored: it needs neither
        self._repeat_hook = self._words_hook = None
        try:
            twin = copy.deepcopy(self, {id(self.router): self.router})
        finally:
            self._repeat_hook, self._words_hook = hooks
        return twin

    @classmethod
    def from_profile(cls, model, path, **kwargs) -> DiffKVCache:
        """A cache configured by a calibrated profile (JSON, see ``diffkv calibrate``); checks it fits ``model``."""
        from diffkv.profile import load_profile

        return cls(model, load_profile(path, model).config, **kwargs)

    def _store_for(self, key: torch.Tensor) -> KVStore:
        """The store, created at the first prompt for its batch (key: [B, H, L, D])."""
        if self.store is None:
            self._create_store(key.shape[0], key.device)
        elif key.shape[0] != len(self.slots):
            raise ValueError(f"batch size changed from {len(self.slots)} to {key.shape[0]} within one DiffKVCache")
        return self.store

    def _create_store(self, batch: int, device) -> None:
        plan, budget = self.plan, self.kv_budget_bytes
        if budget is None:
            n_min = min(t.tokens_per_page for t in plan.tiers)
            per_head = -(-self.max_seq_len // n_min) + 2
            budget = batch * (1 + self.max_forks) * self.num_layers * self.num_kv_heads * per_head * plan.page_bytes
        if budget < plan.page_bytes:
            raise ValueError(f"kv_budget_bytes={budget} holds no {plan.page_bytes}-byte page")
        layers = [i for i, layer in enumerate(self.layers) if isinstance(layer, DiffKVLayer)]
        self.store = KVStore(self.config, plan, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                             max_slots=batch * (1 + self.max_forks), max_seq_len=self.max_seq_len, device=device,
                             budget_bytes=budget,
                             grow=True, attention_backend=self.attention_backend, layers=layers,
                             crop_depth=max(self.config.recent_window, 1))
        self.slots = [self.store.open_slot() for _ in range(batch)]
        self._hand_word_starts()

    def seen_tokens(self) -> torch.Tensor:
        """int64 [B]: tokens each sequence has stored (prompt + decoded)."""
        return torch.tensor([self.store.seen[s] for s in self.slots] if self.store else [], dtype=torch.int64)

    def holds_tokens(self) -> bool:
        """Whether the cache has taken any token (False before the first prompt)."""
        return any(layer.processed for layer in self.layers if isinstance(layer, DiffKVLayer))

    def finish_prefill(self) -> None:
        """Store the staged prompt (``chunked_prefill="deferred"``) in pages now: scored and split as one prompt.
        The first single-token call does it too; nothing to do when no prompt is staged."""
        for i in sorted(self.stage.layers):
            staged = self.stage.take(i)
            split = self.store.prefill(i, self.slots, staged.padded_queries(), staged.keys, staged.values,
                                       staged.valid, staged.scaling, self._repeat_scores(i))
            self.layers[i].prompt_stored(split)

    def release(self) -> None:
        """Give every page back to the pool (idempotent). The cache cannot be used afterwards."""
        if self._repeat_hook is not None:
            self._repeat_hook.remove()
            self._repeat_hook = None
        if self._words_hook is not None:
            self._words_hook.remove()
            self._words_hook = None
        if self.store is not None and self.slots:
            self.store.release(self.slots)  # also retires the slots
            self.slots = []

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop (assisted / prompt-lookup decoding): ``-n`` drops the newest n tokens, ``m > 0`` keeps
        the first m columns (left padding included). Only tokens added after the prompt, among the
        ``recent_window`` newest, by steps that moved no older token, can be dropped (``KVStore.crop``); otherwise a
        ValueError says why and no layer changes."""
        if self.stage:  # drafts that came with a staged prompt (assisted decoding): drop them, store the rest now
            first = next(layer for layer in self.layers if isinstance(layer, DiffKVLayer))
            drop = _drop_count(tokens_to_remove, first.processed)
            if drop:
                self.stage.crop(drop)
            super().crop(tokens_to_remove)
            self.finish_prefill()
            return
        first = next((layer for layer in self.layers if isinstance(layer, DiffKVLayer)), None)
        drop = 0 if first is None else _drop_count(tokens_to_remove, first.processed)
        if drop and self.store is None:
            raise ValueError("crop: the cache holds no tokens yet")
        if drop:
            self.store.crop(self.slots, drop)  # checks every slot and layer before it changes anything
            if not self.extended:
                warnings.warn(PROMPT_WITH_DRAFTS, stacklevel=2)
        super().crop(tokens_to_remove)

    def nbytes(self) -> int:
        """Bytes of every tensor this cache holds: the store (pool, tables, key centers, step plan) and the
        uncompressed sliding-window layers."""
        total = (0 if self.store is None else self.store.nbytes()) + self.stage.nbytes()
        for layer in self.layers:
            if not isinstance(layer, DiffKVLayer):  # a transformers layer: its tensors may be views of larger storages
                storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                            for t in vars(layer).values() if isinstance(t, torch.Tensor)}
                total += sum(storages.values())
        return total

    def stats(self) -> dict:
        """Tokens per tier per layer/head, pages and bytes in use, every byte held, physical and theoretical
        compression."""
        return cache_stats(self)


def _drop_count(tokens_to_remove: int, processed: int) -> int:
    """Columns a transformers ``crop(tokens_to_remove)`` drops from a layer of ``processed`` columns."""
    tokens_to_remove = int(tokens_to_remove)  # transformers: -n removes n (0 nothing), m > 0 keeps m columns
    return min(-tokens_to_remove, processed) if tokens_to_remove <= 0 else max(processed - tokens_to_remove, 0)
