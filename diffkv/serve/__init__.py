"""The HTTP front of the serving engine: an OpenAI-compatible server (:mod:`.server`, :mod:`.http_handler`,
:mod:`.openai_api`), its connection and request guards (:mod:`.http_conn`, :mod:`.http_guard`) and the
``diffkv serve`` command (:mod:`.serve_cli`). The engine itself is :mod:`diffkv.engine`."""
