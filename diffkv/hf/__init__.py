"""transformers plumbing shared by every cache and the engine: model shapes (:mod:`~diffkv.hf.shape`), the
``diffkv`` attention function and its router (:mod:`~diffkv.hf.routing`), and the base class of cache layers that
compute their own attention (:mod:`~diffkv.hf.layer`). Depends on the core only; the caches
(``diffkv.integrations``, ``diffkv.baselines``) and the engine build on it."""
