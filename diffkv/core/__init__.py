"""The DiffKV algorithm as pure functions and data, in plain torch, with no model library, no network and no device
memory manager: the configuration (:mod:`.config`, :mod:`.tiers`, :mod:`.checks`, :mod:`.json_spec`), the
quantization codec (:mod:`.quant`), the page plan and the byte-level token store (:mod:`.layout`, :mod:`.page_io`,
:mod:`.bookkeeping`), the token-importance policy (:mod:`.policy`), the reference attention over both tiers
(:mod:`.attention`), the accounting (:mod:`.stats`), user errors (:mod:`.errors`), byte sizes (:mod:`.units`), the
user folders (:mod:`.paths`) and the backend names (:mod:`.backends`). A module here imports only other modules here
(``tests/test_import_layers.py``): the memory manager (``diffkv.memory``), the kernels (``diffkv.kernels``) and their
launchers (``diffkv.ops``) sit above it, and the storage layer the hosts drive (``diffkv.cache``: pages, tables, one
layer's prefill and decode) above them."""
