"""The vLLM plug-in's attention backend (diffkv/integrations/vllm/backend.py) and KV connector (connector.py),
without vLLM.

CI has no vLLM, so the real-engine tests (tests/test_vllm_plugin.py) skip there. Here the few vLLM modules the
plug-in imports are minimal fakes put in ``sys.modules`` by the fixture ``vllm`` (also where vLLM is installed):
``vllm.v1.attention.backend`` (generic base classes, AttentionType, CommonAttentionMetadata),
``vllm.v1.kv_cache_layout``, ``vllm.v1.attention.backends.registry`` (``register_backend`` records its calls),
``vllm.distributed.kv_transfer.kv_connector.v1.base`` (KVConnectorBase_V1 and the metadata bases) and
``vllm.forward_context`` (the step's attention metadata, set by the test), with their parent packages. backend.py
and connector.py are imported afresh against the fakes and dropped again afterwards, so no module bound to the
fakes leaks into other test files. What vLLM would hand the plug-in (its config, the layers' KV-cache spec, each
step's batch metadata, SchedulerOutput, the scheduler's block pool) is built here as plain objects; the batches
and the SDPA reference come from tests/test_vllm_store.py.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import logging
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Generic, TypeVar

import pytest
import torch
from test_vllm_store import BLOCK, H_KV, H_Q, LAYERS, D, Sequences, make_store, run_step

from diffkv.integrations.vllm import BACKEND, CPU_SWITCH
from diffkv.integrations.vllm.admission import PoolReport
from diffkv.integrations.vllm.settings import ADMIT_ENV, CONFIG_ENV, PROFILE_ENV, read_settings
from diffkv.integrations.vllm.worker_pages import VllmKVStore

PLUGIN = ("diffkv.integrations.vllm.backend", "diffkv.integrations.vllm.connector")
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
M = TypeVar("M")


def fake_vllm_modules() -> tuple[dict[str, types.ModuleType], list]:
    """name -> fake module (parent packages included), and the list ``register_backend`` appends its calls to."""
    class AttentionBackend(Generic[M]):
        pass

    class AttentionImpl(Generic[M]):
        pass

    class AttentionMetadataBuilder(Generic[M]):
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            self.kv_cache_spec, self.layer_names, self.vllm_config, self.device = (kv_cache_spec, layer_names,
                                                                                   vllm_config, device)

    @dataclass
    class CommonAttentionMetadata:  # the fields the builder reads
        query_start_loc_cpu: torch.Tensor
        seq_lens: torch.Tensor
        num_actual_tokens: int
        num_reqs: int
        block_table_tensor: torch.Tensor
        causal: bool | torch.Tensor = True

    class KVConnectorBase_V1:  # noqa: N801 (vLLM's name)
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._vllm_config, self._role, self._connector_metadata = vllm_config, role, None

        def bind_kv_cache_manager(self, kv_cache_manager):
            self._kv_cache_manager = kv_cache_manager

        def bind_connector_metadata(self, connector_metadata):
            self._connector_metadata = connector_metadata

        def update_connector_output(self, connector_output):
            pass

    calls = []
    forward = SimpleNamespace(attn_metadata=None)  # the test sets it, as vLLM's set_forward_context does
    contents = {
        "vllm.logger": dict(init_logger=logging.getLogger),
        "vllm.forward_context": dict(get_forward_context=lambda: forward, is_forward_context_available=lambda: True,
                                     forward=forward),
        "vllm.v1.attention.backend": dict(
            AttentionBackend=AttentionBackend, AttentionImpl=AttentionImpl,
            AttentionMetadataBuilder=AttentionMetadataBuilder, CommonAttentionMetadata=CommonAttentionMetadata,
            AttentionType=SimpleNamespace(DECODER="decoder", ENCODER="encoder")),
        "vllm.v1.kv_cache_layout": dict(KVCacheLayout=enum.Enum("KVCacheLayout", "NHD HND LBHNC")),
        "vllm.v1.attention.backends.registry": dict(
            AttentionBackendEnum=enum.Enum("AttentionBackendEnum", "CUSTOM CPU_ATTN"),
            register_backend=lambda backend, class_path=None: calls.append((backend.name, class_path))),
        "vllm.distributed.kv_transfer.kv_connector.v1.base": dict(
            KVConnectorBase_V1=KVConnectorBase_V1, KVConnectorRole=enum.Enum("KVConnectorRole", "SCHEDULER WORKER"),
            KVConnectorMetadata=type("KVConnectorMetadata", (), {}),
            KVConnectorWorkerMetadata=type("KVConnectorWorkerMetadata", (), {})),
    }
    modules: dict[str, types.ModuleType] = {}
    for name, attrs in contents.items():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            if sub not in modules:
                modules[sub] = types.ModuleType(sub)
                modules[sub].__path__ = []
                if i > 1:
                    setattr(modules[".".join(parts[:i - 1])], parts[i - 1], modules[sub])
        modules[name].__dict__.update(attrs)
    return modules, calls


@pytest.fixture
def vllm(monkeypatch):
    """The fakes installed, backend.py and connector.py imported against them (and removed afterwards), the
    backend's settings ``DIFFKV_VLLM_CONFIG=exact``."""
    modules, calls = fake_vllm_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    package = importlib.import_module("diffkv.integrations.vllm")
    for name in PLUGIN:  # monkeypatch puts back whatever was there before (e.g. the real-vLLM import)
        monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.delattr(package, name.rpartition(".")[2], raising=False)
    for env in (PROFILE_ENV, ADMIT_ENV, CPU_SWITCH):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv(CONFIG_ENV, "exact")
    backend, connector = (importlib.import_module(name) for name in PLUGIN)
    base = modules["vllm.distributed.kv_transfer.kv_connector.v1.base"]
    yield SimpleNamespace(backend=backend, connector=connector, calls=calls, Role=base.KVConnectorRole,
                          Common=modules["vllm.v1.attention.backend"].CommonAttentionMetadata,
                          forward=modules["vllm.forward_context"].forward)
    for name in PLUGIN:
        module = sys.modules.pop(name, None)
        if module is not None and getattr(package, name.rpartition(".")[2], None) is module:
            delattr(package, name.rpartition(".")[2])


