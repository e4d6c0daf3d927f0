"""Plan once per decode step, run per layer (#59 item 1), on the Triton backend under the interpreter.

A layer's planned step makes no host sync and at most 3 launches (place-store with the key/query transforms fused,
attention split, reduce); the step's own work (positions to the device, the error flags read once) is bounded; the
outputs, pages and scores equal the torch reference's step from the same state; a plan used for another layer,
heads or batch, or a layer run twice, raises ValueError; a non-finite token or positions below the stored tokens
are reported once per step, naming the layers, without reading or writing out of bounds.
"""

import copy

import pytest
import torch

from diffkv import DiffKVConfig
from diffkv.cache.kv_store import KVStore
from diffkv.core.layout import plan_for_config
from diffkv.memory import HIGH_COL, LOW_COL
from diffkv.ops.decode_plan import DecodePlan, DecodeWorkspace, PlanBuffers, build_plan, tier_bounds
from diffkv.ops.launch_recorder import record_launches
from diffkv.ops.paged_attention import paged_decode_attention
from diffkv.ops.reference import paged_decode_attention_ref

AGGRESSIVE = dict(recent_window=4, score_window=4, alpha_high=2.0, alpha_low=0.6)  # every placement case fires
SCALE = 0.125
HKV, G, D = 2, 2, 64


def prefilled(backend: str = "triton", page_bytes: int = 1024, device: str = "cpu", **kw) -> tuple[KVStore, list[int]]:
    """A store of 2 layers holding two prompts (13 tokens, and 8 left-padded) of random K/V."""
    cfg = DiffKVConfig(page_bytes=page_bytes, **AGGRESSIVE, **kw)
    store = KVStore(cfg, plan_for_config(cfg, D), num_layers=2, num_kv_heads=HKV, max_slots=3, max_seq_len=128,
                    device=device, attention_backend=backend, budget_bytes=1 << 22)
    slots = [store.open_slot(), store.open_slot()]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 13, D, generator=gen).to(device) * 3 for h in (HKV * G, HKV, HKV))
    valid = torch.ones(2, 13, dtype=torch.bool, device=device)
    valid[1, :5] = False
    for layer in store.layers:
        store.prefill(layer, slots, q, k, v, valid, SCALE)
    return store, slots


def reference_of(store: KVStore) -> KVStore:
    """A copy of the store's state that decodes with the torch backend."""
    ref = copy.deepcopy(store)
    ref.backend, ref._plans, ref._step, ref._decode = "torch", {}, None, None
    return ref


def new_token(gen: torch.Generator, batch: int = 2):
    return (torch.randn(batch, HKV * G, D, generator=gen), torch.randn(batch, HKV, D, generator=gen) * 3,
            torch.randn(batch, HKV, D, generator=gen))


def assert_same_state(store: KVStore, ref: KVStore) -> None:
    """Same counts and tables, bit-identical pages outside the score fields, scores within float rounding."""
    kv = store.kv
    assert torch.equal(kv.tables.counts, ref.kv.tables.counts) and torch.equal(kv.tables.table, ref.kv.tables.table)
    mask = torch.zeros(kv.pool.data.shape, dtype=torch.bool)
    for lay in kv.layouts.values():
        mask[:, lay.score_offset:lay.score_offset + lay.score_bytes * lay.tokens_per_page] = True
    assert torch.equal(kv.pool.data[~mask], ref.kv.pool.data[~mask]), "stored K/V, metadata or positions differ"
    scores = [s.kv.pool.data[mask].view(s.kv.score_dtype).float() for s in (store, ref)]
    torch.testing.assert_close(scores[0], scores[1], atol=1e-5, rtol=2e-3 if kv.compact else 1e-5, equal_nan=True)


