"""`split_gather` (CPU interpreter): the first round of the candidates of top-p rows
without top-k, gathered by B x SPLIT programs, is exactly the set {y >= tau} whatever the
split, the other rows are left alone, and the tokens drawn are the reference's for any
split and with the split gather off.

The row kernel is wrapped so the test sees what `split_gather` left for it (the row's
(cert, guess), the candidate count and the packed keys) before the draw runs.
"""

from __future__ import annotations

from tests.triton_env import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

import graphexec as gx  # noqa: E402
from graphexec.params import SamplerVariant  # noqa: E402
from graphexec.sampling import reference  # noqa: E402
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors  # noqa: E402
from graphexec.sampling.triton import launch  # noqa: E402

P = gx.SamplingParams
V = 320
DB = 16  # 20 blocks
KW = dict(tile_v=16, rows=2, cap=64, small=8, mid=16, draw_block=DB)


def rows_and_params() -> tuple[torch.Tensor, list[gx.SamplingParams]]:
    g = torch.Generator().manual_seed(5)
    scales = [1.5, 3.0, 0.7, 2.0, 3.0, 2.5, 1.0, 2.0]
    logits = torch.stack([torch.randn(V, generator=g) * s for s in scales])
    logits[7, 40:60] = float("-inf")  # a row with dead blocks
    params = [
        P(top_p=0.9, seed=1),
        P(top_k=5, temperature=0.9, seed=2),
        P(top_k=12, seed=3),
        P(top_p=0.7, min_p=0.05, seed=4),
        P(top_k=30, top_p=0.8, min_p=0.01, seed=5),
        P(min_p=0.05, temperature=0.9, seed=6),
        P(seed=7),  # no filter: split_gather leaves it alone
        P(top_p=0.5, temperature=1.3, seed=8, logit_bias={3: 4.0, 300: 6.0}),
    ]
    return logits, params


class RowKernelSpy:
    """Stands in for `_row_draw_kernel`: records (thr, cnt, cand) then runs the kernel."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __getitem__(self, grid):
        def launch_(*args, **kw):
            # 17 processing args, 4 bias args, 7 per-slot / per-row tables, xm, q, then
            # thr, cnt, cblk, cand
            thr, cnt, cand = args[30], args[31], args[33]
            assert thr.dtype == torch.float32 and cnt.dtype == torch.int32
            self.seen.append((thr.clone(), cnt.clone(), cand.clone()))
            return self.kernel[grid](*args, **kw)

        return launch_


def draw(logits, params, monkeypatch, **kw):
    """Tokens, table and what the row kernel was handed; the split gather on (whatever
    the default) unless the test set launch.SPLIT_MAX_B itself."""
    if "SPLIT_MAX_B" not in kw.pop("keep", ()):
        monkeypatch.setattr(launch, "SPLIT_MAX_B", 128)
    spy = RowKernelSpy(launch._row_draw_kernel)
    monkeypatch.setattr(launch, "_row_draw_kernel", spy)
    n = logits.shape[0]
    table = SamplingTensors.from_params(params, V, "cpu")
    out = SamplerOutput.allocate(n, "cpu", None)
    launch.sample(logits, torch.arange(n), torch.arange(n) + 3, table, out, None,
                  SamplerVariant.DEFAULT, **{**KW, **kw})  # fmt: skip
    monkeypatch.setattr(launch, "_row_draw_kernel", spy.kernel)
    return out.token_ids, table, spy.seen[0]


def expected_candidates(logits, table, thr, r) -> set[int]:
    """{i : y_i >= tau} for row r, y = (x - m) * inv_t in fp32 (x the processed row)."""
    n = logits.shape[0]
    y = reference.scale(reference.process_logits(logits, torch.arange(n), table),
                        torch.arange(n), table)[r]  # fmt: skip
    tau = torch.maximum(thr[r, 0], thr[r, 1] - launch.TOP_P_STEP)
    return set(torch.nonzero((y >= tau) & (y > float("-inf"))).flatten().tolist())


def stored_ids(cand, cnt, r) -> list[int]:
    keys = cand[r, : int(cnt[r])]
    return (0xFFFFFFFF - (keys & 0xFFFFFFFF)).tolist()


@pytest.mark.parametrize("gather_cap", [64, 512])
@pytest.mark.parametrize("split_blocks", [1, 3, 7, 24])
def test_split_gathers_exactly_the_candidates(split_blocks, gather_cap, monkeypatch) -> None:
    """1, 3, 7 blocks per program (tiles of 2: partly filled ones too), one program per
    row: the count is #{y >= tau}, each candidate is stored once and no other token is;
    past gather_cap (2 rows at 64, none at 512) the count still holds and the stored keys
    are distinct candidates."""
    logits, params = rows_and_params()
    _, table, (thr, cnt, cand) = draw(logits, params, monkeypatch, split_blocks=split_blocks,
                                      gather_cap=gather_cap)  # fmt: skip
    past = 0
    for r, p in enumerate(params):
        if p.top_k > 0 or p.top_p >= 1.0:  # not split: tau NaN, nothing gathered
            assert bool(torch.isnan(thr[r, 2])) and int(cnt[r]) == 0, r
            continue
        want = expected_candidates(logits, table, thr, r)
        ids = stored_ids(cand, cnt.clamp(max=gather_cap), r)
        assert int(cnt[r]) == len(want), r
        if len(want) <= gather_cap:
            assert sorted(ids) == sorted(want), r
        else:
            past += 1
            assert len(set(ids)) == gather_cap and set(ids) <= want, r
    assert past == (2 if gather_cap == 64 else 0)


@pytest.mark.parametrize("split_blocks,max_b", [(1, 128), (5, 128), (24, 128), (None, 0)])
def test_split_changes_no_token(split_blocks, max_b, monkeypatch) -> None:
    """Any split, or none (SPLIT_MAX_B 0: every row gathers in its own program)."""
    monkeypatch.setattr(launch, "SPLIT_MAX_B", max_b)
    logits, params = rows_and_params()
    tok, table, _ = draw(logits, params, monkeypatch, split_blocks=split_blocks,
                         keep=("SPLIT_MAX_B",))  # fmt: skip
    n = logits.shape[0]
    ref = SamplerOutput.allocate(n, "cpu", None)
    reference.sample(logits, torch.arange(n), torch.arange(n) + 3, table, ref, None,
                     SamplerVariant.DEFAULT, draw_block=DB)  # fmt: skip
    assert torch.equal(tok, ref.token_ids)


@pytest.mark.parametrize("bad", [-1, launch.SPLIT_SLICE + 1])
def test_split_blocks_out_of_range_is_refused(bad) -> None:
    table = SamplingTensors.from_params([P(seed=1, top_p=0.5)], V, "cpu")
    out = SamplerOutput.allocate(1, "cpu", None)
    with pytest.raises(ValueError, match="split_blocks must lie in"):
        launch.sample(torch.randn(1, V), torch.arange(1), torch.arange(1), table, out,
                      **{**KW, "split_blocks": bad})  # fmt: skip
