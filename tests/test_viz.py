"""diffkv.viz: the per-token tier map (checked against the keys the cache stored) and every figure's data."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from diffkv import DiffKVConfig
from diffkv.integrations.transformers import DiffKVCache
from diffkv.memory import HIGH_COL, LOW_COL
from diffkv.viz import tiers as tiers_mod

pytest.importorskip("matplotlib")

from diffkv import viz  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def peaked_llama(scale: float = 12.0):
    """A tiny random Llama whose q/k weights are scaled so attention is peaked: the tiers split and change."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "q_proj"):
                m.q_proj.weight.mul_(scale)
                m.k_proj.weight.mul_(scale)
    return model


def generate(model, cache, ids, n, mask=None):
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)


def capture_keys(cache) -> dict[int, list[torch.Tensor]]:
    """Every key tensor each DiffKV layer receives (prefill [B, H, L, D], then one [B, H, 1, D] per step)."""
    seen: dict[int, list[torch.Tensor]] = {}
    for layer in cache.layers:
        attend = layer.attend

        def capture(module, q, k, v, mask, scaling, _attend=attend, _idx=layer.layer_idx, **kw):
            seen.setdefault(_idx, []).append(k.detach().clone())
            return _attend(module, q, k, v, mask, scaling, **kw)

        layer.attend = capture
    return seen


def stored(cache, layer: int, tier: int):
    """(keys [K, M, D], counts [K]) the pages of ``tier`` of a layer hold now, items in (batch, head) order."""
    comp = cache.layers[layer].compressor
    n = cache.kv.tables.tokens_flat[comp.items].long()[:, tier]
    return cache.kv.read(tier, comp.items, n, max(int(n.max()), 1))[0], n


@pytest.mark.parametrize("backend,alphas,center,after", [
    ("cpu", (1.0, 0.1), False, False), ("cpu", (4.0, 1.0), True, False), ("cpu", (0.5, 0.05), False, False),
    ("torch", (2.0, 0.3), True, False), ("cpu", (1.0, 0.1), False, True)])
def test_tier_map_names_the_tokens_the_pages_hold(backend, alphas, center, after):
    """Independent check: the keys stored in each tier are exactly the keys the layer received at the tokens the
    map puts there (high tier K16: fp16 keys, low tier K8; nearest stored key), after prunes and demotions."""
    model = peaked_llama()
    cfg = DiffKVConfig(high="K16V16", low="K8V8", raw_dtype="float32", alpha_high=alphas[0], alpha_low=alphas[1],
                       recent_window=4, score_window=16, center_keys=center, score_after_window=after)
    cache = DiffKVCache(model, cfg, attention_backend=backend)
    tracker = viz.track_tiers(cache)
    keys = capture_keys(cache)
    ids = torch.randint(3, 96, (1, 100), generator=torch.Generator().manual_seed(1))
    generate(model, cache, ids, 80)
    tm = tracker.tier_map()
    assert tm.shape == (2, 2, 179) and tm.dtype == torch.int8
    assert set(tm.unique().tolist()) <= {0, 1, 2} and (tm == 1).any()
    assert (tm[:, :, :100] != tracker.prefill_map()).any()  # decoding moved prompt tokens
    for layer in range(2):
        received = torch.cat(keys[layer], 2)[0]  # [H, 179, D]
        comp = cache.layers[layer].compressor
        for tier, label in ((HIGH_COL, 2), (LOW_COL, 1)):
            k, n = stored(cache, layer, tier)
            for h in range(2):
                toks = (tm[layer, h] == label).nonzero(as_tuple=True)[0]
                assert len(toks) == int(n[h])
                if not len(toks):
                    continue
                kv = cache.kv  # keys are stored centered (center_keys) or centered and scaled (smooth_keys, default)
                scale = 1 if kv.key_scale is None else kv.key_scale[comp.items[h]]
                want = (received[h, toks] - kv.key_center[comp.items[h]]) / scale
                dist = torch.cdist(k[h, : n[h]], want)
                assert torch.equal(dist.argmin(1).sort().values, torch.arange(len(toks)))  # one to one
                assert dist.min(1).values.max() < (0.05 if tier == HIGH_COL else 0.5)  # fp16 / 8-bit keys


