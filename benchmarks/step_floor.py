"""The decode step's memory floor, shared by `bench_step.py --model` (step_model.py) and
the profile scenario (step_profile.py).

A decode step over B rows must read every GEMM weight once (each layer's q/k/v, o,
gate/up and down matrices, then the LM head) and, in each layer, the keys and values of
every row's live positions: positions 0..p for a row whose input sits at model position
p, the last `window` of them in a sliding-window layer. Norm weights, biases and the
embedding rows of the B input tokens are left out (kilobytes). `floor_bytes` counts those
bytes from the model's bound tensors (the layout and dtype the route reads); at the read
bandwidth measured in the same run (`read_bandwidth`: one Triton kernel reading a 2 GiB
buffer once, `floor_kernel.RowMax`) they give the floor time: `floor_us`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from floor_kernel import RowMax

GEMMS = ("qkv", "o", "gate_up", "down")  # a decoder layer's weights (HFTransformer)


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def kv_read_bytes(positions: Sequence[int], windows: Sequence[int | None], max_seq_len: int,
                  kv_heads: int, head_dim: int, element_size: int) -> int:  # fmt: skip
    """Keys + values a decode step reads over all layers (one window per layer, None: the
    whole context) for rows whose inputs sit at model `positions` (each clamped to the
    cache, as the model clamps it)."""
    per_position = 2 * kv_heads * head_dim * element_size
    total = 0
    for w in windows:
        span = max_seq_len if w is None else min(w, max_seq_len)
        total += sum(min(min(max(p, 0), max_seq_len - 1) + 1, span) for p in positions)
    return total * per_position


def weight_bytes(model) -> int:
    """Every GEMM weight of the bound model plus its LM head, as the route holds them."""
    layers = sum(nbytes(*(getattr(layer, n) for n in GEMMS)) for layer in model.layers)
    return layers + nbytes(model.lm_head)


def floor_bytes(model, positions: Sequence[int]) -> dict[str, int]:
    """The bytes one decode step of `model` must read for rows at model `positions`:
    weight_bytes (GEMM weights + LM head), kv_bytes (live keys and values), floor_bytes
    (their sum). The model must be bound (its KV cache allocated)."""
    kv = model.kv_cache  # [layers, 2, slots, max_seq_len, kv_heads, head_dim]
    windows = getattr(model, "windows", [None] * model.num_layers)
    kvb = kv_read_bytes(list(positions), windows, kv.shape[3], kv.shape[4], kv.shape[5],
                        kv.element_size())  # fmt: skip
    w = weight_bytes(model)
    return dict(weight_bytes=w, kv_bytes=kvb, floor_bytes=w + kvb)


def floor_us(nbytes_read: int, bandwidth: float) -> float:
    """Microseconds to read `nbytes_read` bytes at `bandwidth` bytes/s."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
    return nbytes_read / bandwidth * 1e6


def read_bandwidth(device: str, reps: int = 10) -> float:
    """Bytes per second of one Triton kernel reading 2 GiB once (the fastest of reps: a
    floor is the read rate the device reaches, and a slow rep is the host's or the
    clocks'; CUDA)."""
    x = torch.randn(64, 1 << 24, device=device, dtype=torch.bfloat16)
    rm = RowMax(64, 1 << 24, x.dtype, torch.device(device))
    rm(x)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        rm(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    n = nbytes(x)
    del x
    return n / min(times)