@dataclass(frozen=True)
class Spec:
    """vLLM's attention ``KVCacheSpec`` as far as the backend reads it (``dataclasses.replace`` works on it)."""

    block_size: int = BLOCK
    num_kv_heads: int = H_KV
    head_size: int = D
    dtype: torch.dtype = torch.float32
    state_content_bytes: int | None = None

    @property
    def page_size_bytes(self) -> int:  # one vLLM block of one layer
        return self.block_size * self.num_kv_heads * self.state_content_bytes


def config(prefix_caching=False, chunked_prefill=False, connector=None, max_num_seqs=64):
    return SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching, block_size=BLOCK),
                           scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked_prefill,
                                                            max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
                           model_config=SimpleNamespace(max_model_len=256, get_head_size=lambda: D,
                                                        dtype=torch.float32),
                           kv_transfer_config=connector and SimpleNamespace(kv_connector=connector))


def builder(vllm, spec=None, **cfg):
    spec = spec or vllm.backend.DiffKVAttentionBackend.customize_spec(Spec())
    return vllm.backend.DiffKVMetadataBuilder(spec, LAYER_NAMES[::-1], config(**cfg), torch.device("cpu"))


def vllm_worker(build):
    """What ``LLM.collective_rpc`` hands ``worker_stats``: a worker whose model runner holds the builder."""
    group = SimpleNamespace(get_metadata_builder=lambda: build)
    return SimpleNamespace(model_runner=SimpleNamespace(attn_groups=[[SimpleNamespace(get_metadata_builder=lambda:
                                                                                      None), group]]))


def common(vllm, starts, lengths, table, causal=True):
    """vLLM's batch metadata, padded as vLLM pads it (a spare request row past num_reqs)."""
    return vllm.Common(query_start_loc_cpu=torch.tensor(starts + [starts[-1]], dtype=torch.int32),
                       seq_lens=torch.tensor(lengths + [0], dtype=torch.int32), num_actual_tokens=starts[-1],
                       num_reqs=len(lengths), causal=causal,
                       block_table_tensor=torch.cat([table, torch.zeros(1, table.shape[1], dtype=torch.int32)]))