def test_tier_map_counts_match_stats_on_a_padded_batch():
    model = peaked_llama()
    cfg = DiffKVConfig(alpha_high=2.0, alpha_low=0.3, recent_window=4, score_window=8)
    cache = DiffKVCache(model, cfg)
    tracker = viz.track_tiers(cache)
    lengths, total = (60, 41, 25), 60
    ids = torch.randint(3, 96, (3, total), generator=torch.Generator().manual_seed(2))
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, total - n:] = 1
    generate(model, cache, ids.masked_fill(mask == 0, 0), 30, mask)
    stats = cache.stats()
    for b, n in enumerate(lengths):
        tm = tracker.tier_map(batch_index=b)
        assert tm.shape == (2, 2, n + 29)
        assert tracker.prefill_map(batch_index=b).shape == (2, 2, n)
        counts = cache.kv.tables.num_tokens[cache.slots[b]]  # [L, H, 2]
        assert torch.equal((tm == 2).sum(-1).int(), counts[..., 0]) and torch.equal((tm == 1).sum(-1).int(),
                                                                                     counts[..., 1])
        assert (tm.sum(-1) > 0).all()
        assert stats["tokens_per_head"][b] == (tm > 0).sum(-1).tolist()
    fr = viz.tier_fractions(cache)
    assert fr.shape == (2, 2, 3) and torch.allclose(fr.sum(-1), torch.ones(2, 2))
    for layer, want in stats["tier_fractions_per_layer"].items():
        assert fr[int(layer), :, 0].mean().item() == pytest.approx(want["high"], abs=1e-4)
        assert fr[int(layer), :, 1].mean().item() == pytest.approx(want["low"], abs=1e-4)


def test_prefill_map_is_the_split_the_cache_stored():
    """viz reads the split the cache stored (``DiffKVLayer.prefill_listeners``), not a recomputation: on a padded
    batch its tier counts equal the cache's stats and page tables, per sequence, layer and head."""
    model = peaked_llama()
    cache = DiffKVCache(model, DiffKVConfig(alpha_high=2.0, alpha_low=0.3, recent_window=4, score_window=8))
    tracker = viz.track_tiers(cache)
    given = {}
    for layer in cache.layers:
        layer.prefill_listeners.append(lambda lay, split: given.setdefault(lay.layer_idx, split))
    lengths, total = (50, 33), 50
    ids = torch.randint(3, 96, (2, total), generator=torch.Generator().manual_seed(7))
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, total - n:] = 1
    generate(model, cache, ids.masked_fill(mask == 0, 0), 1, mask)  # the prefill only
    stats = cache.stats()
    maps = [tracker.prefill_map(batch_index=b) for b in range(2)]
    assert [m.shape for m in maps] == [(2, 2, 50), (2, 2, 33)]
    for tier, label in (("high", 2), ("low", 1), ("pruned", 0)):
        assert sum(int((m == label).sum()) for m in maps) == stats["tokens_per_tier"][tier]
    assert stats["tokens_per_tier"]["low"] > 0 and stats["tokens_per_tier"]["pruned"] > 0
    for b, m in enumerate(maps):
        assert stats["tokens_per_head"][b] == (m > 0).sum(-1).tolist()
        counts = cache.kv.tables.num_tokens[cache.slots[b]]  # [L, H, 2]
        assert torch.equal((m == 2).sum(-1).int(), counts[..., 0]) and torch.equal((m == 1).sum(-1).int(),
                                                                                   counts[..., 1])
        for layer, split in given.items():  # the very split the layer handed out
            assert torch.equal(m[layer], split.tier[b, :, total - lengths[b]:])
    assert tracker.tier_map(batch_index=1).shape == (2, 2, 33) and torch.equal(tracker.tier_map(1), maps[1])


