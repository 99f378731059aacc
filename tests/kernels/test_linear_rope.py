"""`matmul.linear_rope`: the q/k/v GEMM whose epilogue rotates and writes the cache gives
the bits of the GEMM, then `fused.rope_kv_write`, then the torch reference's rotation;
`fused.pair_rotary_rows` is a permutation of rows that the paired rotary kernel undoes."""

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest
import torch

from graphexec.kernels import matmul as mm
from graphexec.kernels.fused import pair_rotary_rows, rope_kv_write, rope_kv_write_reference
from graphexec.kernels.matmul_config import MatmulTile

T, S = 24, 4  # cache positions and slots


def case(M, H, KV, hd, K, dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    N = (H + 2 * KV) * hd
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    t = torch.arange(T, dtype=torch.float32)
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    emb = torch.cat([torch.outer(t, inv)] * 2, dim=-1)
    # distinct positions below T - 1 (rows may share a slot), row 0's clamped to T - 1
    pos = torch.randperm(T - 1, generator=g)[:M] if M < T else torch.randint(0, T - 1, (M,))
    pos[0] = T + 5
    slots = torch.randint(0, S, (M,), generator=g)
    kv = torch.randn(2, S, T, KV, hd, generator=g).to(dtype)
    return x, w, b, pos, slots, emb.cos().to(dtype), emb.sin().to(dtype), kv


def test_pair_rotary_rows_puts_each_rotated_pair_side_by_side() -> None:
    H, KV, hd = 3, 1, 8
    w = torch.arange((H + 2 * KV) * hd, dtype=torch.float32)
    p = pair_rotary_rows(w, H, KV)
    head = p[hd : 2 * hd]  # the second q head: dims 0, 4, 1, 5, ...
    assert head.tolist() == [hd + d for i in range(hd // 2) for d in (i, i + hd // 2)]
    assert torch.equal(p[(H + KV) * hd :], w[(H + KV) * hd :])  # v as it is
    assert torch.equal(pair_rotary_rows(p, H, KV, inverse=True), w)
    with pytest.raises(ValueError, match="even head_dim"):
        pair_rotary_rows(torch.zeros(5 * 7), H, KV)


@pytest.mark.parametrize("shape,programs,dtype", [
    ((4, 2, 8), 1, torch.float32), ((4, 2, 8), 2, torch.bfloat16),
    ((2, 2, 16), 2, torch.float32), ((2, 2, 16), 1, torch.bfloat16)],
    ids=["gqa-hd8-fp32", "gqa-hd8-2-programs-bf16", "mha-hd16-2-programs-fp32",
         "mha-hd16-bf16"])  # fmt: skip
def test_linear_rope_is_the_gemm_then_the_rotary_kernel(shape, programs, dtype) -> None:
    """Fused (one program per tile, or a tile's parts over 2 programs) equals linear on the
    checkpoint's rows then rope_kv_write, and the torch rotation, bit for bit: q, the
    written cache entries, and every entry it must not touch."""
    H, KV, hd = shape
    M, K = 7, 64
    x, w, b, pos, slots, cos, sin, kv = case(M, H, KV, hd, K, dtype)
    N = w.shape[0]
    cfg = mm.MatmulConfig.interpreter().replace(
        tiles=((N, K, MatmulTile(16, 16, 16, 1, 1, split=4)),))
    for bias in (b, None):
        kv_got, kv_two, kv_ref = kv.clone(), kv.clone(), kv.clone()
        got = mm._launch(x, pair_rotary_rows(w, H, KV), None if bias is None else
                         pair_rotary_rows(bias, H, KV), False, cfg, programs,
                         rope=(pos, slots, cos, sin, kv_got, H))  # fmt: skip
        qkv = mm.linear(x, w, bias, config=cfg)
        two = rope_kv_write(qkv, pos, slots, cos, sin, kv_two, H)
        ref = rope_kv_write_reference(qkv, pos, slots, cos, sin, kv_ref, H)
        assert got.shape == (M, H, hd) and got.dtype == dtype
        assert torch.equal(got, two) and torch.equal(got, ref)
        assert torch.equal(kv_got, kv_two) and torch.equal(kv_got, kv_ref)
        assert not torch.equal(kv_got, kv)  # it wrote
        kv_paired = kv.clone()
        paired = rope_kv_write(mm.linear(x, pair_rotary_rows(w, H, KV), None if bias is None
                                         else pair_rotary_rows(bias, H, KV), config=cfg),
                               pos, slots, cos, sin, kv_paired, H, paired=True)  # fmt: skip
        # the large-M route: GEMM, then the paired kernel
        assert torch.equal(paired, got) and torch.equal(kv_paired, kv_got)


@pytest.mark.parametrize("shape,dtype", [((3, 1, 12), torch.bfloat16), ((2, 2, 6), torch.float32),
                                         ((4, 2, 16), torch.float16)])  # fmt: skip
def test_the_paired_rotary_kernel_is_the_rotary_kernel_on_paired_columns(shape, dtype) -> None:
    """rope_kv_write(paired=True) on columns in pair_rotary_rows' order gives the plain
    kernel's q and cache bit for bit (head dims that are not powers of two included)."""
    H, KV, hd = shape
    M, T = 5, 8
    g = torch.Generator().manual_seed(hd)
    qkv = (torch.randn(M, (H + 2 * KV) * hd, generator=g) * 4).to(dtype)
    cos, sin = torch.rand(T, hd, generator=g).to(dtype), torch.rand(T, hd, generator=g).to(dtype)
    pos, slots = torch.tensor([0, 3, 7, 2, 5]), torch.tensor([1, 0, 1, 2, 0])
    kv = torch.randn(2, 3, T, KV, hd, generator=g).to(dtype)
    kv_plain, kv_paired = kv.clone(), kv.clone()
    plain = rope_kv_write(qkv, pos, slots, cos, sin, kv_plain, H)
    cols = pair_rotary_rows(qkv.t(), H, KV).t().contiguous()
    paired = rope_kv_write(cols, pos, slots, cos, sin, kv_paired, H, paired=True)
    assert torch.equal(paired, plain) and torch.equal(kv_paired, kv_plain)
    assert not torch.equal(kv_plain, kv)


def test_linear_rope_names_bad_operands() -> None:
    x, w, b, pos, slots, cos, sin, kv = case(3, 2, 1, 8, 32, torch.float32)
    with pytest.raises(ValueError, match="does not hold"):
        mm.linear_rope(x, w[:-8], None, pos, slots, cos, sin, kv, 2)
    with pytest.raises(ValueError, match="positions and slot_ids"):
        mm.linear_rope(x, w, b, pos[:2], slots, cos, sin, kv, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(32, 8, 64, 2048), (32, 8, 128, 4096), (14, 2, 64, 896)],
                         ids=["llama-1b", "llama-8b", "qwen-0.5b"])
def test_cuda_linear_rope_is_the_gemm_then_the_rotary_kernel(shape) -> None:
    """bf16 at the real models' q/k/v shapes, with the tiles a model binds: the fused
    launch (and the TMA route at M >= large_m) equals the GEMM then rope_kv_write, q and
    cache bit for bit, at M = 1, 7, 64, 256."""
    H, KV, hd, K = shape
    torch.manual_seed(0)
    for M in (1, 7, 64, 256):
        x, w, b, pos, slots, cos, sin, kv = (t.cuda() if t is not None else None for t in
                                             case(M, H, KV, hd, K, torch.bfloat16, seed=M))
        slots = torch.arange(M, device="cuda")  # distinct: any positions
        kv = torch.randn(2, 300, T, KV, hd, device="cuda", dtype=torch.bfloat16)
        cfg = mm.verify_large_tiles(mm.MatmulConfig.gpu(), [(w, False)])
        kv_got, kv_two = kv.clone(), kv.clone()
        got = mm.linear_rope(x, pair_rotary_rows(w, H, KV), pair_rotary_rows(b, H, KV), pos,
                             slots, cos, sin, kv_got, H, config=cfg)  # fmt: skip
        two = rope_kv_write(mm.linear(x, w, b, config=cfg), pos, slots, cos, sin, kv_two, H)
        assert torch.equal(got, two), M
        assert torch.equal(kv_got, kv_two), M
