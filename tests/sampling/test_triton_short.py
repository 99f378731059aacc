"""The short route (`triton.short`): filtered rows finished by their tail give the
reference's tokens, the same as the selection passes give; rows past its bounds keep
their route."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter, interpreter_enabled

ensure_interpreter()

from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from graphexec.sampling.triton import sampler_config as cf  # noqa: E402
from graphexec.sampling.triton.sampler_config import R_CUT, R_DONE, R_SELECT, SamplerConfig  # noqa: E402
from graphexec.sampling.triton.short import put_candidates  # noqa: E402
from tests.sampling.triton_cases import (  # noqa: E402
    CONFIGS,
    P,
    assert_same,
    extras,
    logits_of,
    run_both,
)  # fmt: skip

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

FILTERS = [dict(top_k=5), dict(top_p=0.9), dict(top_k=50, top_p=0.9), dict(min_p=0.05),
           dict(top_p=0.6, min_p=0.1), dict(top_k=3, top_p=0.99, min_p=0.2), dict(top_k=1),
           dict(top_p=0.3, temperature=2.0)]  # fmt: skip


def _params(B: int, V: int):
    return [P(seed=50 + i, logit_bias={(7 * i) % V: 4.0} if i % 3 == 0 else None,
              presence_penalty=0.5 if i % 4 == 1 else 0.0,
              **{"temperature": 0.8, **FILTERS[i % len(FILTERS)]})
            for i in range(B)]  # fmt: skip


@pytest.mark.parametrize("shape", ["peaked", "randn3", "mixed"])
def test_short_route_equals_the_reference_and_the_selection(shape: str) -> None:
    B, V = 12, 450  # was 900: the short route serves rows of every shape at either
    logits = logits_of(shape, B, V, seed=4)
    counts, prompt, bitmask = extras(B, V, seed=4)
    kw = dict(counts=counts, prompt=prompt, bitmask=bitmask)
    short = run_both(_params(B, V), logits, CONFIGS["interp16_short"], **kw)
    assert_same(short.ref, short.tri)
    if shape == "peaked":
        # the rows the selection passes served, the tail served here (the selection's own
        # tokens on randn3 / mixed rows: test_triton_sampler's mixed batch on interp16)
        long = run_both(_params(B, V), logits, CONFIGS["interp16"], **kw)
        assert_same(long.ref, long.tri)
        planned = [r for r, route in enumerate(long.routes)
                   if route in (int(R_CUT), int(R_SELECT))]  # fmt: skip
        served = [r for r in planned if short.routes[r] == int(R_DONE)]
        assert len(served) >= len(planned) // 2 > 0


def test_rows_past_the_bounds_take_the_selection() -> None:
    B, V = 8, 1200
    params = [P(seed=i, **{"temperature": 0.8, **f}) for i, f in enumerate(FILTERS)]
    # every block listed fits, but flat rows hold more than 16 candidates: their top-k /
    # top-p rows keep R_SELECT (randn3 rows: where theirs do); min-p alone (no candidates
    # to resolve) is still served (a gather cap past V: the selection resolves them in its
    # first round, from the gather buffer the short route wrote its candidates to)
    cfg = CONFIGS["interp16_short"].replace(short_blocks=128, short_tokens=16, gather_cap=2048,
                                            top_k_first=0)  # (top-k rows: the short route)
    for shape in ("flat", "randn3"):
        both = run_both(params, logits_of(shape, B, V, seed=5), cfg)
        assert_same(both.ref, both.tri)
        assert both.routes[3] == int(R_DONE)  # min-p alone
        assert shape != "flat" or int(R_SELECT) in both.routes
    # one listed block at most: peaked rows with more take the selection too
    few = run_both(params, logits_of("peaked", B, V, seed=5),
                   CONFIGS["interp16_short"].replace(short_blocks=1, top_k_first=0))  # fmt: skip
    assert_same(few.ref, few.tri)
    assert int(R_SELECT) in few.routes


def test_config_checks_name_the_field() -> None:
    with pytest.raises(ValueError, match="short_blocks"):
        SamplerConfig(short_blocks=3)
    with pytest.raises(ValueError, match="short_tokens"):
        SamplerConfig(short_tokens=2048, gather_cap=1024)
    with pytest.raises(ValueError, match="short_tokens"):
        SamplerConfig(short_tokens=48)
    with pytest.raises(ValueError, match="top_k_first"):
        SamplerConfig(top_k_first=-1)
    with pytest.raises(ValueError, match="mid_tokens"):
        SamplerConfig(mid_tokens=200)
    with pytest.raises(ValueError, match="late_queue"):
        SamplerConfig(late_queue=-1)


REAL = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "smollm2-logits.pt"


def test_real_top_p_rows_fit_the_short_route() -> None:
    """The top-p plan's lower bound (`stats.grid_delta`, mode 1) is tight enough on real
    rows (SmolLM2-135M logits, the benchmark's: T 0.8, top-p 0.9) that every one the tail
    plans fits the short route of the GPU preset (128 blocks, 128 candidates) and none
    reaches the selection passes; the reference's tokens. check_blocks 0 plans every row.
    (Without each block's max token in the bound, rows 25 and 30 listed 130 and 81 blocks,
    314 and 146 candidates: lo near -9.5 where their cuts lie near -4.5.)"""
    rows = [23, 25, 30, 2, 11]  # the three with the most blocks past lo, and two others
    logits = torch.load(REAL, map_location="cpu", weights_only=True)["logits"][rows].float()
    params = [P(seed=r, temperature=0.8, top_p=0.9) for r in rows]
    both = run_both(params, logits, SamplerConfig.gpu().replace(check_blocks=0))
    assert_same(both.ref, both.tri)
    assert both.routes == [int(R_DONE)] * len(rows)


def test_fallback_draws_from_the_gathered_candidates_equal_the_reference() -> None:
    """Rows whose candidate is out and whose kept set (several tokens in several blocks)
    the short route resolves: their fallback draw, taken over the gathered candidates
    (`draw.gathered_fallback`), is the reference's two-level draw over the row."""
    B, V = 48, 1024  # the GPU preset's blocks of 128: a few kept tokens in a block
    params = [P(seed=200 + i, temperature=(1.0, 1.5)[i % 2], top_p=(0.5, 0.7, 0.9)[i % 3])
              for i in range(B)]  # fmt: skip
    both = run_both(params, logits_of("peaked", B, V, seed=6), CONFIGS["gpu_short"])
    assert_same(both.ref, both.tri)
    selected = set(both.ws.listed[1 : 1 + int(both.ws.listed[0])].tolist())  # round 1's
    out = [r for r in range(B) if int(both.ws.rowi[r, int(cf.I_CAND)]) == -1 and r not in selected]
    assert len(out) >= 8, out  # candidate out, drawn by the short route


class _Bufs(NamedTuple):  # the Workspace fields put_candidates writes
    gath: torch.Tensor
    gath_x: torch.Tensor
    kept: torch.Tensor


@triton.jit
def _put_kernel(W, X, Y, C, BID, first, CAP, NBLK, R: tl.constexpr, DB: tl.constexpr,
                WCAP: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    i = t * R * DB + tl.arange(0, R)[:, None] * DB + tl.arange(0, DB)[None, :]
    bid = tl.load(BID + t * R + tl.arange(0, R))
    offs = bid[:, None] * DB + tl.arange(0, DB)[None, :]
    c = tl.load(C + i)
    put_candidates(W, t, tl.load(X + i), tl.load(Y + i), offs, bid, c, tl.sum(c, axis=1),
                   first, CAP, NBLK, R, WCAP)  # fmt: skip


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_enabled(), reason="CUDA host")),
    pytest.param("cuda", marks=pytest.mark.gpu)])  # fmt: skip