def test_prefill_only_map_equals_the_split_and_tracking_must_start_first():
    model = peaked_llama()
    cache = DiffKVCache(model, DiffKVConfig(alpha_high=1.0, alpha_low=0.2, recent_window=8, score_window=8))
    with pytest.raises(RuntimeError, match="not received a prompt"):
        viz.track_tiers(cache).tier_map()
    tracker = viz.track_tiers(cache)
    ids = torch.randint(3, 96, (1, 50), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    tm = tracker.tier_map()
    assert torch.equal(tm, tracker.prefill_map())
    assert (tm[:, :, -8:] == 2).all()  # the recent window is always high at prefill
    with pytest.raises(ValueError, match="before the cache receives its prompt"):
        viz.track_tiers(cache)


def test_layers_the_cache_does_not_compress_are_marked():
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 32},
                           sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2)
    model = Gemma3ForCausalLM(cfg).eval()
    cache = DiffKVCache(model, DiffKVConfig(alpha_high=1.0, alpha_low=0.1, recent_window=4, score_window=8))
    tracker = viz.track_tiers(cache)
    generate(model, cache, torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(4)), 5)
    tm, fr = tracker.tier_map(), viz.tier_fractions(cache)
    assert (tm[[0, 2]] == -1).all() and (tm[[1, 3]] >= 0).all()
    assert fr[[0, 2]].isnan().all() and not fr[[1, 3]].isnan().any()


def test_tier_heatmap_panels_hold_the_fractions():
    fr = torch.rand(5, 3, 3)
    fig = viz.plot_tier_heatmap(fr, title="t")
    panels = [ax for ax in fig.axes if ax.images and ax.get_xlabel() == "KV head"]
    assert [ax.get_title().split()[0] for ax in panels] == ["high", "low", "pruned"]
    for i, ax in enumerate(panels):
        assert torch.allclose(torch.as_tensor(ax.images[0].get_array().data), fr[:, :, i])
        assert ax.images[0].get_clim() == (0, 1)
    assert len(fig.axes) == 6 and fig._suptitle.get_text() == "t"  # three panels, three colour bars


def test_tokens_html_colours_each_token_by_tier():
    tok = SimpleNamespace(decode=lambda ids: {1: "a<b", 2: "\n", 3: "c"}[ids[0]])
    out = viz.tokens_html(tok, [1, 2, 3, 3], [2, 1, 0, 2])
    assert out.count("<span title=") == 4 and "a&lt;b" in out and "<br>" in out
    assert 'title="0: high" style="background:#b2f2bb' in out and 'title="2: pruned"' in out
    assert "high 2</span>" in out and "low 1</span>" in out and "pruned 1</span>" in out
    assert viz.tokens_html(tok, [1, 2, 3, 3], [2, 1, 0, 2], max_tokens=2).count("<span title=") == 2
    with pytest.raises(ValueError, match="4 token ids but 3"):
        viz.tokens_html(tok, [1, 2, 3, 3], [2, 1, 0])


def test_cache_bytes_and_bar_chart():
    from transformers import DynamicCache

    model = peaked_llama()
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(5))
    full = DynamicCache(config=model.config)
    cache = DiffKVCache(model, DiffKVConfig(alpha_high=1.0, alpha_low=0.1, recent_window=4, score_window=8))
    with torch.no_grad():
        model(ids, past_key_values=full, use_cache=True)
        model(ids, past_key_values=cache, use_cache=True)
    sizes = viz.cache_bytes(cache, full)
    stats = cache.stats()
    assert list(sizes) == ["fp16 K/V", "DynamicCache (float32)", "DiffKV pages", "DiffKV, all it holds"]
    assert sizes["fp16 K/V"] == stats["fp16_bytes"] == 2 * 2 * 40 * 2 * 16 * 2
    assert sizes["DynamicCache (float32)"] == 2 * sizes["fp16 K/V"]
    assert sizes["DiffKV pages"] == stats["bytes_in_pages"] and sizes["DiffKV, all it holds"] == stats["bytes_held"]
    ax = viz.plot_bytes(sizes).axes[0]
    widths = {t.get_text(): p.get_width() for t, p in zip(ax.get_yticklabels(), ax.patches, strict=True)}
    assert widths == pytest.approx({k: v / 1e6 for k, v in sizes.items()})
    assert any("(1.00x)" in t.get_text() for t in ax.texts)


