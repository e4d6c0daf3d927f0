"""Count what a piece of host code asks of the device: kernel launches and host syncs, runnable without CUDA.

``with record_launches() as rec: ...`` counts, while the block runs:

* **torch launches** -- every aten op that reaches the dispatcher (a ``TorchDispatchMode``) and would run a kernel
  on a GPU: everything except views (``OpOverload.is_view``: ``view``, ``select``, ``expand``, ..), metadata
  queries (``sym_size``, ..), allocations without a fill (``empty``, ``empty_strided``, ..: counted apart as
  ``allocations``) and ``_local_scalar_dense`` (a sync, below). Fills (``zeros``, ``zero_``), copies (``clone``,
  ``copy_``, ``_to_copy``) and every compute op count one each. Composite ops count what they decompose into
  (``repeat_interleave`` over a scalar is ``expand`` + ``clone``: 1);
* **Triton launches** -- every call of a ``@triton.jit`` kernel (``JITFunction.run``, or under
  ``TRITON_INTERPRET=1`` ``InterpretedFunction.run``: the hook ``tests/conftest.py``'s ``DIFFKV_RECORD_LAUNCHES``
  uses). The interpreter's own tensor copies inside a launch are not counted;
* **host syncs** -- ``_local_scalar_dense`` (what ``.item()``, ``bool(t)``, ``int(t)``, ``float(t)`` call),
  ``Tensor.tolist()`` and ``Tensor.numpy()`` (on a CPU tensor they never reach the dispatcher, so the recorder
  wraps them while it runs), and copies from a non-CPU device to the CPU; a blocking CPU -> GPU copy also waits
  for the stream on CUDA and counts as a sync there (``non_blocking=True`` from pinned memory does not).

Every Triton launch is also kept in ``calls`` with its :func:`launch_signature` (argument values, tensor addresses,
grid): two steps whose launches have equal signatures can be captured once as a CUDA graph and replayed.

Counts go to the current *section* (default ``"main"``): ``with rec.section("finish"): ..`` or
``record_launches(sections={"finish": (DecodePlan, "finish")})``, which attributes every call of that method
(patched only while the recorder runs) to its section. Nothing is patched at import time.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
ALLOCATIONS = frozenset({_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                         _aten.new_empty.default, _aten.new_empty_strided.default, _aten.resize_.default})
FREE = frozenset({_aten.lift_fresh.default, _aten.detach.default, _aten._unsafe_view.default, _aten.sym_size.int,
                  _aten.sym_stride.int, _aten.sym_numel.default, _aten.sym_storage_offset.default,
                  _aten.is_same_size.default, _aten.set_.source_Storage_storage_offset,
                  _aten._has_compatible_shallow_copy_type.default})
SYNC_OPS = frozenset({_aten._local_scalar_dense.default})
COPIES = frozenset({_aten._to_copy.default, _aten.copy_.default})


@dataclass
class Counts:
    """What one section asked for: op or kernel name -> calls."""

    torch_launches: Counter = field(default_factory=Counter)
    triton_launches: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    allocations: Counter = field(default_factory=Counter)

    @property
    def launches(self) -> int:
        """Device kernel launches in all: torch ops plus Triton kernels."""
        return sum(self.torch_launches.values()) + sum(self.triton_launches.values())

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.torch_launches + other.torch_launches, self.triton_launches + other.triton_launches,
                      self.syncs + other.syncs, self.allocations + other.allocations)

    def summary(self) -> str:
        """One line: totals, then what each was."""
        parts = [f"{self.launches} launches ({sum(self.triton_launches.values())} triton)",
                 f"{self.num_syncs} syncs", f"{sum(self.allocations.values())} allocations"]
        names = dict(self.triton_launches) | {k: v for k, v in self.torch_launches.items()}
        detail = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in names.items())
        sync = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in self.syncs.items())
        return "; ".join(parts) + (f" [{detail}]" if detail else "") + (f" syncs: [{sync}]" if sync else "")


def launch_signature(args, kwargs) -> tuple:
    """What a captured CUDA graph bakes into one launch: each argument's value, a tensor's as (address, shape,
    stride, dtype); the grid too (a callable grid as its name). Two launches with the same signature can be one
    graph node replayed."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", a.data_ptr(), tuple(a.shape), a.stride(), str(a.dtype))
        if callable(a):
            return ("callable", getattr(a, "__name__", repr(a)))
        return a
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _devices(args) -> set[str]:
    return {a.device.type for a in args if isinstance(a, torch.Tensor)}


