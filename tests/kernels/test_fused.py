"""The fused decode kernels (`graphexec.kernels.fused`) against their torch references
(under TRITON_INTERPRET=1 on the CPU), and `HFTransformer.decode` through them.

Tolerances: the residual add, the rotary embedding and the cache write round op for op as
torch does, so they are compared bitwise in every dtype. The norm's 1 / rms and silu's
exp are float32 functions whose last bit may differ from torch's: float32 results agree
to 1e-6 relative, bf16 / fp16 ones to one unit in the dtype's last place (and the
fraction of such elements is small)."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest
import torch

from graphexec.kernels.fused import (
    FusedConfig,
    rope_kv_write,
    rope_kv_write_reference,
    silu_mul,
    silu_mul_reference,
)  # fmt: skip
from graphexec.kernels.rms_norm import residual_rms_norm, residual_rms_norm_reference
from graphexec.models import HFTransformer

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: 1e-6 relative; else within one ulp of the dtype, at most 5% of elements."""
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    g, w = got.float(), want.float()
    torch.testing.assert_close(g, w, rtol=ULP[dtype], atol=ULP[dtype] * 1e-2)
    assert (g != w).float().mean() <= 0.05


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [24, 67])
def test_residual_rms_norm(dtype, D) -> None:
    x, r = randn(5, D, dtype=dtype), randn(5, D, dtype=dtype, seed=1, scale=3.0)
    w = randn(D, dtype=dtype, seed=2)
    for res in (r, None):
        got, got_new = residual_rms_norm(x, res, w, 1e-6)
        want, want_new = residual_rms_norm_reference(x, res, w, 1e-6)
        assert torch.equal(got_new, want_new)  # the add rounds as torch's does
        close(got, want, dtype)
    assert residual_rms_norm(x, None, w, 1e-6)[1] is x  # no residual: x is the stream
    # strided rows (a view of a wider tensor) read as the contiguous ones
    wide = randn(5, 2 * D, dtype=dtype, seed=3)
    got, new = residual_rms_norm(wide[:, :D], r, w, 1e-6)
    assert torch.equal(got, residual_rms_norm(wide[:, :D].contiguous(), r, w, 1e-6)[0])


T, S = 11, 3


def rope_case(H, KV, hd, dtype, positions, slots, seed=0):
    B = len(positions)
    qkv = randn(B, (H + 2 * KV) * hd, dtype=dtype, seed=seed)
    t = torch.arange(T, dtype=torch.float32)
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    emb = torch.cat([torch.outer(t, inv)] * 2, dim=-1)
    kv = randn(2, S, T, KV, hd, dtype=dtype, seed=seed + 1)
    return qkv, torch.tensor(positions), torch.tensor(slots), emb.cos().to(dtype), \
        emb.sin().to(dtype), kv  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 2, 16), (3, 3, 10)], ids=["gqa-hd16", "mha-hd10"])
def test_rope_kv_write_is_bitwise_the_reference(dtype, shape) -> None:
    # positions 0 and T - 1, out of range both ways (clamped); slots shared by rows
    positions, slots = [0, T - 1, 4, -3, 10_000, 5], [0, 1, 1, 2, 0, 0]
    qkv, pos, slot, cos, sin, kv = rope_case(*shape, dtype, positions, slots)
    kv_ref = kv.clone()
    got = rope_kv_write(qkv, pos, slot, cos, sin, kv, shape[0])
    want = rope_kv_write_reference(qkv, pos, slot, cos, sin, kv_ref, shape[0])
    assert got.shape == (6, shape[0], shape[2]) and got.dtype == dtype
    assert torch.equal(got, want)
    assert torch.equal(kv, kv_ref)  # written entries equal, the others untouched
    clamped = pos.clamp(0, T - 1)
    H, KV, hd = shape
    v = qkv[:, (H + KV) * hd :].view(-1, KV, hd)
    assert torch.equal(kv[1, slot, clamped], v)


def test_rope_kv_write_strided_qkv_and_cache_views() -> None:
    """qkv a column slice of a wider tensor, kv one layer of a [layers, ...] cache."""
    positions, slots = [2, 7], [2, 0]
    qkv, pos, slot, cos, sin, kv = rope_case(4, 2, 8, torch.bfloat16, positions, slots)
    wide = torch.cat([qkv, qkv[:, :5]], dim=1)[:, : qkv.shape[1]]
    cache = torch.stack([kv, kv]).clone()
    ref = cache.clone()
    got = rope_kv_write(wide, pos, slot, cos, sin, cache[1], 4)
    want = rope_kv_write_reference(qkv, pos, slot, cos, sin, ref[1], 4)
    assert torch.equal(got, want) and torch.equal(cache, ref)
    with pytest.raises(ValueError, match="even head_dim"):
        rope_kv_write(qkv, pos, slot, cos, sin, kv, 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 37])
