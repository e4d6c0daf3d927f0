"""The DiffKV algorithm in plain torch, with no model library and no network: the configuration (:mod:`.config`,
:mod:`.tiers`, :mod:`.checks`, :mod:`.json_spec`), the quantization codec (:mod:`.quant`), the paged layout and
store (:mod:`.layout`, :mod:`.store`, :mod:`.paged_kv`), the token-importance policy (:mod:`.policy`), one layer's
compression and decode step (:mod:`.compressor`, :mod:`.attention`), its accounting (:mod:`.stats`), user errors
(:mod:`.errors`), byte sizes (:mod:`.units`) and the user folders (:mod:`.paths`). The device memory manager
(``diffkv.memory``), the kernels (``diffkv.kernels``) and their launchers (``diffkv.ops``) are core too. Everything
else in diffkv imports from here; nothing here imports from the rest."""
