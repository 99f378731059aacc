"""The selection pass (`triton.select`): its histogram against a torch count of the same
bins, and the brackets it places (one, or two around top-p's and top-k's cuts)."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

from graphexec.params import SamplerVariant  # noqa: E402
from graphexec.sampling import (
    processing,  # noqa: E402
)
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors  # noqa: E402
from graphexec.sampling.triton import launch  # noqa: E402
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


@pytest.mark.parametrize("late_programs", [8, 128], ids=["rows_split_in_two", "rows_split_in_many"])
def test_round_1_rows_share_the_launch_programs(late_programs: int) -> None:
    """Round 1's passes serve the short kernel's row list (`Workspace.listed`) with all of
    the launch's programs: 2 filtered rows among 8 get 4x the slices a batch of 8 filtered
    rows gives each. Every listed row's histogram still counts each of its tokens above lo
    once, the list holds exactly the rows on the select route, and the tokens are the
    reference's. A persistent workspace's next call, with no filtered row, lists none."""
    B, V, cfg = 8, 1500, CONFIGS["gpu_preset"].replace(late_programs=late_programs)
    logits = logits_of("flat", B, V, seed=3)
    filt = {2: dict(top_p=0.9), 5: dict(top_k=50, top_p=0.9)}
    params = [P(seed=i, temperature=0.8, **filt.get(i, {})) for i in range(B)]
    both = run_both(params, logits, cfg)
    assert_same(both.ref, both.tri)
    listed = sorted(both.ws.listed[1 : 1 + int(both.ws.listed[0])].tolist())
    assert listed == [2, 5] and [r for r in range(B) if both.routes[r] == int(R_SELECT)] == listed
    x = processing.collapse_inf(processing.process_logits(logits, torch.arange(B), both.table))
    y = processing.scale(x, torch.arange(B), both.table)
    for r in listed:
        lo, inv_w = both.ws.rowf[r, int(F_LO)].item(), both.ws.rowf[r, int(F_INVW)].item()
        live = (y[r] > float("-inf")) & (y[r] >= lo)
        want = torch.bincount(bins(y[r][live], inv_w, cfg.bins) // int(FINE), minlength=cfg.bins)
        assert torch.equal(both.ws.hist[r].long(), want)
    plain = [P(seed=i, temperature=0.8) for i in range(B)]
    out = SamplerOutput.allocate(B, "cpu", None)
    table = SamplingTensors.from_params(plain, V, "cpu")
    launch.sample(logits, torch.arange(B), torch.arange(B), table, out, None,
                  SamplerVariant.DEFAULT, config=cfg, workspace=both.ws)  # fmt: skip
    assert int(both.ws.listed[0]) == 0