def test_prefill_and_decode_through_the_backend_equal_sdpa(vllm, monkeypatch):
    torch.manual_seed(0)
    b = vllm.backend
    spec = b.DiffKVAttentionBackend.customize_spec(Spec())
    build = builder(vllm, spec)
    blocks = 48  # vLLM's allocation: one buffer, each layer's KV tensor a typed view of its part
    buffer = torch.zeros(LAYERS * blocks * spec.page_size_bytes, dtype=torch.uint8)
    part = blocks * spec.page_size_bytes
    caches = [buffer[i * part:(i + 1) * part].view(torch.float32).view(blocks, -1) for i in range(LAYERS)]
    impl = b.DiffKVAttentionImpl(H_Q, D, D ** -0.5, H_KV, logits_soft_cap=0.0)  # 0: no cap
    layers = [SimpleNamespace(layer_name=name) for name in LAYER_NAMES]
    plans, plan_step = [], VllmKVStore.plan_step
    monkeypatch.setattr(VllmKVStore, "plan_step", lambda self, *a: plans.append(plan_step(self, *a)) or plans[-1])

    q = torch.randn(5, H_Q, D)  # warm-up run: no metadata, output untouched, no store built
    out = torch.full_like(q, 7.0)
    assert impl.forward(layers[0], q, q[:, :H_KV], q[:, :H_KV], caches[0], None, out) is out
    assert (out == 7.0).all() and b.worker_stats(vllm_worker(build)) is None and build.worker.store is None

    seqs, next_block, pad = Sequences(), [100], 3
    for new, decode in [({"a": (1, 23), "b": (2, 40), "c": (3, 9)}, [])] + [({}, ["a", "b", "c"])] * 3:
        names, table, starts, lengths, step = seqs.batch(new, decode, next_block)
        meta = build.build(0, common(vllm, starts, lengths, table))
        assert (meta.query_start_loc, meta.seq_lens, meta.block_size) == (starts, lengths, BLOCK)
        assert meta.block_table.shape[0] == len(names) and meta.plan is None and meta.worker is build.worker
        n, before = starts[-1], len(plans)
        for i, (q, k, v) in enumerate(step):
            padded = [torch.cat([x, torch.randn(pad, *x.shape[1:])]) for x in (q, k, v)]  # vLLM's padding rows
            out = torch.full_like(padded[0], 7.0)
            assert impl.forward(layers[i], *padded, caches[i], meta, out) is out
            want = seqs.reference(names, starts, i, q, k, v, D ** -0.5)
            torch.testing.assert_close(out[:n], want, atol=2e-5, rtol=1e-4)
            assert (out[n:] == 7.0).all()
        assert len(plans) == before + 1 and meta.plan is plans[-1]  # planned by the first layer, shared
        assert plans[-1].kinds == (["prefill"] * 3 if new else ["decode"] * 3)

    store = build.worker.store
    pool = store.kv.pool
    assert store.backend == "cpu"  # "auto" on CPU: the compiled step (conftest stops the run if it does not build)
    assert pool.borrowed and pool.data.data_ptr() == buffer.data_ptr()  # the whole buffer, not one layer's view
    assert store.kv.tables.shape[0] == blocks and store.kv.tables.rows.data_ptr() > pool.data.data_ptr()
    stats = b.worker_stats(vllm_worker(build))  # pages, tables and key vectors: all in vLLM's buffer
    assert stats["buffer_bytes"] == buffer.nbytes
    assert stats["pool_bytes"] + stats["table_bytes"] + stats["key_vector_bytes"] <= buffer.nbytes
    assert b.worker_stats(vllm_worker(build))["requests"] == 3
    assert build.worker.layers == {n: i for i, n in enumerate(LAYER_NAMES)}
    assert b.worker_stats(vllm_worker(builder(vllm))) is None  # another engine's builder: its own state


