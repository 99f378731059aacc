"""benchmarks/row_primitives.py: each timed primitive computes what its name says (its
chain of repetitions against torch, under the interpreter on the CPU); on a GPU every
primitive reports positive cycles."""

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import row_primitives  # noqa: E402
import torch  # noqa: E402


def step(op: str, v: torch.Tensor) -> int:
    """One repetition's result s of the kernel's primitive on v [N] int64."""
    i, pos = torch.arange(v.shape[0]), (v > 0).to(torch.int64)
    if op == "cumsum":
        return int(v.cumsum(0).max())
    if op == "histogram256":
        return int(torch.bincount(v & 255, minlength=256).max())
    if op in ("gather_scan", "row_scan"):  # the count of positives, either way
        return int(pos.cumsum(0).max())
    if op == "sum":
        return int(v.sum())
    if op == "sort_int64":  # the largest (v << 32 | i) as int32: the last max's index
        return int(i[v == v.max()].max())
    return int(v.max())  # max, store_reload


def reference_checksum(op: str, x: torch.Tensor, reps: int) -> int:
    """The kernel's chain in torch: each repetition's result s added up, v ^= s & 1."""
    v, chk = x.to(torch.int64), 0
    for _ in range(reps):
        s = step(op, v)
        chk += s
        v = v ^ (s & 1)
    return chk


@pytest.mark.parametrize("op", row_primitives.OPS)
def test_each_primitive_computes_its_result(op) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-50, 50, (256,), dtype=torch.int32, generator=gen)
    out = row_primitives.run(op, x, warps=4, reps=3)
    assert int(out[2]) == reference_checksum(op, x, 3)


@pytest.mark.gpu
def test_every_primitive_takes_cycles_on_gpu() -> None:
    dev = torch.device("cuda")
    for op in row_primitives.OPS:
        r = row_primitives.measure(op, 1024, 8, 8, dev)
        assert r["cycles"] > 0 and r["ns"] > 0, r
        x = torch.randint(-50, 50, (1024,), dtype=torch.int32, device=dev)
        out = row_primitives.run(op, x, warps=8, reps=3)
        assert int(out[2]) == reference_checksum(op, x.cpu(), 3), op
