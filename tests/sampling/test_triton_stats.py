"""The stats pass (`triton.stats`): its per-block stats against the reference's
`block_stats`, bit for bit, in any split; and its row tail's routes and tokens."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from graphexec.params import SamplerVariant  # noqa: E402
from graphexec.sampling import processing, reference  # noqa: E402
from graphexec.sampling.triton.keys import exp_ftz, mass_hi_lo  # noqa: E402
from graphexec.sampling.triton.sampler_config import (  # noqa: E402
    R_CUT,
    R_DONE,
    R_SELECT,
    slices,
    split,
    stats_tile,
)
from tests.sampling.triton_cases import CONFIGS, P, assert_same, logits_of, run_both  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.parametrize("programs,variant,stats_programs",
                         [(1, "no_filter", 1), (3, "default", 1), (64, "default", 1),
                          (3, "top_k_top_p", 4096)])  # fmt: skip
def test_block_stats_equal_the_reference(programs: int, variant: str, stats_programs: int) -> None:
    """(The block minima are written for the filtered variants only.) stats_programs
    4,096: the stats pass's tiles halved to 2 blocks (`stats_tile`)."""
    B, V, cfg = 6, 700, CONFIGS["interp16"]
    logits = logits_of("mixed", B, V, seed=1)
    params = [P(seed=i, temperature=0.4 + 0.3 * i) for i in range(B)]
    cfg = cfg.replace(programs=programs, stats_programs=stats_programs)
    assert stats_tile(cfg, B, 44, False) == (2 if stats_programs > 1 else cfg.tile_blocks)
    assert stats_tile(cfg, B, 44, True) == cfg.tile_blocks  # (the raw sums' order)
    both = run_both(params, logits, cfg, variant=SamplerVariant(variant))
    x = processing.collapse_inf(processing.process_logits(logits, torch.arange(B), both.table))
    s = reference.effective_inv_t(torch.arange(B), both.table)
    xm, q = reference.block_stats(x, s, cfg.draw_block)
    plain = ~torch.isinf(logits).any(1) | torch.isneginf(logits).all(1)
    assert torch.equal(both.ws.xm[plain], xm[plain])
    # exp may differ in its last bit between backends (numpy's here, torch's there)
    torch.testing.assert_close(both.ws.q[plain].double(), q[plain].double(), rtol=1e-6, atol=0)
    # +inf rows: their +inf blocks are marked +inf and weigh 2**32 per +inf entry
    r = 3
    blk = torch.isinf(logits[r]).nonzero().flatten() // cfg.draw_block
    assert (both.ws.xm[r, blk] == float("inf")).all()
    n_inf = (logits[r, blk[0] * cfg.draw_block :][: cfg.draw_block] == float("inf")).sum()
    assert both.ws.q[r, blk[0]] == n_inf << 32
    # the block minimum of the finite values
    fin = torch.where(torch.isfinite(x), x, float("inf"))
    xn = torch.nn.functional.pad(fin, (0, -V % cfg.draw_block), value=float("inf"))
    xn = xn.view(B, -1, cfg.draw_block).min(-1).values
    if variant != "no_filter":
        assert torch.equal(both.ws.xn[plain], xn[plain])
    assert_same(both.ref, both.tri)


@pytest.mark.parametrize("programs", [1, 7, 924, 1536, 4096, 100_000])
@pytest.mark.parametrize("B,nblk,tile", [(1, 594, 8), (32, 594, 4), (128, 502, 8), (7, 3, 2)])
def test_slices_cover_split_s_partition_with_no_empty_program(programs, B, nblk, tile) -> None:
    """`slices` keeps `split`'s blocks per program (so its partition of the row) and drops
    only programs that would start past the row."""
    S, per = slices(programs, tile, B, nblk)
    S0 = split(programs, tile, B, nblk)
    assert per == triton.cdiv(triton.cdiv(nblk, tile), S0) * tile and per % tile == 0
    assert S <= S0 and (S - 1) * per < nblk <= S * per