@pytest.mark.parametrize("connector, slots", [(None, 48), ("DiffKVConnector", 6 + 8), ("OtherConnector", 48)])
def test_slots_are_twice_the_running_requests_with_the_diffkv_connector(vllm, connector, slots):
    """Without the connector an ended request holds its slot until vLLM reuses its first block: one per block. With
    it, twice the running requests and one per shared prefix (DIFFKV_VLLM_PREFIXES, 8)."""
    spec = vllm.backend.DiffKVAttentionBackend.customize_spec(Spec())
    build = builder(vllm, spec, connector=connector, max_num_seqs=3)
    store = build.worker.store_over(torch.zeros(LAYERS * 48 * spec.page_size_bytes, dtype=torch.uint8))
    assert store.kv.tables.shape[0] == slots


def test_prefix_caching_needs_the_diffkv_connector_and_chunked_prefill_runs(vllm):
    with pytest.raises(ValueError, match="prefix caching is on without the DiffKV KV connector") as err:
        builder(vllm, prefix_caching=True)
    assert "--no-enable-prefix-caching" in str(err.value) and "--kv-transfer-config" in str(err.value)
    with pytest.raises(ValueError, match="prefix caching is on"):
        builder(vllm, prefix_caching=True, connector="OtherConnector")
    assert builder(vllm, prefix_caching=True, connector="DiffKVConnector").worker is not None
    assert builder(vllm, chunked_prefill=True).worker is not None


@pytest.mark.parametrize("causal", [False, torch.tensor([True, False]), torch.tensor([True, True])])
def test_non_causal_metadata_is_refused(vllm, causal):
    build, table = builder(vllm), torch.tensor([[1], [2]], dtype=torch.int32)
    assert build.build(0, common(vllm, [0, 4, 9], [4, 5], table)).num_reqs == 2
    with pytest.raises(NotImplementedError, match="causal decoder attention only"):
        build.build(0, common(vllm, [0, 4, 9], [4, 5], table, causal=causal))


@pytest.mark.parametrize("kwargs, named", [
    (dict(alibi_slopes=[0.5] * H_Q), "alibi_slopes"), (dict(sliding_window=64), "sliding_window"),
    (dict(sinks=torch.zeros(H_Q)), "sinks"), (dict(logits_soft_cap=30.0), "logits_soft_cap"),
    (dict(kv_sharing_target_layer_name=LAYER_NAMES[0]), "kv_sharing_target_layer_name"),
    (dict(kv_cache_dtype="fp8"), "fp8"), (dict(attn_type="encoder"), "encoder")])
def test_unsupported_impl_arguments_are_refused_by_name(vllm, kwargs, named):
    with pytest.raises(NotImplementedError, match=f"does not support .*{named}"):
        vllm.backend.DiffKVAttentionImpl(H_Q, D, D ** -0.5, H_KV, **kwargs)


def test_fused_output_quantization_is_refused(vllm):
    impl, x = vllm.backend.DiffKVAttentionImpl(H_Q, D, D ** -0.5, H_KV), torch.zeros(2, H_Q, D)
    for scales in (dict(output_scale=torch.ones(1)), dict(output_block_scale=torch.ones(1))):
        with pytest.raises(NotImplementedError, match="fused output quantization"):
            impl.forward(SimpleNamespace(layer_name=LAYER_NAMES[0]), x, x, x, x, None, x, **scales)


def test_layer_order_sorts_by_the_layer_number(vllm):
    names = ["model.layers.10.self_attn.attn", "model.layers.2.self_attn.attn", "model.layers.0.attn"]
    assert vllm.backend.layer_order(names) == {names[2]: 0, names[1]: 1, names[0]: 2}  # 2 before 10
    with pytest.raises(ValueError, match="cannot tell the layer index of attention layer 'lm_head.attn'"):
        vllm.backend.layer_order([names[0], "lm_head.attn"])


@pytest.mark.parametrize("admit, dtype, block, want", [
    ("safe", torch.float32, 16, 464), ("safe", torch.float32, 32, 368), ("4", torch.float16, 16, 32),
    ("4", torch.float32, 16, 64), ("8", torch.bfloat16, 16, 16)])
