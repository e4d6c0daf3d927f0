"""#59 item 3's precondition, checked on CPU: the serving engine's decode forward could be captured once as a CUDA
graph and replayed for the next steps of the same batch (Triton backend under the interpreter, a tiny model).

A graph bakes in every kernel's arguments: a replay is right only if the next step would launch the same kernels
with the same arguments, tensors at the same addresses, except those the forward itself makes (the graph's own
memory), and asks the host nothing in between. Recorded over two consecutive decode steps of three requests in one
width bucket (``KVStore.width_bucket``): the model's forward makes no host sync (the step's error-flag read is
``KVStore.end_step``, which the engine calls after the forward), runs the same aten ops on the same shapes, and
launches the same Triton kernels with equal arguments. What is not built: the capture itself (no GPU here), static
buffers for the forward's inputs, per-batch-size graphs."""

import torch
from test_engine import CharTokenizer, prompts, tiny
from torch.utils._python_dispatch import TorchDispatchMode

from diffkv import DiffKVConfig
from diffkv.engine import Engine, SamplingParams, make_cache
from diffkv.ops.launch_recorder import record_launches


class _Made(TorchDispatchMode):
    """The aten ops of a block (name, input shapes) and the addresses of their outputs (storage and data)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []
        self.addresses: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.addresses.update((o.untyped_storage().data_ptr(), o.data_ptr()))
        self.ops.append((str(func), tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
        return out


def _forward_of_one_step(eng, model):
    """(recorder, made) of the model forwards inside one engine step."""
    made = _Made()
    forward = type(model).forward

    def recorded(*args, **kwargs):
        with made:
            return forward(*args, **kwargs)

    type(model).forward = recorded
    try:
        with record_launches(sections={"forward": (type(model), "forward")}) as rec:
            eng.step()
    finally:
        type(model).forward = forward
    return rec, made


def _normalized(signature: tuple, made: set) -> tuple:
    """A launch signature with the address of every tensor the step's forward made replaced by "made"."""
    def one(x):
        if isinstance(x, tuple) and x[:1] == ("tensor",) and x[1] in made:
            return ("tensor", "made", *x[2:])
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):  # a keyword argument
            return (x[0], one(x[1]))
        return x
    return tuple(one(x) for x in signature)


def test_decode_forwards_of_one_batch_could_replay_one_graph():
    model = tiny()
    cache = make_cache("diffkv", model, kv_budget_bytes=1 << 20, raw_dtype="float32",
                       config=DiffKVConfig(recent_window=4, score_window=4), max_slots=4, max_model_len=128,
                       attention_backend="triton")
    cache.store.width_bucket = 32
    eng = Engine(model, CharTokenizer(), cache)
    for p in prompts(3, seed=5, lo=10, hi=14):
        eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for _ in range(3):  # prefill, then decodes: the three run together
        eng.step()
    (rec0, made0), (rec1, made1) = (_forward_of_one_step(eng, model) for _ in range(2))
    for rec in (rec0, rec1):
        forward = rec.sections["forward"]
        assert forward.num_syncs == 0, forward.summary()
        assert sum(forward.triton_launches.values()) >= 3 * len(cache.store.layers), forward.summary()
        assert rec.sections["main"].num_syncs >= 1  # the error flags and the sampled tokens: outside the forward
    assert made0.ops == made1.ops  # the same aten ops on the same shapes
    launches = [[c for c in rec.calls if c[0] == "forward"] for rec in (rec0, rec1)]
    assert [c[1] for c in launches[0]] == [c[1] for c in launches[1]]
    for (_, name, a), (_, _, b) in zip(*launches, strict=True):
        assert _normalized(a, made0.addresses) == _normalized(b, made1.addresses), name