def test_the_top_p_total_is_fixed_point_in_any_order() -> None:
    """The row tail's top-p total of top-k-off rows (`reference.mass_total`): each block's
    term truncated to 2**-8 and summed as integers, so blocks in any order give the same
    bits, within 2**-8 a block below the float sum; the interpreted kernel's, to 1e-6 (its
    Q_b are exp's, numpy's there and torch's here: `test_block_stats_equal_the_reference`)."""
    B, V, cfg = 5, 700, CONFIGS["interp16"]
    logits = logits_of("mixed", B, V, seed=3)
    params = [P(seed=i, temperature=0.5 + 0.3 * i, top_p=0.9) for i in range(B)]
    both = run_both(params, logits, cfg, variant=SamplerVariant.DEFAULT)
    x = processing.collapse_inf(processing.process_logits(logits, torch.arange(B), both.table))
    s = reference.effective_inv_t(torch.arange(B), both.table)
    xm, q = reference.block_stats(x, s, cfg.draw_block)
    ym = reference.block_ymax(x, xm, s)
    want = reference.mass_total(q, ym)
    assert torch.equal(reference.row_mass(x, s, cfg.draw_block), want)
    nblk = q.shape[1]
    torch.testing.assert_close(both.ws.total[:B], want, rtol=1e-6, atol=0)
    perm = torch.randperm(nblk, generator=torch.Generator().manual_seed(0))
    again = reference.mass_total(q[:, perm], ym[:, perm])
    assert torch.equal(again.view(torch.int64), want.view(torch.int64))
    terms = torch.where(q > 0, q.double() * ym.double().exp(), 0.0)
    for order in (torch.arange(nblk), perm, torch.arange(nblk).flip(0)):
        gap = terms[:, order].cumsum(1)[:, -1] - want
        assert ((gap >= 0) & (gap <= nblk / reference.TOTAL_SCALE)).all()
    assert (want >= 2.0**32).all()  # (the max's block holds 2**32 at least)


def test_row_tail_routes() -> None:
    """Invalid, greedy, no-filter and tied rows (+inf rows too) are drawn by the stats
    pass; min-p alone is a cut; top-k / top-p a selection."""
    B, V = 12, 500
    logits = logits_of("randn3", B, V, seed=2)
    logits[0] = float("-inf")
    logits[3] = 1.25  # every token tied
    logits[4] = 1.25
    logits[4, ::3] = float("-inf")  # tied, some masked
    logits[5, [7, 300]] = float("inf")
    logits[6] = 0.5
    params = [
        P(seed=1),
        P(seed=2, temperature=0.0),
        P(seed=3),
        P(seed=4, top_k=7, top_p=0.5),
        P(seed=5, top_p=0.3),
        P(seed=6, top_k=1),
        P(seed=7, min_p=0.5, top_p=0.9),
        P(seed=8, min_p=0.1),
        P(seed=9, top_k=10),
        P(seed=10, top_p=0.8),
        P(seed=11, top_k=40, top_p=0.9, min_p=0.01),
        P(seed=12, temperature=0.0, top_k=3),
    ]
    both = run_both(params, logits, CONFIGS["interp16"])
    assert_same(both.ref, both.tri)
    done, cut, sel = int(R_DONE), int(R_CUT), int(R_SELECT)
    assert both.routes == [done] * 7 + [cut, sel, sel, sel, done]
    assert both.ref.token_ids[5].item() in (7, 300) and both.ref.token_ids[3] < 4


@pytest.mark.parametrize("params", [
    dict(top_k=13), dict(top_p=0.41), dict(top_k=40, top_p=0.5), dict(min_p=0.9),
    dict(top_k=590, top_p=0.999),
])  # fmt: skip
def test_tied_rows_keep_the_first_ids(params: dict) -> None:
    """A row of equal values keeps the first L live ids, L from integer arithmetic."""
    B, V = 6, 600
    logits = torch.full((B, V), -0.75)
    logits[1:, ::5] = float("-inf")
    logits[2, :200] = float("-inf")
    logits[4, 300:] = float("-inf")
    both = run_both([P(seed=20 + i, temperature=0.3 + 0.4 * i, **params) for i in range(B)],
                    logits, CONFIGS["interp16"], positions=torch.arange(B) * 11)  # fmt: skip
    assert_same(both.ref, both.tri)
    assert set(both.routes) == {int(R_DONE)}


