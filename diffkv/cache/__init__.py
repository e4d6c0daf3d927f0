"""The storage layer every host drives, above the memory manager and the launchers: one model's storage and step
plan (:mod:`.kv_store`, :class:`~diffkv.cache.kv_store.KVStore`), a layer's pages, tables and their store / load
(:mod:`.paged_kv`, :class:`~diffkv.cache.paged_kv.PagedKV`) and one layer's prefill and decode step over them
(:mod:`.compressor`, :class:`~diffkv.cache.compressor.LayerCompressor`; the prompt's importance scores in
:mod:`.scoring`). It imports ``diffkv.core`` (pure functions and data), ``diffkv.memory`` and ``diffkv.ops``; the
hosts (the transformers cache, the engine, the vLLM plug-in) import it (docs/design.md §1)."""