PROFILE = "benchmarks/calibration/smollm2-135m-full-per-layer.json"  # a per-layer profile (smollm2's until 2026-12-02)


def test_calibration_sweep_plots_every_recorded_candidate():
    p = json.loads(open(PROFILE).read())
    ax = viz.plot_sweep(PROFILE).axes[0]
    lines = {line.get_label(): line for line in ax.lines}
    for stage in ("baseline", "alpha_high", "alpha_low", "per_layer"):
        rows = [r for r in p["search"]["rows"] if r["stage"] == stage]
        line = next(v for k, v in lines.items() if k.startswith(stage + " "))
        assert list(line.get_xdata()) == [r["compression_physical"] for r in rows]
        assert list(line.get_ydata()) == [r["kl"] for r in rows]
    best = next(v for k, v in lines.items() if k.startswith("global best"))
    assert best.get_xdata()[0] == p["search"]["global_best"]["compression_physical"]
    chosen = next(v for k, v in lines.items() if k.startswith("chosen: per layer"))
    assert chosen.get_ydata()[0] == p["measured"]["kl"]
    budget = next(v for k, v in lines.items() if k.startswith("budget"))
    assert budget.get_ydata()[0] == p["calibration"]["budget"]["max_kl"]


def test_layer_alphas_bars_and_tier_mix():
    p = json.loads(open(PROFILE).read())
    top, bottom = viz.plot_layer_alphas(p).axes
    assert [b.get_height() for b in top.patches] == [a[0] for a in p["config"]["layer_alphas"]]
    assert [b.get_height() for b in bottom.patches] == [a[1] for a in p["config"]["layer_alphas"]]
    p["config"]["layer_alphas"] = None
    with pytest.raises(ValueError, match="no per-layer alphas"):
        viz.plot_layer_alphas(p)
    model = peaked_llama()
    ids = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(6))
    results = {f"{a} / {b}": viz.prefill_stats(model, ids, DiffKVConfig(alpha_high=a, alpha_low=b, recent_window=4,
                                                                         score_window=8))
               for a, b in ((0.5, 0.05), (2.0, 0.5))}
    ax = viz.plot_tier_mix(results).axes[0]
    assert len(ax.patches) == 6
    for i, label in enumerate(results):
        got = [p.get_width() for p in ax.patches[i::2]]
        assert got == pytest.approx([results[label]["tier_fractions"][t] for t in ("high", "low", "pruned")])
    assert results["2.0 / 0.5"]["tier_fractions"]["pruned"] > results["0.5 / 0.05"]["tier_fractions"]["pruned"]