def test_customize_spec_charges_what_the_settings_say(vllm, monkeypatch, admit, dtype, block, want):
    """exact (1056-B pages of 4 tokens): safe = 1056 / 4 + 3 * 1056 / block rounded up to 8; ratio r: 2 D bytes / r."""
    monkeypatch.setenv(ADMIT_ENV, admit)
    spec = Spec(block_size=block, dtype=dtype)
    got = vllm.backend.DiffKVAttentionBackend.customize_spec(spec)
    name = str(dtype).removeprefix("torch.")
    assert got.state_content_bytes == read_settings(D, name).bytes_per_token(D, block, dtype.itemsize) == want
    assert dataclasses.replace(got, state_content_bytes=None) == spec and spec.state_content_bytes is None


def scheduler_output(new=(), cached=(), resumed=(), finished=(), preempted=None):
    """new: (req_id, block ids); cached: (req_id, new block ids or None), both of vLLM's one KV-cache group."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(ids),)) for r, ids in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached], resumed_req_ids=set(resumed),
                                              new_block_ids=[ids and (list(ids),) for _, ids in cached]),
        finished_req_ids=set(finished), preempted_req_ids=preempted)


def reported(vllm, free, a=2.0, b=10, per_token=0.0):
    return SimpleNamespace(kv_connector_worker_meta=vllm.connector.DiffKVWorkerMetadata(PoolReport(free, a, b,
                                                                                                   per_token)))


def test_scheduler_side_reports_the_first_blocks_of_requests_that_ended(vllm):
    c = vllm.connector.DiffKVConnector(config(), vllm.Role.SCHEDULER)
    step = lambda **kw: sorted(c.build_connector_meta(scheduler_output(**kw)).ended)
    assert step(new=[("a", [5, 6]), ("b", [7]), ("d", [8]), ("e", [])]) == []  # e has no block yet
    assert step(finished=["a", "ghost"], preempted={"b"}, cached=[("d", [12])]) == [5, 7]
    assert step(cached=[("b", [9, 10]), ("d", [11]), ("f", None)], resumed=["b", "f"]) == []  # b recomputed
    assert c.admission.first == {"d": 8, "b": 9}  # d's new block is not its first
    assert step(finished=["b", "d"], preempted=set()) == [8, 9]


def test_new_requests_skip_reading_vllm_prefix_cache(vllm):
    """vLLM's KVCacheManager looks up no cached prefix for a request with ``skip_reading_prefix_cache`` set."""
    c = vllm.connector.DiffKVConnector(config(prefix_caching=True), vllm.Role.SCHEDULER)
    request = SimpleNamespace(request_id="a", skip_reading_prefix_cache=False, prompt_token_ids=[1, 2, 3],
                              kv_transfer_params=None, sampling_params=SimpleNamespace(max_tokens=4))
    c.on_new_request(request)
    assert request.skip_reading_prefix_cache is True


def test_scheduler_side_admits_prompts_the_reported_pool_can_take(vllm):
    c = vllm.connector.DiffKVConnector(config(), vllm.Role.SCHEDULER)
    ask = lambda tokens: c.get_num_new_matched_tokens(SimpleNamespace(request_id="r", num_tokens=tokens), 0)
    assert ask(100) == (0, False) and ask(5) == (None, False)  # before any report: one prompt at a time
    c.build_connector_meta(scheduler_output(new=[("a", [1])]))
    c.update_connector_output(reported(vllm, 1000))  # a prompt of n tokens: 2n + 10 pages; one running request
    assert ask(495) == (None, False)  # 1000 pages: none left for a's next step (10)
    assert ask(490) == (0, False)  # 990 pages: 10 left
    assert ask(1) == (None, False)  # 12 more pages than the report has
    c.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None))  # no report: nothing changes
    assert ask(1) == (None, False)
    c.update_connector_output(reported(vllm, 1000))
    assert ask(1) == (0, False)


