"""Where an operation runs: the one vocabulary of backends, resolved once for a device.

The decode step (``diffkv.ops.decode_step``, ``attention_backend=``) and the ring operations (``diffkv.memory.alloc``,
``backend=`` of reserve / release) take the same words:

* ``"torch"``: the torch reference (any device);
* ``"triton"``: the Triton kernels (CUDA; on CPU only under ``TRITON_INTERPRET=1``, set before triton is imported,
  for tests);
* ``"cpu"``: a C library compiled on first use (CPU tensors only);
* ``"auto"``: Triton on CUDA; on CPU the compiled library where it builds here, else torch.

Each caller passes its compiled library (core imports nothing outside core): any object with ``available()``,
``library()`` and ``CompileError``, as ``diffkv.ops.decode_cpu`` and ``diffkv.memory.ring_cpu`` are.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol

import torch

BACKENDS = ("auto", "torch", "cpu", "triton")


class CompiledLibrary(Protocol):
    """A C implementation built on first use (a module such as ``diffkv.ops.decode_cpu``)."""

    __name__: str
    CompileError: type[Exception]

    def available(self) -> bool:
        """Whether it builds and loads here (builds it on the first call; False, with a logged reason, if not)."""

    def library(self) -> object:
        """Build (once) and load it; raises ``CompileError`` when it cannot be built."""


def resolve_backend(name: str, device: torch.device | str, *, what: str, compiled: CompiledLibrary,
                    aliases: Mapping[str, str] | None = None) -> str:
    """The backend ``name`` means on ``device``: "torch", "cpu" or "triton", checked now so a bad choice fails early.

    what: the argument's name in the messages ("attention_backend", "backend"); compiled: the library "cpu" runs
    (``available()`` decides "auto" on CPU; ``library()`` must build for an explicit "cpu"); aliases: old names
    accepted for current ones (``{"c": "cpu"}``). Raises ValueError for an unknown name, "cpu" off the CPU or when
    its library fails to build, and "triton" off CUDA without ``TRITON_INTERPRET=1``.
    """
    device = torch.device(device)
    if aliases:
        name = aliases.get(name, name)
    if name not in BACKENDS:
        raise ValueError(f"{what} must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpu" if device.type == "cpu" and compiled.available() else "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"{what}='cpu' runs on CPU tensors, not on {device}; use 'auto'")
        try:
            compiled.library()
        except compiled.CompileError as err:
            raise ValueError(f"{what}='cpu' needs the compiled {compiled.__name__}, which failed to build: {err}; "
                             f"use {what}='torch'") from err
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{what}='triton' needs a CUDA device (or TRITON_INTERPRET=1 set before triton is imported, "
                         "for tests); use 'auto'")
    return name
