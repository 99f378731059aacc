"""The late queue (`triton.late`, SamplerConfig.late_queue): the short route and both
rounds' passes drained as items of one launch give the seven launches' tokens, routes and
row lists on every route, with rows outnumbering a round's programs or not, and leave the
queue empty for the next call."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

from graphexec.params import SamplerVariant  # noqa: E402
from graphexec.sampling import reference  # noqa: E402
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors  # noqa: E402
from graphexec.sampling.triton import late, launch  # noqa: E402
from graphexec.sampling.triton.sampler_config import (  # noqa: E402
    Q_NEED,
    R_CUT,
    R_DONE,
    R_ROUND2,
    R_SELECT,
    Workspace,
)  # fmt: skip
from tests.sampling.triton_cases import (  # noqa: E402
    CONFIGS,
    P,
    assert_same,
    logits_of,
    mixed,
    run_both,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


class _Spy:
    """Stands in for `launch._late_kernel`: records each launch's grid and its gate (the
    rows the tail and check kernels counted), then launches the kernel."""

    def __init__(self):
        self.grids, self.gates = [], []

    def __getitem__(self, grid):
        def run(P, W, *args, **kw):
            self.grids.append(grid)
            self.gates.append(int(W.queue[int(Q_NEED)]))
            return late._late_kernel[grid](P, W, *args, **kw)

        return run


@pytest.fixture
def spy(monkeypatch) -> _Spy:
    s = _Spy()
    monkeypatch.setattr(launch, "_late_kernel", s)
    return s


def _rows(B: int) -> list:
    """Top-p 0.9 on randn * 3 rows (round 2 at 64 bins and a gather cap of 16), top-k + top-p,
    min-p alone (the cut route), greedy."""
    kinds = [dict(top_p=0.9), dict(top_p=0.9), dict(top_k=60, top_p=0.9), dict(min_p=0.05),
             dict(temperature=0.0, top_p=0.9)]  # fmt: skip
    return [P(seed=i, **{"temperature": 1.0, **kinds[i % len(kinds)]}) for i in range(B)]


def _both_ways(params, logits, cfg, calls=1):
    """The reference's tokens, then per setting of late_queue: (tokens, routes, row lists)
    of its last call on one workspace (`calls` calls), which must leave the queue zeroed."""
    B, V = logits.shape
    table = SamplingTensors.from_params(params, V, "cpu")
    slots, pos = torch.arange(B), torch.arange(B) * 7 + 3
    ref = SamplerOutput.allocate(B, "cpu", None)
    reference.sample(logits, slots, pos, table, ref, None, SamplerVariant.DEFAULT,
                     draw_block=cfg.draw_block)  # fmt: skip
    out = {}
    for on in (False, True):
        ws = Workspace.allocate(B, V, "cpu", cfg)
        for _ in range(calls):
            tri = SamplerOutput.allocate(B, "cpu", None)
            launch.sample(logits, slots, pos, table, tri, None, SamplerVariant.DEFAULT,
                          config=cfg.replace(late_queue=B if on else 0), workspace=ws)  # fmt: skip
            assert_same(ref, tri)
            assert not ws.queue.any(), ws.queue.nonzero().flatten().tolist()
        lists = [lst[: 1 + int(lst[0])].clone() for lst in (ws.listed, ws.refine)]
        out[on] = (tri.token_ids, ws.rowi[:, 0].clone(), *lists)
    for a, b in zip(out[False], out[True], strict=True):
        assert torch.equal(a, b)
    return out[True][1].tolist()


@pytest.mark.parametrize("late_programs", [3, 16], ids=["rows_outnumber_programs", "rows_split"])
def test_the_queue_serves_both_rounds_like_the_launches(late_programs: int) -> None:
    """64 bins and a gather cap of 16: rows take round 2, others round 1 alone, min-p rows
    the cut; with 3 programs round 2's rows outnumber them (an item is a whole row)."""
    B, V = 8, 1024
    cfg = CONFIGS["interp16"].replace(gather_cap=16, bins=64, late_programs=late_programs)
    routes = _both_ways(_rows(B), logits_of("randn3", B, V, seed=5), cfg)
    assert routes.count(int(R_ROUND2)) > 3  # more than rows_outnumber_programs' 3
    assert {int(R_SELECT), int(R_CUT), int(R_DONE)} <= set(routes)


@pytest.mark.parametrize("shape, calls", [("peaked", 1), ("mixed", 2)])
def test_the_queue_serves_the_short_route_and_rows_done_at_the_check(shape: str,
                                                                      calls: int) -> None:
    """With the short route and the candidate's check on: rows drawn by the tail or the check
    (outside the gate), rows the short route finishes, penalties, bias and NaN / inf rows;
    the mixed rows twice on one workspace."""
    B, V = 12, 640
    routes = _both_ways(mixed(B, seed=3, V=V), logits_of(shape, B, V, seed=9),
                        CONFIGS["interp16_short"], calls=calls)  # fmt: skip
    assert int(R_DONE) in routes


def test_a_batch_with_no_filtered_row_opens_no_gate(spy: _Spy) -> None:
    """Greedy and unfiltered rows in the default variant: the tail draws them all, the gate
    stays shut and the queue serves nothing."""
    B, V = 5, 512
    params = [P(seed=i, **({"temperature": 0.0} if i % 2 else {})) for i in range(B)]
    routes = _both_ways(params, logits_of("randn3", B, V, seed=2), CONFIGS["interp16"])
    assert routes == [int(R_DONE)] * B
    assert spy.gates == [0]


def test_rows_the_check_pass_rejects_open_the_gate(spy: _Spy) -> None:
    """Two flat rows at top-p 0.6 whose candidates the check pass (not the tail) rejects:
    the check kernel alone counts them in the gate, and the queue plans and serves them."""
    B, V = 2, 640
    params = [P(seed=i, temperature=1.0, top_p=0.6) for i in range(B)]
    routes = _both_ways(params, logits_of("flat", B, V, seed=0), CONFIGS["interp16_short"])
    assert int(R_DONE) not in routes
    assert spy.gates == [2]


@pytest.mark.parametrize("late_queue", [3, 4])
def test_the_queue_serves_batches_up_to_its_size_only(spy: _Spy, late_queue: int) -> None:
    """SamplerConfig.late_queue is a batch size: a batch of 4 rows takes the queue at 4 and
    the seven launches at 3, with the same tokens."""
    B, V = 4, 512
    params = [P(seed=i, temperature=1.0, top_p=0.9) for i in range(B)]
    both = run_both(params, logits_of("randn3", B, V, seed=4),
                    CONFIGS["interp16"].replace(late_queue=late_queue))  # fmt: skip
    assert_same(both.ref, both.tri)
    assert len(spy.grids) == (late_queue >= B)
