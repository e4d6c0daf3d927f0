"""diffkv.viz.frontier's layout and diffkv.viz.labels: short, wrapped, distinct legend labels below each panel."""

import json

import pytest

from diffkv.viz.labels import WIDTH, abbreviations, legend_labels, short_label, wrap_label

LONG = ("diffkv-compact-meta+page_bytes=1472+low=K4V3+recent_window=32+layer_alphas=null+alpha_high=1000000"
        "+alpha_low=0 [engine-eval/first100]")


def test_short_label_abbreviates_names_keys_and_values_and_keeps_the_variant():
    assert short_label(LONG) == "compact-meta+pg=1472+low=K4V3+rw=32+la=null+a_hi=1e6+a_lo=0 [engine-eval/first100]"
    quoted = 'diffkv+importance="peak"+prompt_scores="repeat" [a/seed1]'
    assert short_label(quoted) == "diffkv+imp=peak+ps=repeat [a/seed1]"
    assert short_label("diffkv-compact-meta+page_bytes=1472+score_after_window=true") == "compact-meta+pg=1472+saw"
    assert short_label("diffkv+score_after_window=false+alpha_high=250000") == "diffkv+saw=false+a_hi=25e4"
    for same in ("full", "h2o", "K4V4", "diffkv [profiled]", "diffkv-compact [compact]", "diffkv+high=K4V4",
                 "diffkv+top_k=1000"):  # nothing to abbreviate; 1000 is not rewritten
        assert short_label(same) == same


@pytest.mark.parametrize("width", [12, 20, WIDTH, 200])
def test_wrap_label_breaks_at_plus_and_before_the_variant(width):
    lines = wrap_label(LONG, width).split("\n")
    assert all(len(line) <= width or "+" not in line[1:] for line in lines)  # only an unsplittable part runs over
    assert all(line.startswith(("+", "[")) for line in lines[1:])
    assert " ".join(lines).replace(" +", "+") == short_label(LONG)  # nothing lost, nothing reordered
    assert (len(lines) == 1) == (width == 200)
    assert wrap_label("h2o [long]", width) == "h2o [long]" and wrap_label("h2o [long]", 5) == "h2o\n[long]"


def test_legend_labels_are_distinct_within_a_panel():
    fams = ["diffkv+page_bytes=1", "diffkv+pg=1", "h2o", LONG]  # the first two abbreviate to the same text
    labels = legend_labels(fams)
    assert len(set(labels.values())) == len(fams)
    assert labels["diffkv+page_bytes=1"] == "diffkv\n+page_bytes=1" and labels["diffkv+pg=1"] == "diffkv\n+pg=1"
    assert labels["h2o"] == "h2o" and labels[LONG] == wrap_label(LONG)


def test_abbreviations_lists_only_what_was_used():
    assert abbreviations(["full", "h2o [x]"]) == []
    assert abbreviations([LONG, "diffkv+page_bytes=2944"]) == [
        "a_hi = alpha_high", "a_lo = alpha_low", "compact-meta = diffkv-compact-meta", "la = layer_alphas",
        "pg = page_bytes", "rw = recent_window"]


def _write(root, variant, task, method, metrics, n):
    d = root / variant / "m" / task / method
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps({"n": n, **metrics}))
    (d / "config.json").write_text(json.dumps({"max_new_tokens": 256}))


def _check_layout(fig, dpi):
    """Every visible panel's legend lies below its own x label, inside the figure and its column, over no axes;
    all panels are equally wide; the figure is at most 2000 px wide."""
    fig.draw_without_rendering()
    shown = [ax for ax in fig.axes if ax.get_visible()]
    boxes = [ax.get_window_extent() for ax in shown]
    assert fig.get_figwidth() * dpi <= 2000
    assert max(b.width for b in boxes) - min(b.width for b in boxes) < 1  # equal column widths, no gaps
    for ax, box in zip(shown, boxes, strict=True):
        leg = ax.get_legend().get_window_extent()
        assert leg.y1 < ax.xaxis.label.get_window_extent().y0  # below the axes and their x label
        assert leg.x0 >= box.x0 - 1 and leg.x1 <= box.x1 + 1  # not wider than its panel
        assert leg.y0 >= 0 and leg.x0 >= 0 and leg.x1 <= fig.bbox.width  # inside the saved figure
        assert not any(leg.overlaps(b) for b in boxes)
        assert ax.get_title().startswith("(") and ax.title.get_fontweight() == "bold"


def test_frontier_legends_sit_below_the_axes_with_short_labels(tmp_path):
    pytest.importorskip("matplotlib")
    from diffkv import viz

    variants = ("engine-eval/first100", "engine-eval/q500")
    for n, v in enumerate(variants, 1):  # another n: another panel
        _write(tmp_path, v, "gsm8k", "full", {"accuracy": 0.3, "compression_physical": 1.0}, n)
        extras = ("", "+high=K4V4", "+low=K4V3+recent_window=32", "+low=K4V3+recent_window=32+layer_alphas=null"
                  "+alpha_high=1000000+alpha_low=0")
        for i, extra in enumerate(extras):
            for point, c in (("", 3.0), ("@x16", 5.0)):
                spec = f"diffkv-compact-meta{point}+page_bytes=1472{extra}"
                _write(tmp_path, v, "gsm8k", spec, {"accuracy": 0.2 - 0.01 * i, "compression_physical": c + i / 10},
                       n)
    for i in range(4):  # four more panels: a second row
        _write(tmp_path, f"other{i}", "ppl", "full", {"ppl": 10.0 + i, "compression_physical": 1.0}, i + 1)
    rows = viz.load_runs(tmp_path)
    fig = viz.plot_frontier(rows, dpi=100)
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert len(shown) == 6
    _check_layout(fig, 100)
    ax = next(a for a in shown if a.get_title().endswith("256 new tokens, n=2"))
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert texts[0] == "full [engine-eval/q500]" and "compact-meta+pg=1472\n[engine-eval/q500]" in texts
    assert all(len(line) <= 28 for t in texts for line in t.split("\n"))
    assert sum(len(c.lines[0].get_xdata()) for c in ax.containers) == 9  # every run is drawn
    assert {c.get_label() for c in ax.containers} == {r["family"] for r in rows if r["variant"] == variants[1]}
    assert "pg = page_bytes" in fig._suptitle.get_text()


def test_recorded_frontier_is_laid_out_readably():
    """The figure README.md shows (``diffkv eval report --out benchmarks/accuracy``): every run drawn, every legend
    below its panel and distinct, equal panels, at most 2000 px wide at the report's 100 dpi."""
    pytest.importorskip("matplotlib")
    from diffkv import viz

    runs = [r for r in viz.load_runs("benchmarks/accuracy")
            if r.get("compression_physical") and ("ppl" in r or r.get("accuracy") is not None)]
    fig = viz.plot_frontier(runs, dpi=100)
    _check_layout(fig, 100)
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert sum(len(c.lines[0].get_xdata()) for ax in shown for c in ax.containers) == len(runs)
    for ax in shown:
        texts = [t.get_text() for t in ax.get_legend().get_texts()]
        assert len(set(texts)) == len(texts) == len(ax.containers)
