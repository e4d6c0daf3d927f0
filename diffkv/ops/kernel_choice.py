"""Which implementation of a kernel runs: the one vocabulary of backends.

"auto", "torch" (the reference in ``diffkv.core``), "cpu" (compiled C on CPU: the decode step and the ring
operations, ``diffkv.ops.decode_step`` / ``diffkv.memory.alloc``) and "triton". The kernels without a compiled CPU
version (prefill scores, store, paged attention, place-store) take "auto", "torch" and "triton" and decide here.
"""

from __future__ import annotations

import os

KERNEL_BACKENDS = ("auto", "torch", "triton")


def use_triton(backend: str, on_cuda: bool) -> bool:
    """True to launch the Triton kernel, False to run the torch reference: "auto" picks Triton on CUDA only.

    Raises ValueError for a name outside :data:`KERNEL_BACKENDS`, and for "triton" on CPU unless the Triton
    interpreter is on (``TRITON_INTERPRET=1`` before triton is imported: the tests).
    """
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and not on_cuda):
        return False
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' on CPU needs TRITON_INTERPRET=1 set before triton is imported")
    return True