@triton.jit
def _mass_kernel(z_ptr, e_ptr, hi_ptr, lo_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    z = tl.load(z_ptr + i)
    tl.store(e_ptr + i, exp_ftz(z))
    hi, lo = mass_hi_lo(z)
    tl.store(hi_ptr + i, hi)
    tl.store(lo_ptr + i, lo)


def test_mass_halves_from_one_conversion() -> None:
    """`mass_hi_lo`'s one conversion of e * 2**32 gives hi * 2**16 + lo = trunc(e * 2**32)
    (e = exp(z) as the kernels compute it), e = 1 included; NaN z weighs 2**32 (the stats
    pass's +inf entries). Every float32 e in [0, 1] was checked offline in numpy."""
    edge = [0.0, -0.0, -1e-30, -2.0**-25, -2.0**-24, -1e-7, -0.5, -22.18, -22.19, -88.0,
            -100.0, -104.0, -200.0, float("-inf"), float("nan")]  # fmt: skip
    g = torch.Generator().manual_seed(3)
    z = torch.cat([torch.tensor(edge), -torch.rand(113, generator=g) * 40.0,
                   -torch.rand(128, generator=g) * 1e-6])  # fmt: skip
    e, hi, lo = (
        torch.empty(256),
        torch.empty(256, dtype=torch.int32),
        torch.empty(256, dtype=torch.int32),
    )
    _mass_kernel[(1,)](z, e, hi, lo, N=256)
    got = hi.long() * 65536 + lo.long()
    want = torch.where(z.isnan(), 2**32, torch.floor(e.double() * 2.0**32).long())
    assert torch.equal(got, want)
    assert got[0] == 2**32 and (lo < 65536).all() and (hi <= 65536).all()


def _rm32(x: np.ndarray) -> np.ndarray:
    """float64 x rounded toward -inf to float32 (an fma.rm of exact result x)."""
    r = x.astype(np.float32)
    low = r.astype(np.float64) > x
    r[low] = np.nextafter(r[low], np.float32(-np.inf))
    return r


def _mass_bits_after_ex2(e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`keys.mass_bits`'s PTX after its ex2 on float32 e: min.f32 (NaN gives 1), fma.rm,
    sub.f32, fma.rm. float64 holds t = e * 2**32 exactly and rounds a sum only below 2**-13
    (t + 2**39) or 2**-29 (t + d), short of any multiple of 2**16 (or 1) t does not reach
    (24 significant bits): rounding the float64 sum down to float32 is the fma's."""
    e = np.fmin(e.astype(np.float32), np.float32(1.0))
    t = e.astype(np.float64) * 2.0**32
    h = _rm32(t + 2.0**39)
    d = np.float32(2.0**39 + 2.0**23) - h
    return h.view(np.int32), _rm32(t + d.astype(np.float64)).view(np.int32)


def test_mass_bits_give_the_masses_of_mass_hi_lo() -> None:
    """The GPU's `block_mass` (`mass_bits`: three fp32 operations, no conversion) against
    `mass_hi_lo`'s definition: trunc(e * 2**32), 2**32 at e = 1 and NaN. Each half is its
    bias (a multiple of 2**24) plus the half, so int32 sums of up to 255 of them, wrapped,
    keep the halves' sums in their low 24 bits. Every float32 e in [0, 1] was checked offline
    (this sweep: every 61st, and the ends of every exponent)."""
    pats = np.arange(0, 0x3F800001, 61, dtype=np.int64)
    ends = (np.arange(255, dtype=np.int64)[:, None] << 23) + np.r_[0:512, (1 << 23) - 512:1 << 23]
    pats = np.concatenate([pats, ends.ravel()])
    e = pats[pats <= 0x3F800000].astype(np.uint32).view(np.float32)
    e = np.concatenate([e, np.float32([np.nan, 1.0000001, 2.0, np.inf])])
    hb, lb = _mass_bits_after_ex2(e)
    assert ((hb >> 24) == 0x53).all() and ((lb >> 24) == 0x4B).all()
    t = e.astype(np.float64) * 2.0**32
    want = np.where(t < 2.0**32, np.floor(np.nan_to_num(t)), 2.0**32).astype(np.int64)
    assert np.array_equal((hb & 0xFFFFFF).astype(np.int64) * 65536 + (lb & 0xFFFFFF), want)
    # block sums as the kernel forms them: 128 terms, wrapped int32, masked to 24 bits
    rng = np.random.default_rng(5)
    idx = rng.integers(0, e.size, (64, 128))
    idx[0] = np.flatnonzero(e == 1.0)[0]  # a block of ties: hi sums to 2**23
    got = [(np.sum(h[idx], axis=1, dtype=np.uint32).astype(np.int64) & 0xFFFFFF) for h in (hb, lb)]
    assert np.array_equal(got[0] * 65536 + got[1], want[idx].sum(axis=1))


def test_bf16_pairs_widen_as_their_bits() -> None:
    """`process.widen`'s GPU form takes a pair of bf16 bits in one register (low half: the
    first value): shl 16 and and 0xFFFF0000 are each value's bits << 16, as the
    interpreter's sign-extend-and-shift."""
    h = np.arange(-(2**15), 2**15, dtype=np.int64)
    w = (h[:, None] & 0xFFFF) | ((h[None, ::257] & 0xFFFF) << 16)  # every low, some highs
    want = lambda v: (v << 16) & 0xFFFFFFFF  # noqa: E731
    assert np.array_equal((w << 16) & 0xFFFFFFFF, np.broadcast_to(want(h)[:, None], w.shape))
    assert np.array_equal(w & 0xFFFF0000, np.broadcast_to(want(h[::257])[None, :], w.shape))


KERNELS = ("_stats_kernel", "_tail_kernel", "_topk_kernel", "_check_kernel", "_short_kernel",
           "_select_kernel", "_kept_kernel", "_finish_kernel", "_raw_logprobs_kernel")  # fmt: skip


class _Recorder:
    """Stands in for a kernel in `launch`: records each launch's keyword (compile-time)
    arguments, then launches it."""

    def __init__(self, kernel, name: str, calls: list) -> None:
        self.kernel, self.name, self.calls = kernel, name, calls

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.calls.append((self.name, kw))
            return self.kernel[grid](*args, **kw)

        return run


@pytest.mark.parametrize("variant", ["default", "top_k_top_p"])
def test_a_logprobs_launch_compiles_the_same_kernels_at_every_batch(monkeypatch, variant) -> None:
    """A row's float sums (the raw logprobs' sums of exp) follow the layout of the kernels
    that add them, which their compile-time arguments set: at B = 1, 3 and 6 with
    logprobs, every kernel launches with the same ones (the small-batch stats tile once
    changed the stats pass's at B = 1, and with it the logprobs of a row alone, seen only
    on a GPU). Without logprobs only the stats pass's tile R may differ (exact sums)."""
    from graphexec.sampling.triton import launch

    calls: list = []
    for name in KERNELS:
        monkeypatch.setattr(launch, name, _Recorder(getattr(launch, name), name, calls))
    cfg = CONFIGS["interp16"].replace(stats_programs=32)  # tiles of 8 at B = 6, 4 at 3, 2 at 1
    V = 700
    assert [stats_tile(cfg, B, 44, False) for B in (6, 3, 1)] == [8, 4, 2]
    logits = logits_of("randn3", 6, V, seed=3)
    # top_k_top_p: top-k on in every row (a row without it would take the exact search,
    # 31 serial passes under the interpreter, and launch nothing else)
    ks = [40, 0] if variant == "default" else [40, 7]
    for lp in (2, None):
        seen = {}
        for B in (6, 3, 1):
            params = [P(seed=i, top_k=ks[i % 2], top_p=0.9, logprobs=lp) for i in range(B)]
            calls.clear()
            run_both(params, logits[:B], cfg, variant=SamplerVariant(variant),
                     num_top=lp)  # fmt: skip
            got = {name: kw for name, kw in calls}
            # how many programs serve a top_k_top_p row changes no sum of floats: the parts
            # run tail_row's code, whose one float sum (the top-p total) the GPU test
            # test_top_k_first_parts_leave_the_total_bits checks across batches
            for name in ("_topk_kernel",) if "_topk_kernel" in got else ():
                got[name] = {k: v for k, v in got[name].items() if k not in ("PARTS", "MULTI")}
            if lp is None:
                got["_stats_kernel"] = {k: v for k, v in got["_stats_kernel"].items() if k != "R"}
            seen[B] = got
        assert seen[1] == seen[3] == seen[6], lp
