"""Errors a user can cause and fix: the CLI prints them in one line and exits 2 (a traceback only with --debug).

Raise :class:`UsageError` (or a subclass) for bad input, a missing file, an unknown name, a busy port: anything the
message alone tells the user how to fix. Bugs stay ordinary exceptions and keep their traceback.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input the user can fix; ``str(err)`` is the whole message (what is wrong and what to do)."""
