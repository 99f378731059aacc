"""The Triton Philox (graphexec.sampling.triton.philox) equals graphexec.rng bit for bit."""

from tests.triton_env import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from graphexec.rng import Stream, gumbel, random_bits, uniform  # noqa: E402
from graphexec.sampling.triton.philox import (  # noqa: E402
    OUT_GUMBEL,
    OUT_UNIFORM,
    gather_bits,
    philox_bits,
    philox_gather,
)
from graphexec.sampling.triton.philox import gumbel as tl_gumbel  # noqa: E402
from graphexec.sampling.triton.philox import to_uniform as tl_to_uniform  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SEEDS = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, 0x0123456789ABCDEF]
POSITIONS = [0, 1, 2**31, 2**32 - 1, 977]
STREAMS = [int(s) for s in Stream]


def _grid_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Every (seed, pos) pair of SEEDS x POSITIONS, one per row."""
    s = torch.tensor(SEEDS, dtype=torch.int64)
    p = torch.tensor(POSITIONS, dtype=torch.int64)
    return s.repeat_interleave(len(p)).to(DEV), p.repeat(len(s)).to(DEV)


def _ref(seed: torch.Tensor, pos: torch.Tensor, vocab: int, stream: int) -> torch.Tensor:
    tok = torch.arange(vocab, device=seed.device)
    return random_bits(seed[:, None], pos[:, None], tok[None, :], stream)


@pytest.mark.parametrize("stream", STREAMS)
def test_tile_bits_equal_reference(stream: int) -> None:
    # 30 rows in [32, 64] tiles: a padded last row block, two token blocks, V % 4 != 0
    seed, pos = _grid_rows()
    V = 101
    got = philox_bits(seed, pos, V, stream, block_r=32, block=64)
    assert got.dtype == torch.int64 and got.shape == (len(seed), V)
    assert torch.equal(got, _ref(seed, pos, V, stream))


@pytest.mark.parametrize("block_r", [1, 4, 8])
def test_tile_bits_row_blocks(block_r: int) -> None:
    # R = 6 is not a multiple of 4: the padding rows must not leak into the result
    seed = torch.tensor([3, 0, 2**63 - 1, 5, 9, 1], device=DEV)
    pos = torch.tensor([0, 2**32 - 1, 7, 7, 1, 2**20], device=DEV)
    got = philox_bits(seed, pos, 22, 1, block_r=block_r, block=16)
    assert torch.equal(got, _ref(seed, pos, 22, 1))


@pytest.mark.parametrize("stream", STREAMS)
def test_block_bits_equal_reference(stream: int) -> None:
    # one row per program (block_bits); a few rows only, the interpreter is slow per program
    seed = torch.tensor([0, 2**63 - 1, 12345, 2**32], device=DEV)
    pos = torch.tensor([2**32 - 1, 0, 3, 2**31], device=DEV)
    V = 37  # not a multiple of 4, last block partial
    got = philox_bits(seed, pos, V, stream, block=32)
    assert torch.equal(got, _ref(seed, pos, V, stream))


def test_block_bits_token_order() -> None:
    # tokens 4g..4g+3 come from one Philox call, lanes 0..3 in token order
    seed = torch.tensor([42], device=DEV)
    pos = torch.tensor([5], device=DEV)
    got = philox_bits(seed, pos, 16, block=16)[0]
    for t in range(16):
        one = random_bits(seed, pos, torch.tensor([t], device=DEV))
        assert int(got[t]) == int(one[0]), t


def test_gather_bits_equal_reference() -> None:
    g = torch.Generator().manual_seed(0)
    seed, pos = _grid_rows()
    ids = torch.randint(0, 2**24, (len(seed), 13), generator=g).to(DEV)
    ids[:, :4] = torch.tensor([0, 1, 2, 3])  # every lane
    ids[:, 4] = 2**21 - 1
    for stream in STREAMS:
        got = philox_gather(seed, pos, ids, stream)
        assert torch.equal(got, random_bits(seed[:, None], pos[:, None], ids, stream))


def test_gather_matches_row_bits() -> None:
    # gather_bits and tile_bits give one token the same word
    seed = torch.tensor([7, 2**63 - 1], device=DEV)
    pos = torch.tensor([0, 2**32 - 1], device=DEV)
    ids = torch.tensor([[0, 5, 50, 63], [63, 1, 2, 33]], device=DEV)
    rows = philox_bits(seed, pos, 64, block_r=2, block=64)
    assert torch.equal(philox_gather(seed, pos, ids), rows.gather(1, ids))


def test_uniform_and_gumbel_from_kernels() -> None:
    seed, pos = _grid_rows()
    V = 45
    tok = torch.arange(V, device=DEV)
    u = philox_bits(seed, pos, V, block_r=32, block=64, out=OUT_UNIFORM)
    assert u.dtype == torch.float32
    assert torch.equal(u, uniform(seed[:, None], pos[:, None], tok[None, :]))
    g = philox_bits(seed, pos, V, block_r=32, block=64, out=OUT_GUMBEL)
    ref = gumbel(seed[:, None], pos[:, None], tok[None, :])
    # log may differ in the last ulp between backends (DESIGN.md); the uniforms may not
    torch.testing.assert_close(g, ref, rtol=2e-6, atol=1e-6)
    ids = tok[None, :].expand(len(seed), V)
    assert torch.equal(philox_gather(seed, pos, ids, out=OUT_UNIFORM), u)


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


@triton.jit
def _gather_shared_ids_kernel(seed_ptr, pos_ptr, out_ptr, R, N, BR: tl.constexpr, BN: tl.constexpr):
    # ids [BN] shared by all rows, seed / pos [BR, 1]: gather_bits broadcasts them
    r = tl.arange(0, BR)
    c = tl.arange(0, BN)
    seed = tl.load(seed_ptr + r, mask=r < R, other=0)[:, None]
    pos = tl.load(pos_ptr + r, mask=r < R, other=0)[:, None]
    bits = gather_bits(seed, pos, c * 3, 2)
    m = (r < R)[:, None] & (c < N)[None, :]
    tl.store(out_ptr + r[:, None] * N + c[None, :], bits.to(tl.int64), mask=m)


def test_gather_bits_broadcasts_shared_ids() -> None:
    seed = torch.tensor([1, 2**63 - 1, 0], device=DEV)
    pos = torch.tensor([2**32 - 1, 0, 8], device=DEV)
    out = torch.empty(3, 10, dtype=torch.int64, device=DEV)
    _gather_shared_ids_kernel[(1,)](seed, pos, out, 3, 10, 4, 16)
    ids = torch.arange(10, device=DEV) * 3
    assert torch.equal(out, random_bits(seed[:, None], pos[:, None], ids[None, :], 2))
