import json

import pytest

from diffkv.cli import main
from diffkv.core.config import PRESETS, TierSpec
from diffkv.core.layout import PUBLISHED_TIERS, bytes_per_token, plan_pages, tier_layout


def test_reproduces_published_plan_at_head_dim_128():
    # The published code's page (docs/algorithm.md §7): 6784-byte pages and its segment offsets.
    plan = plan_pages(128, PUBLISHED_TIERS)
    assert plan.page_bytes == 6784
    expect = {  # name: (N, key_meta, value, value_meta, score, pos, end)
        "K8V4-g128/64": (32, 4096, 4224, 6272, 6528, 6656, 6784),
        "K8V4": (32, 4096, 4224, 6272, 6400, 6528, 6656),
        "K4V2-g64/32": (52, 3328, 3840, 5504, 6336, 6544, 6752),
        "K4V2": (60, 3840, 4096, 6016, 6272, 6512, 6752),
    }
    for name, want in expect.items():
        t = plan.layout(name)
        got = (t.tokens_per_page, t.key_meta_offset, t.value_offset, t.value_meta_offset, t.score_offset,
               t.pos_offset, t.end)
        assert got == want, name
    assert plan.worst_waste == pytest.approx(0.01887, abs=1e-4)


def test_published_bytes_per_token():
    # The paper's "data + meta bytes per token" at d = 128 (fp16 metadata, fp32 score, int32 pos).
    table = {"K8V8": 272, "K8V4": 208, "K8V4-g128/64": 212, "K8V2": 176, "K4V4": 144, "K4V2-g64/32": 128,
             "K4V2": 112, "K4V1": 96}
    for name, bpt in table.items():
        assert bytes_per_token(TierSpec.parse(name), 128) == bpt, name


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_three_bit_tiers_and_keys_below_values(head_dim):
    """3-bit rows are 3 D / 8 bytes (a 2-bit and a 1-bit plane); keys may have fewer bits than values."""
    for name, kbits, vbits in (("K3V2", 3, 2), ("K3V4", 3, 4), ("K4V3", 4, 3), ("K3V3-g32/32", 3, 3)):
        tier = TierSpec.parse(name)
        groups = 1 if tier.key.group_size is None else head_dim // 32
        assert bytes_per_token(tier, head_dim) == head_dim * (kbits + vbits) // 8 + 4 * groups + 4 * (
            1 if tier.value.group_size is None else head_dim // 32) + 8, name
    plan = plan_pages(head_dim, ("K4V4", "K3V2"))
    low = plan.tiers[1]
    assert low.key_row_bytes == 3 * head_dim // 8 and low.tokens_per_page > plan.tiers[0].tokens_per_page
    assert _needed_bytes(low, low.tokens_per_page) <= plan.page_bytes


