"""The benchmark's read floor (`benchmarks/floor_kernel.py`, method `floor.read`) against
torch: each row's max, on the CPU under the Triton interpreter (a CUDA device where there
is one), one slice per row and several (the last program of a row reduces the partial
maxima and resets its counter, so a second call on the same buffers is right too)."""

from tests.interpreter import ensure_interpreter

ensure_interpreter()


import floor_kernel  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, V, target", [(1, 5000, 8), (3, 5000, 1), (4, 777, 64), (2, 70, 8)])
def test_row_max_equals_torch(dtype, B, V, target):
    g = torch.Generator().manual_seed(B * 1000 + V)
    x = (torch.randn(B, V, generator=g) * 5).to(dtype)
    x[0, V - 1] = 100.0  # the max in the last (partial) block of row 0
    if B > 1:
        x[1, :] = -torch.inf  # a row of -inf
        x[1, 3] = -7.5
    x = x.to(DEVICE)
    rm = floor_kernel.RowMax(B, V, dtype, DEVICE, target=target)
    if target > 1 and V > rm.block:
        assert rm.num_slices > 1  # the split path with its counters
    want = x.float().amax(dim=1)
    for _ in range(2):  # the counters are back to zero after a call
        assert torch.equal(rm(x).clone(), want)
        assert not rm.counter.any()


def test_row_max_reads_strided_rows():
    x = torch.randn(3, 9000).to(DEVICE)[:, 100:8100]  # rows 9000 apart
    assert torch.equal(floor_kernel.row_max(x, target=6), x.amax(dim=1))


def test_plan_covers_the_row_and_fills_the_gpu():
    for B, V, size, target in [(1, 128256, 4, 528), (256, 151936, 2, 528), (32, 49152, 4, 528),
                               (1, 70, 4, 8)]:  # fmt: skip
        block, slice_len, n = floor_kernel.plan(B, V, size, target)
        assert slice_len % block == 0 and (n - 1) * slice_len < V <= n * slice_len
        assert block * size <= floor_kernel.BLOCK_BYTES
        assert B * n >= min(target, B * -(-V // block))  # enough programs (or one per block)
    assert floor_kernel.plan(528, 128256, 4, 528)[2] == 1  # B >= target: a program a row
