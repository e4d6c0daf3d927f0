"""Bytes an object holds, found by walking it: every tensor reachable through attributes and containers, each
storage counted once. An independent check of a cache's own accounting (``DiffKVCache.nbytes`` / ``stats()``).

Stops at ``torch.nn.Module`` (the model's weights are not the cache's), modules, classes and functions.
"""

from __future__ import annotations

import types

import torch

_SKIP = (torch.nn.Module, types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         str, bytes, int, float, bool, complex, type(None))


def owned_tensors(obj) -> dict[tuple[str, int], torch.Tensor]:
    """{(device, storage address): one tensor on that storage} for every tensor reachable from ``obj``."""
    found: dict[tuple[str, int], torch.Tensor] = {}
    seen: set[int] = set()
    stack = [obj]
    while stack:
        x = stack.pop()
        if id(x) in seen or isinstance(x, _SKIP):
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            found.setdefault((str(x.device), st.data_ptr()), x)
            continue
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend(x)
        else:
            stack.extend(getattr(x, "__dict__", {}).values())
            for cls in type(x).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(x, name):
                        stack.append(getattr(x, name))
    return found


def owned_bytes(obj) -> int:
    """Bytes of every tensor storage reachable from ``obj`` (see :func:`owned_tensors`)."""
    return sum(t.untyped_storage().nbytes() for t in owned_tensors(obj).values())