def _needed_bytes(t, n: int) -> int:
    """Bytes a page holding ``n`` tokens of tier layout ``t`` needs: each segment's rows after the previous one,
    key meta / value meta / score on 32-byte and value codes on 128-byte boundaries, position right after score."""
    def up(x, a):
        return -(-x // a) * a

    key_meta = up(n * t.key_row_bytes, 32)
    value = up(key_meta + n * t.key_groups * t.key_meta_fields * t.meta_bytes, 128)
    value_meta = up(value + n * t.value_row_bytes, 32)
    score = up(value_meta + n * t.value_groups * 2 * t.meta_bytes, 32)
    return score + n * (t.score_bytes + t.pos_bytes)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("tiers,max_waste", [(("K8V4", "K4V2"), 0.02), (("K8V4-g32/32", "K4V2-g32/16"), 0.02),
                                              (("K8V8", "K4V4"), 0.03)])
def test_page_waste_is_small(head_dim, tiers, max_waste):
    plan = plan_pages(head_dim, tiers)
    assert plan.worst_waste <= max_waste
    for t in plan.tiers:
        assert 0 < t.end <= plan.page_bytes
        assert t.key_meta_offset % 32 == 0 and t.value_offset % 128 == 0 and t.score_offset % 32 == 0
        # segments do not overlap and hold what they claim
        n = t.tokens_per_page
        assert t.key_offset + n * t.key_row_bytes <= t.key_meta_offset
        assert t.key_meta_offset + n * t.key_groups * 2 * t.meta_bytes <= t.value_offset
        assert t.value_offset + n * t.value_row_bytes <= t.value_meta_offset
        assert t.value_meta_offset + n * t.value_groups * 2 * t.meta_bytes <= t.score_offset
        assert t.pos_offset == t.score_offset + 4 * n and t.end == t.pos_offset + 4 * n
        # n tokens fit and n + 1 would not: the bytes a page of that many tokens needs, from the layout's own
        # field sizes and the alignment rules, against the page (and tier_layout packs n + 1 into that many bytes)
        assert _needed_bytes(t, n) == t.end <= plan.page_bytes
        assert _needed_bytes(t, n + 1) > plan.page_bytes
        grown = tier_layout(TierSpec.parse(t.name), head_dim, _needed_bytes(t, n + 1))
        assert grown.tokens_per_page == n + 1 and grown.end == _needed_bytes(t, n + 1)


def test_every_preset_fits_at_every_head_dim():
    for hd in (64, 128, 256):
        for name in PRESETS:
            tier = PRESETS[name]
            if any(q.group_size and hd % q.group_size for q in (tier.key, tier.value)):
                with pytest.raises(ValueError, match="divide head_dim"):
                    plan_pages(hd, [name])
                continue
            assert plan_pages(hd, [name]).tiers[0].tokens_per_page >= 1


def test_smallest_size_among_minimizers():
    plan = plan_pages(64, ("K8V4", "K4V2"))
    for p in range(plan.page_bytes - 32, 0, -32):
        if p < 400:
            break
        other = plan_pages(64, ("K8V4", "K4V2"), candidates=range(p, p + 1))
        assert other.worst_waste > plan.worst_waste - 1e-12


def test_config_page_bytes_fixes_the_page_or_says_why_not():
    from diffkv import DiffKVConfig
    from diffkv.core.layout import plan_for_config

    auto = plan_for_config(DiffKVConfig(compact_meta=True), 64)
    fixed = plan_for_config(DiffKVConfig(compact_meta=True, page_bytes=1472), 64)
    assert auto.page_bytes == 3424 and fixed.page_bytes == 1472
    assert [t.tokens_per_page for t in fixed.tiers] == [13, 24]
    assert [t.bytes_per_token for t in fixed.tiers] == [t.bytes_per_token for t in auto.tiers]
    with pytest.raises(ValueError, match="a 96-byte page does not fit one token of every tier .* larger page_bytes"):
        plan_for_config(DiffKVConfig(page_bytes=96), 64)


def test_bad_head_dim():
    with pytest.raises(ValueError, match="head_dim"):
        plan_pages(0, ["K8V4"])
    with pytest.raises(ValueError, match="at least one tier"):
        plan_pages(64, [])


def test_layout_cli_json(capsys):
    assert main(["layout", "--head-dim", "128", "--high", "K8V4", "--low", "K4V2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"page_bytes", "tiers"} <= set(out)
    names = [t["name"] for t in out["tiers"]]
    assert names == ["K8V4", "K4V2"]
    for t in out["tiers"]:
        assert {"name", "tokens_per_page", "bytes_per_token", "waste_fraction"} <= set(t)
        assert t["waste_fraction"] <= 0.02
    assert main(["layout", "--head-dim", "128", "--published", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["page_bytes"] == 6784
    assert main(["layout", "--head-dim", "64", "--compact", "--symmetric-keys", "--json"]) == 0
    lean = {t["name"]: t["bytes_per_token"] for t in json.loads(capsys.readouterr().out)["tiers"]}
    assert lean == {"K8V4": 112 - 6, "K4V2": 64 - 6}  # 4 B of score + position, 2 B of key zero
    assert main(["layout", "--head-dim", "64", "--compact", "--page-bytes", "1472", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["page_bytes"] == 1472 and [t["tokens_per_page"] for t in out["tiers"]] == [13, 24]


def test_layout_cli_bad_input(capsys):
    assert main(["layout", "--high", "K5V3"]) == 2
    assert "bits must be one of" in capsys.readouterr().err
    assert main(["layout", "--high", "K8"]) == 2
    assert "cannot parse tier" in capsys.readouterr().err
    assert main(["layout", "--head-dim", "64", "--page-bytes", "100"]) == 2
    assert "page_bytes: expected a multiple of 32" in capsys.readouterr().err
    assert main(["layout", "--head-dim", "64", "--page-bytes", "64"]) == 2
    assert "a 64-byte page does not fit one token of every tier" in capsys.readouterr().err


def test_expected_tokens_weigh_the_tail_of_each_tier():
    """With an expected length the planner minimizes in-page waste plus half a page per tier over that length's
    bytes: short sequences get smaller pages, long ones converge to the plain plan."""
    from diffkv.core.layout import search_range, tail_waste

    tiers = ("K8V4", "K4V2")
    plain = plan_pages(64, tiers, compact=True)
    short = plan_pages(64, tiers, compact=True, expected_tokens=150)
    assert short.page_bytes < plain.page_bytes
    t = short.tiers[0]
    assert tail_waste(t, 150) == pytest.approx(short.page_bytes / 2 / (150 * t.bytes_per_token))
    assert tail_waste(t, None) == 0.0

    def cost(p):  # the objective, recomputed from the layouts of every candidate
        lays = [tier_layout(TierSpec.parse(n), 64, p, compact=True) for n in tiers]
        return max(x.waste_fraction + x.page_bytes / 2 / (150 * x.bytes_per_token) for x in lays)
    best = min(cost(p) for p in search_range(64))
    assert cost(short.page_bytes) == pytest.approx(best, abs=1e-12)
    assert plan_pages(64, tiers, compact=True, expected_tokens=10 ** 7).page_bytes == plain.page_bytes


def test_layout_cli_expected_tokens(capsys):
    assert main(["layout", "--head-dim", "64", "--compact", "--expected-tokens", "150"]) == 0
    out = capsys.readouterr().out
    assert "page: 1472 B" in out and "tail waste" in out
    assert main(["layout", "--head-dim", "64", "--expected-tokens", "0"]) == 2
    assert "--expected-tokens must be a positive number" in capsys.readouterr().err
