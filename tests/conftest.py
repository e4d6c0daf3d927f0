"""Test setup: Triton runs under its CPU interpreter unless a GPU is present; `gpu` tests skip without CUDA."""

import os

import torch

# NOTE: must be set before any module with @triton.jit code is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_sessionstart(session):
    """The compiled CPU paths are part of what the suite tests: if they do not build, stop the run loudly instead of
    passing with their cases gone. ``DIFFKV_TORCH_ONLY=1`` starts the run anyway, on purpose (their cases then
    fail, each with the reason)."""
    if os.environ.get("DIFFKV_TORCH_ONLY") == "1":
        return
    from diffkv.memory import ring_cpu
    from diffkv.ops import decode_cpu

    missing = [name for name, lib in (("diffkv.memory.ring_cpu", ring_cpu), ("diffkv.ops.decode_cpu", decode_cpu))
               if not lib.available()]
    if missing:
        pytest.exit(f"the compiled CPU paths {missing} did not build (see the diffkv warning above for the compiler's "
                    "error): install gcc or set $CC (DIFFKV_TORCH_ONLY=1 starts the run anyway; their cases then "
                    "fail)", returncode=1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _record_interpreted_launches(path: str) -> None:
    """Append every interpreted Triton launch (kernel, argument dtypes and values) to ``path`` as JSON lines.

    Set ``DIFFKV_RECORD_LAUNCHES=path`` to feed ``benchmarks/gpu/compile_sm90.py``, which compiles the same launches
    for an H200 without one. Test-only: wraps the interpreter's ``run`` for this pytest process.
    """
    import json

    from triton.runtime.interpreter import InterpretedFunction

    def spec(x):
        if isinstance(x, torch.Tensor):
            return {"tensor": str(x.dtype).removeprefix("torch.")}
        if isinstance(x, (bool, int, float, str)) or x is None:
            return {"value": x}
        raise TypeError(f"cannot record a {type(x).__name__} kernel argument")

    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        entry = {"kernel": f"{self.fn.__module__}:{self.fn.__qualname__}", "args": [spec(a) for a in args],
                 "kwargs": {k: spec(v) for k, v in kwargs.items()}}
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


if os.environ.get("DIFFKV_RECORD_LAUNCHES") and os.environ.get("TRITON_INTERPRET") == "1":
    _record_interpreted_launches(os.environ["DIFFKV_RECORD_LAUNCHES"])