def test_scheduler_side_holds_back_vllm_blocks_beyond_the_room_the_pools_report(vllm):
    class BlockPool:
        def __init__(self, n):
            self.free = list(range(1, n + 1))

        def get_num_free_blocks(self):
            return len(self.free)

        def get_new_blocks(self, n):
            assert 0 < n <= len(self.free)
            taken, self.free = self.free[:n], self.free[n:]
            return taken

        def free_blocks(self, blocks):
            self.free.extend(blocks)

    c, pool = vllm.connector.DiffKVConnector(config(), vllm.Role.SCHEDULER), BlockPool(200)
    c.update_connector_output(reported(vllm, 10))  # no KVCacheManager bound yet: nothing to hold back
    c.bind_kv_cache_manager(SimpleNamespace(block_pool=pool))
    c.build_connector_meta(scheduler_output(new=[("a", [1]), ("b", [2])]))
    # observed 0.5 pages per token: 8 pages per block of 16; two running requests keep 2 * (8 + 10) pages
    for free, room, held in ((1000, 120, 80), (1200, 145, 55), (4000, 495, 0), (20, 0, 200), (300, 33, 167),
                              (292, 32, 168)):
        c.update_connector_output(reported(vllm, free, a=4.0, per_token=0.5))
        assert c.admission.room_blocks(BLOCK) == room == max(0, free - 36) // 8
        assert (pool.get_num_free_blocks(), len(c._held)) == (min(room, 200), held)
        assert sorted(pool.free + c._held) == list(range(1, 201))  # every block is vLLM's or held, once


def test_worker_side_releases_ended_requests_and_reports_its_pool(vllm, monkeypatch):
    torch.manual_seed(1)
    c, Meta = vllm.connector.DiffKVConnector(config(), vllm.Role.WORKER), vllm.connector.DiffKVConnectorMetadata
    c.bind_connector_metadata(Meta(ended=[1]))  # no step metadata yet: nothing to release
    assert c.build_connector_worker_meta() is None
    worker = builder(vllm).worker
    vllm.forward.attn_metadata = {LAYER_NAMES[0]: SimpleNamespace(worker=worker)}  # a step's metadata, no store yet
    c.bind_connector_metadata(Meta(ended=[1]))
    assert c.build_connector_worker_meta() is None
    store, _ = make_store(monkeypatch)  # the store the backend would build (exact config, 2 layers of 2 heads)
    worker.store = store
    vllm.forward.attn_metadata = None  # a step without attention (vLLM's no-forward path): the worker seen last
    full = store.free_pages()
    run_step(store, Sequences(), {"a": (1, 20), "b": (2, 20), "c": (3, 20)}, [], [100], check=False)
    held = full - store.free_pages()
    assert held > 0 and held % 3 == 0  # three prompts of the same length
    # a prompt of n tokens: at most n * 4 heads / 4 tokens per page + a partial page per head (one tier: exact)
    assert c.build_connector_worker_meta().report == PoolReport(full - held, 1.0, 4, held / 60)
    c.bind_connector_metadata(Meta(ended=[1, 3, 99]))
    assert c._connector_metadata.ended == [1, 3, 99] and sorted(store.slot_of) == [2]
    assert store.free_pages() == full - held // 3
    c.bind_connector_metadata(Meta(ended=[2]))
    assert store.free_pages() == full and store.slot_of == {} and store.kv.tables.active_slots == frozenset()
    store.kv.pool.check_invariants(store.kv.tables)
    assert c.build_connector_worker_meta().report == PoolReport(full, 1.0, 4, 0.0)
    one, two = (vllm.connector.DiffKVWorkerMetadata(r) for r in (PoolReport(50, 1.0, 4, 0.1), PoolReport(40, 2.0, 3)))
    assert one.aggregate(two) == vllm.connector.DiffKVWorkerMetadata(PoolReport(40, 2.0, 4, 0.1))


@pytest.mark.parametrize("switch, registered", [(None, ["CUSTOM"]), ("0", ["CUSTOM"]), ("", ["CUSTOM"]),
                                                ("1", ["CUSTOM", "CPU_ATTN"])])