@pytest.mark.parametrize("config,launches", [
    (dict(), 3),  # smooth keys (the default): centers and scales applied in the place-store kernel
    (dict(center_keys=True, smooth_keys=False, rotate_values=True, compact_meta=True, score_after_window=True), 5),
], ids=["smooth-keys", "center-keys-rotate-values-compact"])
def test_planned_layer_step_makes_no_sync_and_three_launches_and_matches_the_reference(config, launches, capsys):
    """rotate_values adds its two matmuls (values in, output back: 5 launches); everything else is 3."""
    store, slots = prefilled(**config)
    gen = torch.Generator().manual_seed(1)
    widths = None
    for step in range(3):
        ref = reference_of(store)
        tokens = {layer: new_token(gen) for layer in store.layers}
        outs = {}
        with record_launches(sections={"finish": (DecodePlan, "finish")}) as rec:
            with rec.section("begin step"):
                store.reserve(slots)
                store.begin_step(slots)
            for layer in store.layers:
                with rec.section(f"layer {layer}"):
                    outs[layer] = store.decode(layer, *tokens[layer], SCALE)
        ref.reserve(slots)
        ref.begin_step(slots)
        for layer in store.layers:
            torch.testing.assert_close(outs[layer], ref.decode(layer, *tokens[layer], SCALE), atol=1e-4, rtol=1e-4)
        assert_same_state(store, ref)
        with capsys.disabled():
            print(f"\n[{'/'.join(config) or 'default'} step {step}] " + " | ".join(
                f"{name}: {counts.summary()}" for name, counts in rec.sections.items() if name != "main"))
        for layer in store.layers:
            per_layer = rec.sections[f"layer {layer}"]
            assert per_layer.num_syncs == 0, per_layer.summary()
            assert per_layer.launches <= launches and sum(per_layer.triton_launches.values()) == 3, \
                per_layer.summary()
            if widths == (store.step_plan.m_hi, store.step_plan.m_lo):  # buffers grow only with the widths
                assert not per_layer.allocations, f"workspaces are reused: {per_layer.summary()}"
        begin, finish = rec.sections["begin step"], rec.sections["finish"]
        # the first step of a set of sequences selects its heads (~45 small ops, once); later steps copy the
        # positions only (on CUDA one pinned, non-blocking copy; on CPU nothing to launch)
        assert begin.num_syncs == 0 and begin.launches <= (50 if step == 0 else 2), begin.summary()
        assert finish.num_syncs == 1 and finish.launches == 0, finish.summary()  # the error flags, read once
        widths = (store.step_plan.m_hi, store.step_plan.m_lo)