def test_put_candidates_fills_the_slots_in_list_order(device: str) -> None:
    """A tile's candidates into the gather buffers (each tile a row of its own here): their
    packs and the bits of their x in list order from slot `first`, cut at CAP, nothing
    else written, and the tile's blocks' K_b zeroed, against torch; interpreted (tl.store)
    and on the GPU (`store.put_here`'s predicated PTX stores)."""
    R, DB, NBLK, WCAP = 4, 32, 9, 16
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, R, DB, generator=g)
    x[0, 1, 5] = -0.0  # the bits of x kept
    y = x * 1.25 - 0.5
    c = torch.zeros(6, R, DB, dtype=torch.int32)
    for t, per_block in enumerate([(1, 1, 1, 1), (0, 2, 1, 0), (2, 2, 2, 2), (1, 5, 0, 1),
                                   (0, 0, 0, 0), (3, 1, 1, 1)]):  # fmt: skip
        for r, n in enumerate(per_block):
            c[t, r, torch.randperm(DB, generator=g)[:n]] = 1
    c[0, 1, 5] = 1
    bid = torch.tensor([[3, 0, 7, 8], [1, 2, 4, 6], [0, 1, 2, 3], [5, 6, 7, 8], [0, 1, 2, 3],
                        [8, 4, 2, 0]], dtype=torch.int32)  # fmt: skip
    first, cap = 2, 8
    W = _Bufs(torch.full((6, WCAP), -7, dtype=torch.int64, device=device),
              torch.full((6, WCAP), 9.0, device=device),
              torch.full((6, NBLK), 5, dtype=torch.int64, device=device))  # fmt: skip
    _put_kernel[(6,)](W, x.to(device), y.to(device), c.to(device), bid.to(device), first, cap,
                      NBLK, R=R, DB=DB, WCAP=WCAP)  # fmt: skip
    W = _Bufs(*(t.cpu() for t in W))
    for t in range(6):
        sel = c[t].bool()
        ids = (bid[t, :, None].long() * DB + torch.arange(DB))[sel]
        bits = y[t][sel].view(torch.int32).long()
        keys = torch.where(y[t][sel] == 0, 0, torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF))
        n = min(int(sel.sum()), cap - first)
        want = (keys << 32) | (0xFFFFFFFF - ids)
        assert torch.equal(W.gath[t, first:first + n], want[:n]), t
        assert torch.equal(W.gath_x[t, first:first + n].view(torch.int32),
                           x[t][sel][:n].view(torch.int32)), t  # fmt: skip
        assert (W.gath[t, :first] == -7).all() and (W.gath[t, first + n:] == -7).all()
        touched = torch.zeros(NBLK, dtype=torch.bool)
        touched[bid[t].long()] = True
        assert (W.kept[t][touched] == 0).all() and (W.kept[t][~touched] == 5).all()
    assert int(c[2].sum()) > cap - first and int(c[3].sum()) > cap - first  # (the cap cuts)