def test_register_adds_cpu_attn_only_with_the_switch(vllm, monkeypatch, switch, registered):
    from diffkv.integrations.vllm import register

    if switch is not None:
        monkeypatch.setenv(CPU_SWITCH, switch)
    register()
    assert vllm.calls == [(name, BACKEND) for name in registered]
    module, _, cls = BACKEND.rpartition(".")
    assert getattr(sys.modules[module], cls) is vllm.backend.DiffKVAttentionBackend  # the path names the class


PEAK = '{"importance": "peak", "alpha_high": 2.0, "alpha_low": 0.5}'


def request(rid, prompt, params=None, max_tokens=8):
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, num_tokens=len(prompt),
                           num_prompt_tokens=len(prompt), num_computed_tokens=0, kv_transfer_params=params,
                           sampling_params=SimpleNamespace(max_tokens=max_tokens), skip_reading_prefix_cache=False)


def test_scheduler_side_reports_a_primed_prefix_as_an_external_hit_and_never_reads_vllm_prefix_cache(vllm,
                                                                                                    monkeypatch):
    from diffkv.integrations.vllm.prefix_map import prefix_key, prime_prompt, reader_params

    monkeypatch.setenv(CONFIG_ENV, PEAK)
    c = vllm.connector.DiffKVConnector(config(prefix_caching=True), vllm.Role.SCHEDULER)
    c.update_connector_output(reported(vllm, 10 ** 6))
    prefix = [5] * 20
    prime, reader = request("p", *prime_prompt(prefix, [1]), max_tokens=1), request("r", prefix + [9] * 4,
                                                                                    reader_params(20))
    for r in (prime, reader):
        c.on_new_request(r)
        assert r.skip_reading_prefix_cache is True
    assert c.get_num_new_matched_tokens(prime, 0) == (0, False)
    assert c.get_num_new_matched_tokens(reader, 0) == (None, False)  # its prefix is being primed: it waits
    meta = c.build_connector_meta(scheduler_output(new=[("p", [40, 41, 42])]))
    assert meta.primes == {40: c.prefixes.prime_of("p")} and meta.attach == {}
    prime.num_computed_tokens = prime.num_tokens
    assert c.request_finished(prime, [40, 41, 42]) == (False, None)
    assert c.get_num_new_matched_tokens(reader, 0) == (20, False)
    assert reader.skip_reading_prefix_cache is False  # vLLM zeroes a skipping request's external hit
    c.update_state_after_alloc(reader, SimpleNamespace(get_block_ids=lambda: ([50, 51],)), 20)
    assert reader.skip_reading_prefix_cache is True
    meta = c.build_connector_meta(scheduler_output(new=[("r", [50, 51])]))
    assert meta.attach == {50: prefix_key(prefix)} and meta.primes == {}
    reader.skip_reading_prefix_cache = False  # vLLM skipped it after the hit and then found a local hit: wait
    assert c.get_num_new_matched_tokens(reader, 16) == (None, False) and reader.skip_reading_prefix_cache is True


def test_primes_are_taken_with_mean_scores_and_refused_with_score_after_window(vllm, monkeypatch):
    """#62: a prime is placed by the config's context point, so the exact (mean-score) settings take it; only a
    config whose window exit resets the frozen scores refuses it, and says why (before any store exists)."""
    c = vllm.connector.DiffKVConnector(config(prefix_caching=True), vllm.Role.SCHEDULER)  # exact: mean scores
    assert c.prefixes.refuse_primes is None
    c.on_new_request(request("p", [5, 1, 5], {"diffkv_prime": 1}, max_tokens=1))
    assert c.prefixes.prime_of("p") is not None
    monkeypatch.setenv(CONFIG_ENV, '{"score_after_window": true}')
    c = vllm.connector.DiffKVConnector(config(prefix_caching=True), vllm.Role.SCHEDULER)
    assert "score_after_window=False" in c.prefixes.refuse_primes
    prime = request("p", [5, 1, 5], {"diffkv_prime": 1}, max_tokens=1)
    c.on_new_request(prime)
    assert c.prefixes.prime_of("p") is None
    worker = builder(vllm).worker
    worker.update_prefixes({7: "prime"}, {}, [])
    assert worker.early_primes == {7: "prime"} and worker.store is None
