"""Round 2 (`triton.select.plan_round2`): rows whose first bracket misses its cut or
overflows the gather cap are served by a second, narrower bracket, never by the serial
exact search, and still get the reference's tokens; its few rows share the round's
programs whatever their number."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

from graphexec.params import SamplerVariant  # noqa: E402
from graphexec.sampling import reference  # noqa: E402
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors  # noqa: E402
from graphexec.sampling.triton import launch  # noqa: E402
from graphexec.sampling.triton.sampler_config import (  # noqa: E402
    R_EXACT,
    R_ROUND2,
    R_SELECT,
    Workspace,
)  # fmt: skip
from tests.sampling.triton_cases import CONFIGS, P, assert_same, logits_of, run_both  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def randn3_rows(B: int) -> list:
    """Top-p 0.9 at temperature 1 on randn * 3 rows (a third with top-k 60 too): the mass
    of a row's few largest tokens dominates, so a coarse histogram places top-p's crossing
    a few bins off (seen on the H100 at 512 bins, 1 row in about 30 at V = 128256)."""
    return [P(seed=i, temperature=1.0, top_p=0.9, **({"top_k": 60} if i % 3 == 2 else {}))
            for i in range(B)]  # fmt: skip


@pytest.mark.parametrize("late_programs", [3, 16], ids=["rows_share_programs", "rows_split"])
def test_missed_brackets_are_served_by_round_2(late_programs: int) -> None:
    """64 bins and a gather cap of 16 over 1024 tokens: about half the rows miss their
    first bracket. With 3 programs round 2's rows outnumber its programs (each program
    serves several rows whole); with 16 each row is split over several programs."""
    # 8 rows (was 12: the same first 8 rows, routes unchanged): 5 take round 2, more than
    # the 3 programs of rows_share_programs
    B, V = 8, 1024
    cfg = CONFIGS["interp16"].replace(gather_cap=16, bins=64, late_programs=late_programs)
    logits = logits_of("randn3", B, V, seed=5)
    both = run_both(randn3_rows(B), logits, cfg)
    assert_same(both.ref, both.tri)
    assert both.routes.count(int(R_ROUND2)) >= 4
    assert int(R_SELECT) in both.routes
    assert int(R_EXACT) not in both.routes


def test_a_persistent_workspace_starts_each_call_with_an_empty_refine_list() -> None:
    """The executor's workspace serves every step: rows that took round 2 in one call must
    not be served (and overwritten) by round 2 in the next."""
    B, V = 6, 1024
    cfg = CONFIGS["interp16"].replace(gather_cap=16, bins=64)
    table = SamplingTensors.from_params(randn3_rows(B), V, "cpu")
    ws = Workspace.allocate(B, V, "cpu", cfg)
    slots, pos = torch.arange(B), torch.arange(B) * 5
    for shape, round2 in (("randn3", True), ("ties", False)):
        logits = logits_of(shape, B, V, seed=7)
        ref = SamplerOutput.allocate(B, "cpu", None)
        tri = SamplerOutput.allocate(B, "cpu", None)
        reference.sample(logits, slots, pos, table, ref, None, SamplerVariant.DEFAULT,
                         draw_block=cfg.draw_block)  # fmt: skip
        launch.sample(logits, slots, pos, table, tri, None, SamplerVariant.DEFAULT, config=cfg,
                      workspace=ws)  # fmt: skip
        assert_same(ref, tri)
        routes = ws.rowi[:, 0].tolist()
        assert (int(R_ROUND2) in routes) == round2, routes
        assert int(ws.refine[0]) == routes.count(int(R_ROUND2))


def test_round_2_with_penalties_bias_and_min_p() -> None:
    """Round 2 bins processed values (bias, penalties) and keeps min-p's cut."""
    B, V = 6, 700  # round 2 serves some rows (asserted), select the others
    params = [P(seed=40 + i, temperature=1.0, top_p=0.85, min_p=0.001, presence_penalty=0.5,
                logit_bias={3: 4.0, 9: -2.0}) for i in range(B)]  # fmt: skip
    logits = logits_of("randn3", B, V, seed=6)
    counts = torch.zeros(B, V, dtype=torch.int32)
    counts[:, :50] = 1
    cfg = CONFIGS["interp16"].replace(gather_cap=32, bins=32)
    both = run_both(params, logits, cfg, counts=counts)
    assert_same(both.ref, both.tri)
    assert int(R_ROUND2) in both.routes