class LaunchRecorder(TorchDispatchMode):
    """The recorder :func:`record_launches` yields: ``sections[name]`` are the :class:`Counts` of each section,
    ``total()`` their sum."""

    def __init__(self, sections: dict[str, tuple[object, str]] | None = None):
        super().__init__()
        self.sections: dict[str, Counts] = {"main": Counts()}
        self._stack = ["main"]
        self._quiet = 0  # > 0 inside a Triton launch or a wrapped sync: the ops underneath are not counted
        self._wrap = dict(sections or {})
        self.calls: list[tuple[str, str, tuple]] = []  # (section, kernel, launch_signature) of every Triton launch

    @property
    def current(self) -> Counts:
        return self.sections.setdefault(self._stack[-1], Counts())

    def total(self) -> Counts:
        out = Counts()
        for c in self.sections.values():
            out = out + c
        return out

    @contextlib.contextmanager
    def section(self, name: str):
        """Count the block's work in section ``name``."""
        self._stack.append(name)
        try:
            yield self.sections.setdefault(name, Counts())
        finally:
            self._stack.pop()

    @contextlib.contextmanager
    def quiet(self):
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._quiet:
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func, args, kwargs) -> None:
        name = str(func.overloadpacket.__name__)
        if func in SYNC_OPS:
            self.current.syncs[name] += 1
        elif func in ALLOCATIONS:
            self.current.allocations[name] += 1
        elif func.is_view or func in FREE:
            return
        else:
            self.current.torch_launches[name] += 1
            if func in COPIES:
                self._count_transfer(func, args, kwargs)

    def _count_transfer(self, func, args, kwargs) -> None:
        """A copy between devices: to the CPU always waits for the device; to the device waits unless
        non_blocking."""
        if func is _aten._to_copy.default:
            src = _devices(args[:1])
            dst = {torch.device(kwargs.get("device") or args[0].device).type}
            blocking = not kwargs.get("non_blocking", False)
        else:
            src, dst = _devices(args[1:2]), _devices(args[:1])
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if src != dst and dst == {"cpu"}:
            self.current.syncs["copy to host"] += 1
        elif src != dst and blocking:
            self.current.syncs["blocking copy to device"] += 1


@contextlib.contextmanager
def _patched(owner, name: str, wrapper_of):
    """``owner.name`` replaced by ``wrapper_of(owner.name)`` for the block (inherited attributes come back by
    deleting the override)."""
    own = name in vars(owner)
    original = vars(owner)[name] if own else getattr(owner, name)
    setattr(owner, name, wrapper_of(original))
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def _triton_runners() -> list[type]:
    """The classes whose ``run`` launches a Triton kernel: the compiled one and, where present, the interpreter's."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton: nothing to hook
        return []
    runners: list[type] = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return runners
    return runners + [InterpretedFunction]


@contextlib.contextmanager
def record_launches(sections: dict[str, tuple[object, str]] | None = None):
    """Count launches and host syncs of the block (module docstring). sections: section name -> (class or module,
    attribute name) of a function whose calls count in that section. Yields the :class:`LaunchRecorder`."""
    rec = LaunchRecorder(sections)

    def launch(run):
        @functools.wraps(run)
        def counted(self, *args, **kwargs):
            if not rec._quiet:
                name = getattr(getattr(self, "fn", None), "__name__", "triton kernel")
                rec.current.triton_launches[name] += 1
                rec.calls.append((rec._stack[-1], name, launch_signature(args, kwargs)))
            with rec.quiet():
                return run(self, *args, **kwargs)
        return counted

    def sync(method, label):
        @functools.wraps(method)
        def counted(self, *args, **kwargs):
            if not rec._quiet:
                rec.current.syncs[label] += 1
            with rec.quiet():
                return method(self, *args, **kwargs)
        return counted

    def in_section(name):
        def wrap(fn):
            @functools.wraps(fn)
            def counted(*args, **kwargs):
                with rec.section(name):
                    return fn(*args, **kwargs)
            return counted
        return wrap

    with contextlib.ExitStack() as stack:
        for cls in _triton_runners():
            stack.enter_context(_patched(cls, "run", launch))
        stack.enter_context(_patched(torch.Tensor, "tolist", lambda m: sync(m, "tolist")))
        stack.enter_context(_patched(torch.Tensor, "numpy", lambda m: sync(m, "numpy")))
        for name, (owner, attr) in rec._wrap.items():
            stack.enter_context(_patched(owner, attr, in_section(name)))
        with rec:
            yield rec