def test_silu_mul(dtype, inter) -> None:
    gu = randn(4, 2 * inter, dtype=dtype, scale=4.0)
    cfg = FusedConfig(silu_block=16)  # several programs per row, a ragged last one
    for config in (cfg, None):
        close(silu_mul(gu, config=config), silu_mul_reference(gu), dtype)
    with pytest.raises(ValueError, match="silu_block"):
        FusedConfig(silu_block=24)


def test_warp_counts_must_be_positive_and_the_norms_default_follows_the_row() -> None:
    for name in ("norm_warps", "rope_warps", "silu_warps"):
        for bad in (0, -2):
            with pytest.raises(ValueError, match=name):
                FusedConfig(**{name: bad})
    assert [FusedConfig().norm_warps_for(b) for b in (256, 1024, 2048, 4096, 8192)] == [
        4, 4, 8, 16, 16]  # fmt: skip
    assert FusedConfig(norm_warps=2).norm_warps_for(4096) == 2


transformers = pytest.importorskip("transformers")
BASE = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=97, intermediate_size=72, max_position_embeddings=64)  # fmt: skip


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_through_the_kernels_matches_the_torch_path(kind, dtype) -> None:
    """A tiny random Qwen2 (q/k/v biases, hd 12) and Llama: decode with the fused kernels
    forced on the CPU against the torch references, step by step, same caches. In bf16
    and fp16 the kernels round op for op as torch does, and on these inputs the norm and
    silu land on torch's bits too: logits and caches are bitwise equal (a last-bit
    difference of 1 / rms or exp would show here first)."""
    torch.manual_seed(0)
    if kind == "qwen2":
        ref = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**BASE))
    else:
        ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE))
    torch_path = HFTransformer(ref, max_seq_len=16, dtype=dtype, fused=False)
    kernels = HFTransformer(ref, max_seq_len=16, dtype=dtype, fused=True)
    for m in (torch_path, kernels):
        m.bind(3, "cpu")
        m.prefill(0, torch.tensor([5, 17, 50, 3, 9]))
        m.prefill(1, torch.tensor([1, 2]))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=0)
    for t in range(4):
        # rows 0 and 2 share slot 0 at different positions; row 3 is clamped to T - 1
        args = (torch.tensor([t + 1, t + 7, 3, 4]), torch.tensor([5 + t, 2 + t, 12 + t, 99]),
                torch.tensor([0, 1, 0, 2]))  # fmt: skip
        want, got = torch_path.decode(*args), kernels.decode(*args)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(kernels.kv_cache.float(), torch_path.kv_cache.float(), **tol)


@pytest.mark.gpu
def test_cuda_kernels_bf16_at_the_05b_shape() -> None:
    """Qwen2.5-0.5B's shape (hidden 896, 14 heads, 2 KV heads, hd 64, intermediate 4864)
    in bf16 at B = 32: each kernel against its reference on CUDA."""
    dev, dt, B, D, H, KV, hd, inter = "cuda", torch.bfloat16, 32, 896, 14, 2, 64, 4864
    g = torch.Generator(device=dev).manual_seed(0)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)

    x, r, w = rn(B, D), rn(B, D, scale=4.0), rn(D)
    got, new = residual_rms_norm(x, r, w, 1e-6)
    want, want_new = residual_rms_norm_reference(x, r, w, 1e-6)
    assert torch.equal(new, want_new)
    close(got, want, dt)
    gu = rn(B, 2 * inter, scale=4.0)
    close(silu_mul(gu), silu_mul_reference(gu), dt)
    T_ = 4096
    t = torch.arange(T_, dtype=torch.float32, device=dev)
    inv = 1.0 / 1e6 ** (torch.arange(0, hd, 2, dtype=torch.float32, device=dev) / hd)
    emb = torch.cat([torch.outer(t, inv)] * 2, dim=-1)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    kv = rn(2, 40, T_, KV, hd)
    kv_ref = kv.clone()
    qkv = rn(B, (H + 2 * KV) * hd)
    slots = torch.randperm(40, generator=g, device=dev)[:B]
    pos = torch.randint(0, T_, (B,), generator=g, device=dev)
    pos[:3] = torch.tensor([0, T_ - 1, T_ + 5], device=dev)
    q = rope_kv_write(qkv, pos, slots, cos, sin, kv, H)
    q_ref = rope_kv_write_reference(qkv, pos, slots, cos, sin, kv_ref, H)
    assert torch.equal(q, q_ref) and torch.equal(kv, kv_ref)
