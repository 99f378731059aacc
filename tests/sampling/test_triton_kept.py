"""The kept pass (`triton.kept`): its exact sums against torch's, the kept blocks' masses
against the reference's K_b, and the cuts it resolves wherever they fall."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

from graphexec.params import SamplerVariant  # noqa: E402
from graphexec.sampling import (
    processing,
    reference,  # noqa: E402
)
from graphexec.sampling.triton.kept import FEW  # noqa: E402
from graphexec.sampling.triton.sampler_config import (  # noqa: E402
    F_INVW,
    F_KLO,
    F_LO,
    I_JHI,
    I_MAB,
    I_NAB,
    I_NG,
    I_NMID,
    R_CUT,
    R_SELECT,
)  # fmt: skip
from tests.sampling.test_triton_select import bins  # noqa: E402
from tests.sampling.triton_cases import CONFIGS, P, assert_same, logits_of, run_both  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def reference_rows(logits, both, cfg):
    """(y, kept mask, ym, K_b) of the reference for the batch."""
    B = logits.shape[0]
    slots = torch.arange(B)
    x = processing.collapse_inf(processing.process_logits(logits, slots, both.table))
    y = processing.scale(x, slots, both.table)
    s = reference.effective_inv_t(slots, both.table)
    xm, q = reference.block_stats(x, s, cfg.draw_block)
    kept = reference.filter_mask(y, slots, both.table, reference.row_mass(x, s, cfg.draw_block))
    ym = torch.where(xm > -torch.inf, (xm - processing.row_max(x)) * s[:, None], -torch.inf)
    return y, kept, ym, reference.block_stats(x, s, cfg.draw_block, kept)[1]


@pytest.mark.parametrize("shape", ["randn3", "flat", "peaked"])
def test_sums_and_kept_masses_are_exact(shape: str) -> None:
    B, V, cfg = 6, 1500, CONFIGS["gpu_preset"]  # was 3000: the same routes row by row
    logits = logits_of(shape, B, V, seed=5)
    params = [P(seed=i, temperature=0.8, **f) for i, f in enumerate(
        [dict(top_p=0.9), dict(top_k=50), dict(min_p=0.05), dict(top_p=0.7, min_p=0.02),
         dict(top_k=20, top_p=0.8), dict(min_p=0.3)])]  # fmt: skip
    both = run_both(params, logits, cfg)
    assert_same(both.ref, both.tri)
    y, kept, ym, kb = reference_rows(logits, both, cfg)
    for r in range(B):
        assert both.routes[r] in (int(R_SELECT), int(R_CUT))
        lo, inv_w = both.ws.rowf[r, int(F_LO)].item(), both.ws.rowf[r, int(F_INVW)].item()
        if both.routes[r] == int(R_SELECT):
            above = (y[r] > -torch.inf) & (y[r] >= lo)
            above &= bins(y[r], inv_w, cfg.bins) < both.ws.rowi[r, int(I_JHI)]
            q = (torch.exp(y[r][above]) * 2.0**32).to(torch.int64)
            assert both.ws.rowi[r, int(I_NAB)] == above.sum()
            got, want = both.ws.rowi[r, int(I_MAB)].item(), q.sum().item()
            assert abs(got - want) <= 1e-6 * want
        if both.ws.rowi[r, int(I_NMID)] == 0:  # no middle: the stored K_b are the whole K_b
            listed = ym[r] >= both.ws.rowf[r, int(F_KLO)]
            torch.testing.assert_close(both.ws.kept[r][listed].double(),
                                       kb[r][listed].double(), rtol=1e-6, atol=0)  # fmt: skip
            assert (kb[r][~listed] == 0).all()


def test_top_k_past_the_live_tokens_and_min_p_above_the_bracket() -> None:
    """A grammar mask leaving fewer live tokens than k keeps them all; a min-p cut above
    top-p's keeps what min-p keeps; neither needs the exact search."""
    B, V = 4, 2000
    logits = logits_of("flat", B, V, seed=6)
    bitmask = torch.zeros(B, (V + 31) // 32, dtype=torch.int32)
    bitmask[:2, 3] = 0x0F0F0F0F  # 16 live tokens
    bitmask[2:] = -1
    params = [
        P(seed=1, top_k=50),
        P(seed=2, top_k=50, top_p=0.9),
        P(seed=3, top_p=0.95, min_p=0.9),
        P(seed=4, top_k=500, top_p=0.99, min_p=0.8),
    ]
    both = run_both(params, logits, CONFIGS["gpu_preset"], bitmask=bitmask)
    assert_same(both.ref, both.tri)
    assert both.routes == [int(R_SELECT)] * B


def test_cut_rows_and_variants() -> None:
    """min-p alone in the default variant (a cut), beside top-k rows in top_k_top_p."""
    B, V = 6, 1200
    logits = logits_of("mixed", B, V, seed=7)
    both = run_both([P(seed=i, min_p=0.05 * (i + 1)) for i in range(B)], logits,
                    CONFIGS["interp16"])  # fmt: skip
    assert_same(both.ref, both.tri)
    tk = run_both([P(seed=i, top_k=3 + i) for i in range(B)], logits, CONFIGS["interp16"],
                  variant=SamplerVariant.TOP_K_TOP_P)  # fmt: skip
    assert_same(tk.ref, tk.tri)


def test_brackets_resolved_pairwise_and_by_search() -> None:
    """Wide bins gather brackets of a few and of hundreds of tokens: the cut is found from
    every pair up to FEW gathered, by the 16-way search past it; both equal the reference."""
    B, V = 12, 1500  # was 3000: every row still selects, brackets of <= and > FEW gathered
    cfg = CONFIGS["gpu_preset"].replace(bins=16)
    logits = torch.cat([logits_of("flat", B // 2, V, seed=5), logits_of("randn3", B // 2, V, 5)])
    filters = [
        dict(top_p=0.9),
        dict(top_k=50),
        dict(top_k=300, top_p=0.9),
        dict(top_p=0.7, min_p=0.02),
        dict(top_k=20, top_p=0.8),
        dict(top_p=0.5),
    ]
    both = run_both([P(seed=i, temperature=0.8, **filters[i % 6]) for i in range(B)], logits, cfg)
    assert_same(both.ref, both.tri)
    assert both.routes == [int(R_SELECT)] * B
    n_g = both.ws.rowi[:, int(I_NG)]
    assert (n_g <= int(FEW)).any() and (n_g > int(FEW)).any(), n_g.tolist()
