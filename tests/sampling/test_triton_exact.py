"""The exact search (`triton.exact`): rows whose brackets do not resolve in either round
(forced with a gather cap of 1, or runs of equal values wider than the cap) are still the
reference's."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

from graphexec.sampling.triton.sampler_config import R_EXACT  # noqa: E402
from tests.sampling.triton_cases import (  # noqa: E402
    CONFIGS,
    P,
    assert_same,
    extras,
    logits_of,
    run_both,
)  # fmt: skip

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
FILTERS = [dict(top_k=5), dict(top_p=0.8), dict(top_k=30, top_p=0.6), dict(top_p=0.9, min_p=0.05),
           dict(top_k=3, top_p=0.9, min_p=0.2), dict(top_k=200, top_p=0.99)]  # fmt: skip


@pytest.mark.parametrize("ways", [4, 16])
def test_every_selection_through_the_exact_search(ways: int) -> None:
    # V 224 (was 800, then 400: the exact search's passes walk every block, so its time
    # follows V): every row takes the route it took at 400 (select, round 2, exact, done,
    # select, exact); the same two rows (top_k=30 top_p=0.6, top_k=200 top_p=0.99) take the
    # exact search, which the count below checks (V > 200 keeps top_k=200 a real cut)
    B, V = len(FILTERS), 224
    logits = logits_of("mixed", B, V, seed=8)
    counts, prompt, bitmask = extras(B, V, seed=8)
    params = [P(seed=i, temperature=0.5 + 0.2 * i, presence_penalty=0.2, **f)
              for i, f in enumerate(FILTERS)]  # fmt: skip
    cfg = CONFIGS["interp16"].replace(gather_cap=1, search_ways=ways)
    both = run_both(params, logits, cfg, counts=counts, prompt=prompt, bitmask=bitmask)
    assert_same(both.ref, both.tri)
    # rows whose bracket held one token at most resolve there (round 1 or 2), the others
    # in the exact search
    assert both.routes.count(int(R_EXACT)) >= 2


def test_wide_runs_of_equal_values() -> None:
    """Half the row at one value, half at another: the cut falls inside a run of ties
    wider than the gather cap."""
    B, V = len(FILTERS), 640  # was 1000: runs of 320 > the cap of 64; all six rows exact
    logits = torch.where(torch.arange(V) % 2 == 0, 1.0, 0.5).repeat(B, 1)
    logits[1, 7] = 3.0
    params = [P(seed=30 + i, temperature=0.7, **f) for i, f in enumerate(FILTERS)]
    both = run_both(params, logits, CONFIGS["gpu_preset"].replace(gather_cap=64))
    assert_same(both.ref, both.tri)
    assert int(R_EXACT) in both.routes