def _write_run(root, variant, model, task, method, metrics, config=None, samples=None):
    d = root / variant / model / task / method
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps(metrics))
    (d / "config.json").write_text(json.dumps(config or {}))
    if samples:
        (d / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def test_frontier_groups_settings_and_draws_the_pareto_front(tmp_path):
    acc = {"max_new_tokens": 256, "task_options": {}}
    for method, a, c in (("full", 0.5, 1.0), ("diffkv", 0.45, 3.0), ("h2o", 0.2, 3.1), ("kivi2", 0.3, 2.0),
                         ("h2o@0.5", 0.35, 2.0), ("diffkv@x4", 0.3, 4.0)):
        _write_run(tmp_path, "", "m", "gsm8k", method, {"n": 10, "accuracy": a, "stderr": 0.1,
                                                        "compression_physical": c}, acc)
    _write_run(tmp_path, "profiled", "m", "gsm8k", "diffkv", {"n": 10, "accuracy": 0.5, "stderr": 0.1,
                                                              "compression_physical": 2.5}, {**acc, "profile": "p"})
    _write_run(tmp_path, "", "m", "gsm8k", "K4V4", {"n": 40, "accuracy": 0.1, "stderr": 0.05,
                                                    "compression_physical": 3.0}, acc)  # other n: its own panel
    _write_run(tmp_path, "q500", "m", "gsm8k", "full", {"n": 10, "accuracy": 0.6, "stderr": 0.1,
                                                        "compression_physical": 1.0}, {**acc, "start": 500})
    for method, ppl, c in (("full", 10.0, 1.0), ("diffkv", 10.1, 3.5), ("K4V4", 40.0, 3.2)):
        _write_run(tmp_path, "", "m", "ppl", method, {"n": 4, "ppl": ppl, "compression_physical": c},
                   {"max_new_tokens": 0})
    rows = viz.load_runs(tmp_path)
    assert len(rows) == 12 and {r["label"] for r in rows if r["variant"] == "profiled"} == {"diffkv (profile)"}
    assert {r["family"] for r in rows if r["task"] == "gsm8k"} == {"full", "diffkv", "h2o", "kivi2", "K4V4",
                                                                    "diffkv [profiled]", "full [q500]"}
    fig = viz.plot_frontier(rows)
    ppl_ax, n40_ax, acc_ax, q500_ax = [ax for ax in fig.axes if ax.get_visible()]  # more samples first
    assert q500_ax.get_title().endswith("from sample 500, n=10")  # another slice: its own panel
    assert [c.get_label() for c in q500_ax.containers] == ["full [q500]"]
    assert ppl_ax.get_ylabel().startswith("perplexity") and acc_ax.get_ylabel() == "accuracy (%)"
    assert acc_ax.get_title().endswith("n=10") and n40_ax.get_title().endswith("n=40")
    legend = [t.get_text() for t in acc_ax.get_legend().get_texts()]
    assert sorted(legend) == ["diffkv", "diffkv [profiled]", "full", "h2o", "kivi2"]
    lines = {c.get_label(): c.lines[0] for c in acc_ax.containers}  # one errorbar per family
    assert list(lines["h2o"].get_xdata()) == [2.0, 3.1] and list(lines["diffkv"].get_xdata()) == [3.0, 4.0]
    assert sorted(t.get_text() for t in acc_ax.texts) == ["0.5", "x4"]  # the operating points are labelled
    front = [line for line in acc_ax.lines if line.get_linestyle() == "--"][0]
    assert list(front.get_xdata()) == [2.5, 3.0, 4.0]  # full, kivi2, h2o@0.5 and h2o are beaten
    front = [line for line in ppl_ax.lines if line.get_linestyle() == "--"][0]
    assert list(front.get_xdata()) == [1.0, 3.5]
    assert ppl_ax.get_ylim()[1] == pytest.approx(12.5)  # K4V4's 40 would squash the rest: clipped and labelled
    assert [t.get_text() for t in ppl_ax.texts] == ["K4V4 40 ^"]
    assert viz.plot_frontier([]) is None
    from diffkv.viz.frontier import split_spec

    assert split_spec("diffkv@x4+page_bytes=1472") == ("diffkv+page_bytes=1472", "x4")
    assert split_spec("h2o@0.2") == ("h2o", "0.2") and split_spec("full") == ("full", "")
    assert viz.pareto([(1, 5), (2, 4), (2, 3), (3, 1)]) == [(1, 5), (2, 4), (3, 1)]


def test_eval_report_plot_writes_the_frontier(tmp_path):
    from diffkv.eval.report import collect, frontier_rows, plot

    _write_run(tmp_path, "", "m", "ppl", "full", {"n": 4, "ppl": 10.0, "compression_physical": 1.0})
    _write_run(tmp_path, "sweep", "m", "ppl", "diffkv@x4", {"n": 4, "ppl": 10.5, "compression_physical": 5.0})
    assert len(collect(tmp_path)) == 1 and len(frontier_rows(tmp_path)) == 2 and not frontier_rows(tmp_path, "x")
    png = plot(frontier_rows(tmp_path, "m", "ppl"), tmp_path / "f.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_needle_grid_from_samples(tmp_path):
    def samples(fails):
        return [{"id": f"needle-{n}-{d:.2f}-0", "correct": (n, d) not in fails} for n in (1024, 2048)
                for d in (0.0, 0.5, 1.0)]

    _write_run(tmp_path, "", "m", "needle", "full", {"n": 6, "accuracy": 1.0, "compression_physical": 1.0},
               samples=samples(set()))
    _write_run(tmp_path, "", "m", "needle", "h2o", {"n": 6, "accuracy": 0.7, "compression_physical": 3.0},
               samples=samples({(2048, 0.5), (1024, 0.0)}))
    res = viz.needle_results(tmp_path)
    assert sorted(res) == ["m: full", "m: h2o"] and not res["m: h2o"][(2048, 0.5)] and res["m: h2o"][(2048, 1.0)]
    fig = viz.plot_needle_grid(res)
    ax = [a for a in fig.axes if a.get_title().startswith("m: h2o")][0]
    grid = ax.images[0].get_array()
    assert grid.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]]
    assert ax.get_title().endswith("4/6") and sum(t.get_text() == "fail" for t in ax.texts) == 2


