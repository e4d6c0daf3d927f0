"""Batched policy vs slow, obviously-correct per-(sequence, head) loops."""

import math

import pytest
import torch

from diffkv.core.policy import (
    APPEND,
    DEMOTE_APPEND_LOW,
    DEMOTE_OVER_LOW,
    HIGH,
    LOW,
    PAD,
    PRUNE_HIGH,
    PRUNED,
    accumulate_scores,
    place_decode,
    prefill_positions,
    prefill_scores,
    split_prefill,
    window_exits,
)


def slow_prefill_scores(q, k, lengths, scaling, window):
    b, hq, total, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(b, hkv, total, dtype=torch.float64)
    for s in range(b):
        start = total - int(lengths[s])
        for h in range(hkv):
            for qi in range(max(start, total - window), total):
                best = torch.zeros(total, dtype=torch.float64)
                for j in range(g):
                    qv = q[s, h * g + j, qi].double()
                    logits = torch.tensor([float(qv @ k[s, h, t].double()) * scaling for t in range(start, qi + 1)])
                    p = torch.softmax(logits, 0)
                    best[start:qi + 1] = torch.maximum(best[start:qi + 1], p)
                out[s, h] += best
    return out


@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (7, 1)])
def test_prefill_scores_match_loop(hq, hkv):
    torch.manual_seed(hq)
    b, total, d, window = 3, 13, 8, 5
    q, k = torch.randn(b, hq, total, d), torch.randn(b, hkv, total, d)
    lengths = torch.tensor([13, 9, 3])
    valid = torch.arange(total)[None] >= (total - lengths)[:, None]
    got = prefill_scores(q, k, valid, 0.3, window)
    want = slow_prefill_scores(q, k, lengths, 0.3, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert (got[~valid[:, None, :].expand_as(got)] == 0).all()


def test_prefill_positions():
    pos = prefill_positions(torch.tensor([5, 3]), 5, 2)
    assert pos.tolist() == [[3, 3, 3, 3, 4], [-1, -1, 1, 1, 2]]


def test_prefill_positions_with_lag():
    """Tokens past the window keep their query count ``p - max(t, n - W)`` (stored ``lag`` earlier); the window's
    tokens keep their index (their score restarts when they reach age ``lag``)."""
    pos = prefill_positions(torch.tensor([6, 3]), 6, score_window=3, lag=2)
    assert pos.tolist() == [[1, 1, 1, 1, 4, 5], [-1, -1, -1, -2, 1, 2]]  # a stored pos may be negative


def test_window_exits():
    pos = torch.tensor([[0, 3, 5, 7], [9, 9, 2, 1], [4, 0, 0, 0]])
    count, position = torch.tensor([4, 4, 0]), torch.tensor([7, 9, 8])
    assert window_exits(pos, count, position, lag=4).nonzero().tolist() == [[0, 1]]  # row 2: past the count
    assert window_exits(pos, count, position, lag=7).nonzero().tolist() == [[0, 0], [1, 2]]
    assert not window_exits(pos, count, position, lag=0).any()


def slow_split(score, lengths, a_hi, a_lo, recent, window, two_tier):
    b, h, total = score.shape
    tier = torch.full((b, h, total), PAD, dtype=torch.int8)
    for s in range(b):
        n = int(lengths[s])
        for hh in range(h):
            for t in range(n):
                c = total - n + t
                if n - t <= recent:
                    tier[s, hh, c] = HIGH
                    continue
                mean = float(score[s, hh, c]) / min(n - t, window)
                if mean < a_lo / n:
                    tier[s, hh, c] = PRUNED
                elif two_tier and mean < a_hi / n:
                    tier[s, hh, c] = LOW
                else:
                    tier[s, hh, c] = HIGH
    return tier


@pytest.mark.parametrize("seed", range(20))
def test_split_prefill_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    b, h, total = 3, 4, int(torch.randint(1, 40, (1,), generator=g))
    lengths = torch.randint(1, total + 1, (b,), generator=g)
    lengths[0] = total
    score = torch.rand(b, h, total, generator=g) * torch.rand(1, generator=g) * 3
    recent, window = int(torch.randint(1, 10, (1,), generator=g)), int(torch.randint(1, 10, (1,), generator=g))
    a_lo = float(torch.rand(1, generator=g)) * 0.5
    a_hi = a_lo + float(torch.rand(1, generator=g)) * 2
    two = bool(seed % 3)
    got = split_prefill(score, lengths, a_hi, a_lo, recent, window, two_tier=two)
    want = slow_split(score, lengths, a_hi, a_lo, recent, window, two)
    assert torch.equal(got.tier, want)
    assert torch.equal(got.n_high, (want == HIGH).sum(-1).int()) and torch.equal(got.n_low, (want == LOW).sum(-1).int())
    if not two:
        assert (got.n_low == 0).all()


def slow_place(hs, hp, nh, ls, lp, nl, position, a_hi, a_lo, recent, two_tier, lag=0):
    cases, his, los = [], [], []
    for i in range(hs.shape[0]):
        p = int(position[i])
        if int(nh[i]) + int(nl[i]) + 1 <= recent:
            cases.append(APPEND), his.append(-1), los.append(-1)
            continue

        def weakest(score, pos, n, p=p):
            best, idx = math.inf, 0
            for t in range(n):
                age = p - int(pos[t])
                if age >= recent and age > lag:
                    m = float(score[t] / torch.tensor(float(age - lag)))
                    if m < best:
                        best, idx = m, t
            return best, idx

        mL, iL = weakest(hs[i], hp[i], int(nh[i]))
        mR, iR = weakest(ls[i], lp[i], int(nl[i])) if two_tier else (math.inf, 0)
        base = torch.tensor([float(max(p, 1))])
        prune_thr = float(a_lo / base)
        quant_thr = float((a_hi if two_tier else a_lo) / base)
        if mL < prune_thr and mL < mR:
            cases.append(PRUNE_HIGH), his.append(iL), los.append(-1)
        elif mL < quant_thr:
            if mR < prune_thr:
                cases.append(DEMOTE_OVER_LOW), his.append(iL), los.append(iR)
            else:
                cases.append(DEMOTE_APPEND_LOW), his.append(iL), los.append(int(nl[i]))
        else:
            cases.append(APPEND), his.append(-1), los.append(-1)
    return cases, his, los


@pytest.mark.parametrize("seed", range(25))
def test_place_decode_matches_loop(seed):
    g = torch.Generator().manual_seed(100 + seed)
    n, s_hi, s_lo = 16, 24, 20
    recent = int(torch.randint(1, 8, (1,), generator=g))
    nh = torch.randint(0, s_hi + 1, (n,), generator=g)
    nl = torch.randint(0, s_lo + 1, (n,), generator=g)
    position = nh + nl + torch.randint(0, 30, (n,), generator=g)
    hp = (torch.rand(n, s_hi, generator=g) * position[:, None]).long().int()
    lp = (torch.rand(n, s_lo, generator=g) * position[:, None]).long().int()
    hs = torch.rand(n, s_hi, generator=g) * torch.rand(n, 1, generator=g) * 2
    ls = torch.rand(n, s_lo, generator=g) * torch.rand(n, 1, generator=g) * 2
    a_lo = float(torch.rand(1, generator=g)) * 0.5
    a_hi = a_lo + float(torch.rand(1, generator=g))
    two = seed % 4 != 0
    lag = recent if seed % 2 else 0  # score_after_window on odd seeds
    got = place_decode(hs, hp, nh, ls, lp, nl, position, a_hi, a_lo, recent, two_tier=two, lag=lag)
    cases, his, los = slow_place(hs, hp, nh, ls, lp, nl, position, a_hi, a_lo, recent, two, lag)
    assert got.case.tolist() == cases
    assert got.high_slot.tolist() == his
    assert got.low_slot.tolist() == los


def test_place_decode_covers_every_case():
    # one item per case, built by hand; recent window 1, position 10
    hs = torch.tensor([[0.01, 5.0], [0.5, 5.0], [0.5, 5.0], [5.0, 5.0]])
    hp = torch.zeros(4, 2, dtype=torch.int32)
    ls = torch.tensor([[5.0], [0.01], [5.0], [5.0]])
    lp = torch.zeros(4, 1, dtype=torch.int32)
    nh, nl, pos = torch.tensor([2, 2, 2, 2]), torch.tensor([1, 1, 1, 1]), torch.full((4,), 10)
    # thresholds: prune 0.2/10, quant 1.0/10; means are score / 10
    got = place_decode(hs, hp, nh, ls, lp, nl, pos, alpha_high=1.0, alpha_low=0.2, recent_window=1)
    assert got.case.tolist() == [PRUNE_HIGH, DEMOTE_OVER_LOW, DEMOTE_APPEND_LOW, APPEND]
    assert got.high_slot.tolist() == [0, 0, 0, -1]
    assert got.low_slot.tolist() == [-1, 0, 1, -1]


@pytest.mark.parametrize("groups", [1, 3, 7])
def test_accumulate_scores(groups):
    score = torch.rand(2, 2, 5)
    probs = torch.softmax(torch.randn(2, 2 * groups, 5), -1)
    got = accumulate_scores(score, probs, groups)
    for b in range(2):
        for h in range(2):
            want = score[b, h] + probs[b, h * groups:(h + 1) * groups].max(0).values
            torch.testing.assert_close(got[b, h], want)


def slow_fill(tier: torch.Tensor, mean: torch.Tensor, per_page: tuple[int, ...]) -> torch.Tensor:
    """fill_last_pages one row at a time: lift the best-scored tokens below a tier (ties: the lower column)."""
    tier = tier.clone()
    for s in range(tier.shape[0]):
        for hh in range(tier.shape[1]):
            for into, n in zip((HIGH, LOW), per_page, strict=False):
                row = tier[s, hh]
                held = int((row == into).sum())
                below = [c for c in range(row.numel()) if -1 < int(row[c]) < into]
                below.sort(key=lambda c: (-float(mean[s, hh, c]), c))
                room = min(-(-held // n) * n - held, len(below))
                for c in below[:room]:
                    row[c] = into
    return tier


@pytest.mark.parametrize("seed", range(12))
def test_fill_last_pages_lifts_the_best_tokens_below_and_takes_no_page_more(seed):
    """A frozen prefix's partly filled last page of each tier is filled with its best tokens of the tiers below
    (``split_prefill(fill_pages=...)``): the same as a row-by-row loop, every tier's count a whole number of
    pages unless the row ran out of tokens, never a page more than the split without it, and a token only moves
    up."""
    g = torch.Generator().manual_seed(seed)
    b, h, total = 2, 3, int(torch.randint(5, 60, (1,), generator=g))
    lengths = torch.randint(1, total + 1, (b,), generator=g)
    lengths[0] = total
    score = torch.rand(b, h, total, generator=g) * torch.rand(1, generator=g) * 3
    score[:, :, ::7] = score[:, :, 1:2]  # ties
    two = bool(seed % 3)
    per_page = (int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 17, (1,), generator=g)))
    args = (score, lengths, 1.5, 0.4, 3, 4)
    plain = split_prefill(*args, two_tier=two)
    got = split_prefill(*args, two_tier=two, fill_pages=per_page)
    seen = torch.clamp(lengths[:, None] - (torch.arange(total)[None, :] - (total - lengths[:, None])), max=4)
    mean = score / seen.clamp_min(1)[:, None, :].float()
    assert torch.equal(got.tier, slow_fill(plain.tier, mean, per_page if two else per_page[:1]))
    assert (got.tier >= plain.tier).all() and torch.equal(got.tier == PAD, plain.tier == PAD)
    pages = lambda n, p: -(-n // p)  # noqa: E731
    for n_got, n_plain, p in ((got.n_high, plain.n_high, per_page[0]), (got.n_low, plain.n_low, per_page[1])):
        assert (pages(n_got, p) <= pages(n_plain, p)).all()
    below_high = lengths[:, None] - got.n_high  # tokens left below high: none, or high is page-aligned
    assert ((got.n_high % per_page[0] == 0) | (below_high == 0)).all()
    if two:
        left = lengths[:, None] - got.n_high - got.n_low
        assert ((got.n_low % per_page[1] == 0) | (left == 0) | (got.n_low == 0)).all()
