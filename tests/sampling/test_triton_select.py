"""The selection pass (`triton.select`): its histogram against a torch count of the same
bins, and the brackets it places (one, or two around top-p's and top-k's cuts)."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

from graphexec.sampling import (
    processing,  # noqa: E402
)
from graphexec.sampling.triton.draw import FINE  # noqa: E402
from graphexec.sampling.triton.sampler_config import (  # noqa: E402
    F_INVW,
    F_LO,
    I_J1,
    I_J2,
    I_JHI,
    I_JLO,
    R_SELECT,
)  # fmt: skip
from tests.sampling.triton_cases import CONFIGS, P, assert_same, logits_of, run_both  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def bins(y: torch.Tensor, inv_w: float, nbins: int) -> torch.Tensor:
    """`draw.bin_of` in torch: min(floor(-y * inv_w * FINE), nbins * FINE - 1), fp32, in
    fine bins (FINE to a histogram bin)."""
    f = ((-y) * torch.tensor(inv_w, dtype=torch.float32)) * int(FINE)
    return torch.clamp(f, max=nbins * int(FINE) - 1.0).to(torch.int64)


@pytest.mark.parametrize("shape", ["randn3", "peaked", "flat"])
def test_histogram_counts_every_token_above_lo(shape: str) -> None:
    B, V, cfg = 6, 1500, CONFIGS["gpu_preset"]  # was 3000: the same routes row by row
    logits = logits_of(shape, B, V, seed=3)
    params = [P(seed=i, temperature=0.8, **f) for i, f in enumerate(
        [dict(top_p=0.9), dict(top_k=50), dict(top_k=50, top_p=0.9), dict(top_p=0.5, min_p=0.05),
         dict(top_k=5), dict(top_k=1000, top_p=0.95)])]  # fmt: skip
    both = run_both(params, logits, cfg)
    assert_same(both.ref, both.tri)
    x = processing.collapse_inf(processing.process_logits(logits, torch.arange(B), both.table))
    y = processing.scale(x, torch.arange(B), both.table)
    for r in range(B):
        assert both.routes[r] == int(R_SELECT)
        lo, inv_w = both.ws.rowf[r, int(F_LO)].item(), both.ws.rowf[r, int(F_INVW)].item()
        live = (y[r] > float("-inf")) & (y[r] >= lo)
        want = torch.bincount(bins(y[r][live], inv_w, cfg.bins) // int(FINE), minlength=cfg.bins)
        assert torch.equal(both.ws.hist[r].long(), want)
        jhi, j1, j2, jlo = (both.ws.rowi[r, c].item() for c in map(int, (I_JHI, I_J1, I_J2, I_JLO)))
        assert 0 <= jhi <= j1 < j2 and j2 - 1 <= jlo < int(FINE) * cfg.bins


def test_far_apart_cuts_get_two_brackets() -> None:
    """top-k 2000 with top-p 0.95 on randn * 3 (V = 4096): top-k's cut lies far below
    top-p's; the bins between are summed, not gathered, and the tokens stay exact."""
    B, V = 4, 4096
    logits = logits_of("randn3", B, V, seed=4)
    params = [P(seed=i, temperature=0.9, top_k=2000, top_p=0.95) for i in range(B)]
    both = run_both(params, logits, CONFIGS["gpu_preset"])
    assert_same(both.ref, both.tri)
    assert both.routes == [int(R_SELECT)] * B
    assert all(both.ws.rowi[r, int(I_J2)] > both.ws.rowi[r, int(I_J1)] + 1 for r in range(B))