def test_recorded_benchmarks_load_and_plot():
    """The files under benchmarks/ that notebooks/03_results.ipynb reads."""
    runs = viz.load_runs("benchmarks/accuracy")
    assert {"full", "diffkv", "h2o", "snapkv", "kivi2", "K4V4"} <= {r["method"] for r in runs}
    assert len([a for a in viz.plot_frontier(runs).axes if a.get_visible()]) >= 4
    needle = viz.needle_results("benchmarks/accuracy")
    assert needle["qwen2.5-0.5b: full"][(4096, 0.5)] and not needle["qwen2.5-0.5b: h2o"][(4096, 0.5)]
    decode = viz.decode_results("benchmarks/results/decode")
    assert [r["context"] for r in decode] == [4096, 16384]
    speed, mem = viz.plot_decode(decode).axes
    diffkv_speed = [line for line in speed.lines if line.get_label().endswith("DiffKV")][0]
    assert list(diffkv_speed.get_ydata()) == [r["diffkv_tokens_per_s"] for r in decode]
    serve = viz.serve_results("benchmarks/serve")
    ax = viz.plot_serve(serve).axes[0]
    assert len(ax.patches) == 2 * len(serve) and len(serve) >= 3
    assert ax.patches[len(serve)].get_width() == serve[0]["caches"]["diffkv"]["tokens_per_s"]


def test_serve_results_reads_the_key_of_either_name(tmp_path):
    """``diffkv bench serve`` writes ``"caches"``; files recorded before issue #32 say ``"backends"``."""
    per = {"fp16": {"tokens_per_s": 1.0}, "diffkv": {"tokens_per_s": 2.0}}
    (tmp_path / "a_old.json").write_text(json.dumps({"model": "a", "backends": per}))
    (tmp_path / "b_new.json").write_text(json.dumps({"model": "b", "caches": per}))
    (tmp_path / "c_one.json").write_text(json.dumps({"model": "c", "caches": {"fp16": per["fp16"]}}))
    rows = viz.serve_results(tmp_path)
    assert [(r["run"], r["caches"]) for r in rows] == [("a_old", per), ("b_new", per)]
    assert all("backends" not in r for r in rows)


def test_demo_plot_writes_the_heatmap(tmp_path, capsys, monkeypatch):
    from diffkv import prompts
    from diffkv.cli import main
    from diffkv.eval.tiny import save_tiny

    monkeypatch.setattr(prompts, "essay_tokens", lambda tok, n, start_essay=0: list(range(3, 3 + n)))
    path = save_tiny(tmp_path / "tiny")
    png = tmp_path / "out" / "tiers.png"
    assert main(["demo", "--model", str(path), "--context-tokens", "80", "--max-new-tokens", "3", "--json",
                 "--plot", str(png)]) == 0
    assert json.loads(capsys.readouterr().out)["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tracker_module_needs_no_matplotlib():
    assert "matplotlib" not in tiers_mod.__dict__ and tiers_mod.track_tiers is viz.track_tiers
