"""Decode attention (`graphexec.kernels.attention`): the split-KV Triton kernel and the
blocked CPU route against the torch reference (the kernel under TRITON_INTERPRET=1 on
the CPU), a row's bits in any batch, and keys past the live range never read."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest
import torch

from graphexec.kernels.attention import (
    AttentionConfig,
    decode_attention,
    decode_attention_reference,
)  # fmt: skip
from graphexec.kernels.cpu_route import RowMM

T = 70
CFG = AttentionConfig(block_n=16, split_size=32)  # 3 splits of 70 keys: 32, 32, 6
ONE_SPLIT = AttentionConfig(block_n=16, split_size=128)
# rows 1 and 2 share slot 1; positions: 0, T - 1, either side of a split boundary (31 |
# 32), a tile and split start (64)
SLOTS = [0, 1, 1, 2, 3]
POSITIONS = [0, T - 1, 31, 32, 64]


def case(H: int, KV: int, hd: int, dtype=torch.float32, seed: int = 0, slots=SLOTS):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, max(slots) + 1, T, KV, hd, generator=g).to(dtype)
    q = torch.randn(len(slots), H, hd, generator=g).to(dtype)
    return q, kv, torch.tensor(slots), torch.tensor(POSITIONS[: len(slots)]), hd**-0.5


@pytest.mark.parametrize("shape", [(6, 2, 16), (4, 4, 24)], ids=["gqa3-hd16", "mha-hd24"])
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_matches_reference_fp32(shape, window) -> None:
    q, kv, slots, pos, scale = case(*shape)
    want = decode_attention_reference(q, kv, slots, pos, scale, window)
    got = decode_attention(q, kv, slots, pos, scale, window, config=CFG)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if window is None:  # one split: the combine divides acc by l alone
        one = decode_attention(q, kv, slots, pos, scale, window, config=ONE_SPLIT)
        torch.testing.assert_close(one, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize(("shape", "window"), [((6, 2, 16), None), ((4, 4, 24), 5)])
def test_kernel_low_precision(dtype, atol, shape, window) -> None:
    q, kv, slots, pos, scale = case(*shape, dtype=dtype, seed=1)
    got = decode_attention(q, kv, slots, pos, scale, window, config=CFG)
    assert got.dtype == dtype
    # against the exact attention of the same (rounded) inputs, as the reference is
    exact = decode_attention_reference(q.float(), kv.float(), slots, pos, scale, window)
    ref = decode_attention_reference(q, kv, slots, pos, scale, window)
    torch.testing.assert_close(got.float(), exact, rtol=0, atol=atol)
    torch.testing.assert_close(ref.float(), exact, rtol=0, atol=atol)


def test_row_bits_do_not_depend_on_the_batch() -> None:
    q, kv, slots, pos, scale = case(6, 2, 24, seed=2)
    full = decode_attention(q, kv, slots, pos, scale, 9, config=CFG)
    for rows in ([3, 1], [4], [2, 0, 4, 1, 3, 3]):  # subsets, reordered, repeated
        r = torch.tensor(rows)
        part = decode_attention(q[r], kv, slots[r], pos[r], scale, 9, config=CFG)
        assert torch.equal(part, full[r])


@pytest.mark.parametrize("window", [None, 7])
def test_keys_outside_the_live_range_are_never_read(window) -> None:
    slots = [0, 1, 2, 3, 4]  # one slot a row, so each row's dead keys can be poisoned
    q, kv, s, pos, scale = case(6, 2, 16, seed=3, slots=slots)
    clean = decode_attention(q, kv, s, pos, scale, window, config=CFG)
    j = torch.arange(T)
    for row, p in enumerate(POSITIONS):
        dead = (j > p) | ((j <= p - window) if window else torch.zeros_like(j, dtype=torch.bool))
        kv[:, slots[row], dead] = float("nan")
    got = decode_attention(q, kv, s, pos, scale, window, config=CFG)
    assert torch.isfinite(got).all()
    assert torch.equal(got, clean)
    ref = decode_attention_reference(q, kv, s, pos, scale, window)  # zeroes them first
    torch.testing.assert_close(ref, clean, rtol=1e-5, atol=1e-5)


def test_positions_are_clamped_into_the_cache() -> None:
    q, kv, slots, _, scale = case(4, 2, 16, seed=4, slots=[0, 1])
    bad, good = torch.tensor([-3, 10_000]), torch.tensor([0, T - 1])
    for fn in (decode_attention, decode_attention_reference):
        assert torch.equal(fn(q, kv, slots, bad, scale, config=CFG),
                           fn(q, kv, slots, good, scale, config=CFG))  # fmt: skip


def test_splits_depend_on_T_only_and_config_is_checked() -> None:
    assert CFG.splits(70) == (32, 3)
    assert AttentionConfig(block_n=16, split_size=16, max_splits=2).splits(70) == (48, 2)
    assert AttentionConfig().splits(4096) == (256, 16)
    assert AttentionConfig().splits(131072) == (2048, 64)
    with pytest.raises(ValueError, match="block_n"):
        AttentionConfig(block_n=24)
    with pytest.raises(ValueError, match="split_size"):
        AttentionConfig(block_n=32, split_size=48)
    q, kv, slots, pos, scale = case(6, 2, 16)
    with pytest.raises(ValueError, match="window"):
        decode_attention(q, kv, slots, pos, scale, 0, config=CFG)
    with pytest.raises(ValueError, match="one dtype"):
        decode_attention(q.half(), kv, slots, pos, scale, config=CFG)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention_reference(q[:, :5], kv, slots, pos, scale)


# ---- the CPU route: torch over live key blocks -------------------------------------------


def blocked(block: int):
    def fn(q, kv, slots, pos, scale, window=None, **_):
        return RowMM().attend(q, kv, slots, pos, scale, window, block=block)

    return fn


@pytest.mark.parametrize("block", [16, 32, 256])  # 70 keys: 5 blocks (last padded), 3, 1
@pytest.mark.parametrize("shape", [(6, 2, 16), (4, 4, 24)], ids=["gqa3-hd16", "mha-hd24"])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_blocked_matches_reference(block, shape, window) -> None:
    q, kv, slots, pos, scale = case(*shape, seed=5)
    want = decode_attention_reference(q, kv, slots, pos, scale, window)
    got = blocked(block)(q, kv, slots, pos, scale, window)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the kernel's tolerance
    for dtype, atol in ((torch.bfloat16, 3e-2), (torch.float16, 4e-3)):
        low = blocked(block)(q.to(dtype), kv.to(dtype), slots, pos, scale, window)
        exact = decode_attention_reference(q.to(dtype).float(), kv.to(dtype).float(), slots,
                                           pos, scale, window)  # fmt: skip
        assert low.dtype == dtype
        torch.testing.assert_close(low.float(), exact, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 9])
def test_blocked_row_bits_do_not_depend_on_the_other_rows_or_their_reach(dtype, window):
    """A row alone, beside rows that reach other blocks, reordered, repeated, in row
    chunks of any size: the same bits (compared as integers, so -0.0 != 0.0 too)."""
    g = torch.Generator().manual_seed(6)
    T_, S = 1100, 8
    kv = torch.randn(2, S, T_, 2, 16, generator=g).to(dtype)
    q = torch.randn(S, 6, 16, generator=g).to(dtype)
    slots = torch.arange(S)
    pos = torch.tensor([0, 3, 63, 64, 300, 700, 1023, T_ - 1])
    bits = torch.int32 if dtype == torch.float32 else torch.int16

    def run(rows, **kw):
        r = torch.tensor(rows)
        out = RowMM().attend(q[r], kv, slots[r], pos[r], 0.25, window, **kw)
        return out.view(bits)

    full = run(list(range(S)))
    for rows in ([0], [1], [3, 1], [7, 0], [1, 7, 1], [6, 2, 5, 4, 3, 0, 1, 7]):
        assert torch.equal(run(rows), full[rows]), rows


def test_blocked_never_reads_keys_past_a_rows_blocks() -> None:
    """Keys outside a row's live blocks (past its position's block, before its window's)
    are never read: NaN there changes no bit."""
    g = torch.Generator().manual_seed(7)
    T_, block = 4096, 256
    kv = torch.randn(2, 3, T_, 2, 16, generator=g)
    q = torch.randn(3, 4, 16, generator=g)
    slots, scale = torch.arange(3), 0.25
    for pos, window in (([5, 17, 100], None), ([5, 300, 40], None), ([3000, 2990, 3050], 64)):
        p = torch.tensor(pos)
        poisoned = kv.clone()
        for r, x in enumerate(pos):
            poisoned[:, r, (x // block + 1) * block :] = float("nan")
            if window is not None:
                poisoned[:, r, : max(0, x - window + 1) // block * block] = float("nan")
        want = RowMM().attend(q, kv, slots, p, scale, window)
        assert torch.equal(RowMM().attend(q, poisoned, slots, p, scale, window), want)
        exact = decode_attention_reference(q, kv, slots, p, scale, window)
        torch.testing.assert_close(want, exact, rtol=1e-5, atol=1e-5)


def test_blocked_edge_cases() -> None:
    q, kv, slots, _, scale = case(4, 2, 16, seed=4, slots=[0, 1])
    bad, good = torch.tensor([-3, 10_000]), torch.tensor([0, T - 1])
    fn = blocked(32)
    assert torch.equal(fn(q, kv, slots, bad, scale), fn(q, kv, slots, good, scale))
    assert fn(q[:0], kv, slots[:0], good[:0], scale).shape == (0, 4, 16)
    assert RowMM().attend(q[:0], kv, slots[:0], good[:0], scale).shape == (0, 4, 16)


@pytest.mark.gpu
def test_cuda_kernel_bf16_and_graph_replay() -> None:
    """A 0.5B-like shape (Qwen2.5-0.5B: 14 heads, 2 KV heads, hd 64) at T = 4096: the
    kernel against the exact attention, then captured: replay gives eager's bits, and
    replays with new positions and slots give that call's eager bits."""
    B, H, KV, hd, S, T_ = 32, 14, 2, 64, 40, 4096
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    kv = torch.randn(2, S, T_, KV, hd, generator=g, device=dev).to(dt)
    q = torch.randn(B, H, hd, generator=g, device=dev).to(dt)
    slots = torch.randperm(S, generator=g, device=dev)[:B]
    pos = torch.randint(0, T_, (B,), generator=g, device=dev)
    pos[:4] = torch.tensor([0, T_ - 1, 255, 256], device=dev)
    cfg, scale = AttentionConfig.gpu(), hd**-0.5
    for window in (None, 1000):
        got = decode_attention(q, kv, slots, pos, scale, window, config=cfg)
        exact = decode_attention_reference(q.float(), kv.float(), slots, pos, scale, window)
        torch.testing.assert_close(got.float(), exact, rtol=0, atol=2e-2)
    eager = decode_attention(q, kv, slots, pos, scale, config=cfg)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (Triton JIT, allocator) off the capture
        for _ in range(2):
            decode_attention(q, kv, slots, pos, scale, config=cfg)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, kv, slots, pos, scale, config=cfg)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    pos.copy_(torch.randint(0, T_, (B,), generator=g, device=dev))
    slots.copy_(torch.randperm(S, generator=g, device=dev)[:B])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, decode_attention(q, kv, slots, pos, scale, config=cfg))
