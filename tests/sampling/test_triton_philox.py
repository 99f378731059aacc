"""The Triton Philox (graphexec.sampling.triton.philox) equals graphexec.rng bit for bit."""

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from graphexec.rng import Stream, gumbel, random_bits, uniform  # noqa: E402
from graphexec.sampling.triton.philox import block_bits, token_bits  # noqa: E402
from graphexec.sampling.triton.philox import gumbel as tl_gumbel  # noqa: E402
from graphexec.sampling.triton.philox import to_uniform as tl_to_uniform  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SEEDS = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, 0x0123456789ABCDEF]
POSITIONS = [0, 1, 2**31, 2**32 - 1, 977]
STREAMS = [int(s) for s in Stream]


@triton.jit
def _rows_kernel(seed_ptr, pos_ptr, out_ptr, V, BLOCK: tl.constexpr, STREAM: tl.constexpr,
                 OUT: tl.constexpr):  # fmt: skip
    """Row r's words (OUT 0), uniforms (1) or Gumbel noise (2) of tokens 0..V-1, a block of
    BLOCK tokens per program: grid (rows, cdiv(V, BLOCK))."""
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    bits = block_bits(tl.load(seed_ptr + row), tl.load(pos_ptr + row), start, BLOCK, STREAM)
    if OUT == 1:
        v = tl_to_uniform(bits)
    elif OUT == 2:
        v = tl_gumbel(bits)
    else:
        v = bits.to(tl.int64)
    cols = start + tl.arange(0, BLOCK)
    tl.store(out_ptr + row * V + cols, v, mask=cols < V)


def rows(seed, pos, V, stream=0, block=64, out=0) -> torch.Tensor:
    res = torch.empty((len(seed), V), dtype=torch.int64 if out == 0 else torch.float32,
                      device=DEV)  # fmt: skip
    _rows_kernel[(len(seed), triton.cdiv(V, block))](seed, pos, res, V, block, stream, out)
    return res


def _grid_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Every (seed, pos) pair of SEEDS x POSITIONS, one per row."""
    s = torch.tensor(SEEDS, dtype=torch.int64)
    p = torch.tensor(POSITIONS, dtype=torch.int64)
    return s.repeat_interleave(len(p)).to(DEV), p.repeat(len(s)).to(DEV)


def _ref(seed: torch.Tensor, pos: torch.Tensor, vocab: int, stream: int) -> torch.Tensor:
    tok = torch.arange(vocab, device=seed.device)
    return random_bits(seed[:, None], pos[:, None], tok[None, :], stream)


@pytest.mark.parametrize("stream", STREAMS)
def test_block_bits_equal_reference(stream: int) -> None:
    # two blocks of 64 tokens, V % 4 != 0, every seed and position edge case
    seed, pos = _grid_rows()
    V = 101
    got = rows(seed, pos, V, stream)
    assert got.shape == (len(seed), V)
    assert torch.equal(got, _ref(seed, pos, V, stream))


def test_block_bits_token_order() -> None:
    # the 4 words of a Philox call belong to 4 consecutive tokens, in order
    seed = torch.tensor([7], device=DEV)
    pos = torch.tensor([3], device=DEV)
    got = rows(seed, pos, 16, block=16)[0]
    assert torch.equal(got, _ref(seed, pos, 16, 0)[0])
    assert len(set(got.tolist())) == 16


def test_uniform_and_gumbel_from_kernels() -> None:
    seed, pos = _grid_rows()
    V = 45
    tok = torch.arange(V, device=DEV)
    u = rows(seed, pos, V, out=1)
    assert torch.equal(u, uniform(seed[:, None], pos[:, None], tok[None, :]))
    g = rows(seed, pos, V, out=2)
    ref = gumbel(seed[:, None], pos[:, None], tok[None, :])
    # log may differ in the last ulp between backends (DESIGN.md); the uniforms may not
    torch.testing.assert_close(g, ref, rtol=2e-6, atol=1e-6)


@triton.jit
def _ids_kernel(seed_ptr, pos_ptr, ids_ptr, out_ptr, N, STREAM: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    """Row r's words of the N token ids at ids_ptr (any order): grid (rows,)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + i, mask=i < N, other=0)
    bits = token_bits(tl.load(seed_ptr + row), tl.load(pos_ptr + row), ids, STREAM)
    tl.store(out_ptr + row * N + i, bits.to(tl.int64), mask=i < N)


@pytest.mark.parametrize("stream", STREAMS)
def test_token_bits_equal_block_bits_at_any_ids(stream: int) -> None:
    # ids out of order, repeated, each residue mod 4, past 2**16 (the vocabularies' range)
    seed, pos = _grid_rows()
    ids = torch.tensor([5, 0, 151935, 3, 4, 4, 1027, 65538, 2, 128255, 1, 99], device=DEV)
    got = torch.empty((len(seed), len(ids)), dtype=torch.int64, device=DEV)
    _ids_kernel[(len(seed),)](seed, pos, ids.to(torch.int32), got, len(ids), stream, 16)
    want = random_bits(seed[:, None], pos[:, None], ids[None, :], stream)
    assert torch.equal(got, want)


@triton.jit
def _map_kernel(bits_ptr, u_ptr, g_ptr, N, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < N
    bits = tl.load(bits_ptr + i, mask=m, other=0).to(tl.uint32)
    tl.store(u_ptr + i, tl_to_uniform(bits), mask=m)
    tl.store(g_ptr + i, tl_gumbel(bits), mask=m)


def test_uniform_extremes_are_exact_and_gumbel_finite() -> None:
    words = [0, 1, 255, 256, 511, 2**31, 2**32 - 257, 2**32 - 256, 2**32 - 1]
    bits = torch.tensor(words, dtype=torch.int64, device=DEV)
    u = torch.empty(len(words), dtype=torch.float32, device=DEV)
    g = torch.empty_like(u)
    _map_kernel[(1,)](bits, u, g, len(words), 16)
    expect = torch.tensor([((w >> 8) | 1) * 2.0**-24 for w in words], dtype=torch.float32)
    assert torch.equal(u.cpu(), expect)
    assert float(u.min()) == 2.0**-24 and float(u.max()) == 1 - 2.0**-24
    assert bool(torch.isfinite(g).all())
    torch.testing.assert_close(g, -torch.log(-torch.log(u)), rtol=2e-6, atol=1e-6)