def test_wider_widths_and_more_splits_read_the_same_attention():
    """The attention kernels mask every token by its item's count: widths above the true maxima (a plan's bounds)
    and any split count give the reference's output, and the gain columns sit at the given widths."""
    store, slots = prefilled()
    kv, items = store.kv, store.compressor(0, slots).items
    n = kv.tables.tokens_flat[items].long()
    lays = (kv.layouts[HIGH_COL], kv.layouts[LOW_COL])
    query = torch.randn(2, HKV * G, D, generator=torch.Generator().manual_seed(2))
    args = (query, kv.pool.data, kv.tables, items, n[:, 0], n[:, 1], lays, SCALE)
    want, gain_ref = paged_decode_attention_ref(*args, meta_dtype=kv.meta_dtype, raw_dtype=kv.raw_dtype)
    m_hi, m_lo = 3 * lays[0].tokens_per_page, 2 * lays[1].tokens_per_page
    assert m_hi > int(n[:, 0].max()) and m_lo > int(n[:, 1].max())
    w_hi = -(-int(n[:, 0].max()) // lays[0].tokens_per_page) * lays[0].tokens_per_page  # the reference's M_hi
    workspace = DecodeWorkspace("cpu")
    for splits in (1, 3):
        out, gain = paged_decode_attention(*args, meta_dtype=kv.meta_dtype, raw_dtype=kv.raw_dtype,
                                           backend="triton", num_splits=splits, widths=(m_hi, m_lo),
                                           workspace=workspace)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        assert gain.shape == (len(items), m_hi + m_lo)
        torch.testing.assert_close(gain[:, :w_hi], gain_ref[:, :w_hi], atol=1e-6, rtol=1e-5)
        low = gain_ref[:, w_hi:]
        torch.testing.assert_close(gain[:, m_hi:m_hi + low.shape[1]], low, atol=1e-6, rtol=1e-5)
    assert out.data_ptr() == workspace.take("out", (2, HKV * G, D), torch.float32).data_ptr()


def test_a_plan_refuses_another_layer_heads_batch_or_a_second_run():
    """Checked on the host before anything runs (the torch backend: the checks are the same on every backend)."""
    store, slots = prefilled(backend="torch")
    other = store.open_slot()
    store.prefill(0, [other], *(torch.randn(1, h, 5, D) for h in (HKV * G, HKV, HKV)), torch.ones(1, 5, dtype=bool),
                  SCALE)
    store.reserve(slots)
    comps = store.begin_step(slots)
    plan = store.step_plan
    q, k, v = new_token(torch.Generator().manual_seed(3))
    before = store.kv.tables.counts.clone()
    one_layer = build_plan(store.kv, {0: comps[0].items}, [13, 8], 13, HKV, backend="torch",
                           workspace=DecodeWorkspace("cpu"), buffers=PlanBuffers([0], "cpu", keep_outputs=False))
    with pytest.raises(ValueError, match="built for layers \\[0\\], not layer 1"):
        comps[1].decode(q, k, v, SCALE, reserved=True, plan=one_layer)
    with pytest.raises(ValueError, match="built for other heads"):
        store.compressor(0, [slots[0], other]).decode(q, k, v, SCALE, reserved=True, plan=plan)
    with pytest.raises(ValueError, match="batch of 2 sequences"):
        store.decode(0, q[:1], k[:1], v[:1], SCALE)
    with pytest.raises(ValueError, match="batch of 2 sequences"):
        store.decode(0, q, k[:, :1], v[:, :1], SCALE)
    assert torch.equal(store.kv.tables.counts, before)  # refused before any change
    store.decode(0, q, k, v, SCALE)
    with pytest.raises(ValueError, match="layer 0 already ran in this decode step"):
        store.decode(0, q, k, v, SCALE)
    with pytest.raises(ValueError, match="not layer 5|holds no pages"):
        store.decode(5, q, k, v, SCALE)


def test_device_errors_are_raised_once_per_step_naming_the_layers():
    """Triton: a NaN key in layer 0 changes no count or page and is reported after the step's last layer;
    positions below what the heads hold (widths too small) are clamped on the device and reported, never read past
    the workspace."""
    store, slots = prefilled(page_bytes=512)  # 3 high / 7 low tokens per page
    gen = torch.Generator().manual_seed(4)
    store.reserve(slots)
    store.begin_step(slots)
    q, k, v = new_token(gen)
    tokens = store.kv.tables.tokens_flat[store.compressor(0, slots).items].clone()
    out0 = store.decode(0, q, torch.where(torch.arange(D) == 5, float("nan"), k), v, SCALE)
    assert torch.isfinite(out0).all()  # attention over the tokens the heads held
    assert torch.equal(store.kv.tables.tokens_flat[store.compressor(0, slots).items], tokens)  # nothing stored
    with pytest.raises(ValueError, match=r"layer\(s\) \[0\]: the new token's keys/values contain NaN or Inf"):
        store.decode(1, *new_token(gen), SCALE)
    assert not store.step_plan.buffers.flags.any()  # cleared: the next step starts clean

    store.reserve(slots)
    store.begin_step(slots, positions=[1, 1])  # the heads hold up to 13 tokens: widths of one page are too small
    plan = store.step_plan
    assert (plan.m_hi, plan.m_lo) == (3, 7)
    for layer in store.layers[:-1]:
        store.decode(layer, *new_token(gen), SCALE)
    with pytest.raises(ValueError, match=r"layer\(s\) \[0, 1\]: a head holds more tokens than the step's positions"):
        store.decode(store.layers[-1], *new_token(gen), SCALE)


def test_tier_bounds_workspace_growth_and_recorder_counts():
    cfg = DiffKVConfig(page_bytes=1024)
    plan = plan_for_config(cfg, D)
    hi, lo = plan.layout(cfg.high), plan.layout(cfg.low)
    assert tier_bounds((hi, lo), True, 12, 100) == (16, 14)  # 13 tokens: 2 high pages of 8, 1 low page of 14
    assert tier_bounds((hi, lo), True, 10_000, 5) == (40, 70)  # at most the table's width in pages
    assert tier_bounds((hi, hi), False, 12, 100) == (16, 0)  # one tier: no low token
    ws = DecodeWorkspace("cpu")
    a = ws.take("logits", (10,), torch.float32)
    b = ws.take("logits", (4, 2), torch.float32)
    assert b.data_ptr() == a.data_ptr()  # fits: the same buffer
    c = ws.take("logits", (11,), torch.float32)
    assert c.numel() == 11 and ws.take("logits", (12,), torch.float32).data_ptr() == c.data_ptr()  # grew by 1.25x
    assert ws.take("logits", (2,), torch.float16).data_ptr() != c.data_ptr()  # one buffer per dtype

    x = torch.arange(6.0)
    with record_launches() as rec:
        x.view(2, 3).t()  # views: free
        torch.empty(3)  # an allocation, not a launch
        y = x * 2 + 1  # two launches
        x.tolist()  # host syncs: tolist, item, bool
        y[0].item()
        bool(y[1] > 0)  # a launch (gt) and a sync
    total = rec.total()
    assert total.launches == 3 and total.num_syncs == 3 and sum(total.allocations.values()) == 1, total.summary()
    assert dict(total.syncs) == {"tolist": 1, "_local_scalar_dense": 2}
    assert "tolist" not in vars(torch.Tensor) and "numpy" not in vars(torch.Tensor)  # nothing left patched


def _step_signatures(store, slots, inputs, gen) -> list[tuple]:
    """The Triton launches of one decode step, each as (kernel, launch signature), the new tokens written into the
    same input tensors (as a captured forward's would be)."""
    with record_launches() as rec:
        store.reserve(slots)
        store.begin_step(slots)
        for layer in store.layers:
            for buf, new in zip(inputs[layer], new_token(gen), strict=True):
                buf.copy_(new)
            store.decode(layer, *inputs[layer], SCALE)
        store.step_plan.finish()
    return [(name, sig) for _, name, sig in rec.calls]


@pytest.mark.parametrize("bucket", [1, 32])
def test_steps_within_a_width_bucket_launch_alike(bucket):
    """#59 item 3, what a CUDA graph of the decode step needs, checked without CUDA: with the width bounds rounded
    to ``KVStore.width_bucket`` tokens, consecutive steps launch the same kernels with the same arguments (every
    scalar, grid and tensor address), so one captured step replays for the rest of the bucket; with the tightest
    bounds the arguments change whenever a tier's bound crosses a page."""
    store, slots = prefilled()
    store.width_bucket = bucket
    gen = torch.Generator().manual_seed(3)
    inputs = {layer: tuple(t.clone() for t in new_token(gen)) for layer in store.layers}
    steps = [_step_signatures(store, slots, inputs, gen) for _ in range(8)]  # positions 13..20: under one bucket
    assert all(len(s) == 3 * len(store.layers) for s in steps)
    alike = [steps[i] == steps[1] for i in range(1, 8)]  # the first step may grow the workspace
    assert all(alike) if bucket == 32 else not all(alike), alike


@pytest.mark.gpu
def test_gpu_a_captured_decode_step_replays_like_eager_steps():
    """#59 item 3 on a GPU (not yet run: no GPU was lent when it was written): the per-layer decode of a step,
    captured once as a CUDA graph (reserve and begin_step stay eager: they write the pages taken and the positions
    into buffers whose addresses do not change), replayed for the next steps of the width bucket with the new
    tokens copied into the same input tensors, gives the torch reference's outputs, tiers and pages."""
    store, slots = prefilled(device="cuda")
    store.width_bucket = 32
    ref = reference_of(store)
    gen = torch.Generator().manual_seed(4)
    inputs = {layer: tuple(t.cuda() for t in new_token(gen)) for layer in store.layers}

    def begin():
        store.reserve(slots)
        store.begin_step(slots)
        ref.reserve(slots)
        ref.begin_step(slots)
        tokens = {layer: new_token(gen) for layer in store.layers}
        for layer in store.layers:
            for buf, new in zip(inputs[layer], tokens[layer], strict=True):
                buf.copy_(new)
        return {layer: ref.decode(layer, *(t.cuda() for t in tokens[layer]), SCALE) for layer in store.layers}

    want = begin()  # one eager step: kernels compiled, workspace grown
    got = {layer: store.decode(layer, *inputs[layer], SCALE) for layer in store.layers}
    store.step_plan.finish()
    for layer in store.layers:
        torch.testing.assert_close(got[layer], want[layer], atol=1e-4, rtol=1e-4)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    for step in range(6):
        want = begin()
        if step == 0:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.cuda.graph(graph):
                got = {layer: store.decode(layer, *inputs[layer], SCALE) for layer in store.layers}
            torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        store.step_plan.finish()
        for layer in store.layers:
            torch.testing.assert_close(got[layer], want[layer], atol=1e-4, rtol=1e-4)
    assert torch.equal(store.kv.tables.counts.cpu(), ref.kv.tables.counts.cpu())
