"""The measured read floor of the sampler benchmark (`floor.read`): one Triton kernel that
reads every logit of [B, V] once and writes each row's max.

A sampler has to read its row at least once, so this kernel's time, taken under the same
protocol in the same run as the samplers (L2 flushed, instruction caches evicted, CUDA-graph
replay), is the floor their times are judged against; bytes over copy bandwidth was an
estimate of it.

One launch. The grid is rows x slices: at B = 1 a row is cut into up to ceil(V / BLOCK)
slices so that the whole GPU reads it, at B = 256 into a few (about PROGRAMS_PER_SM programs
per SM in all). Each program keeps its slice's max; with one slice per row it is the row's
max, written directly. With several, each program writes its partial max, bumps its row's
counter, and the program that arrives last (the counter read before its bump is slices - 1)
reads the row's partial maxima, writes their max and resets the counter to 0 for the next
call (the counters are a persistent workspace, as a sampler's are, so a replayed graph needs
no memset).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PROGRAMS_PER_SM = 4  # programs of 8 warps: 32 warps per SM, 32 KB of loads in flight
BLOCK_BYTES = 8192  # read per program per loop step: 2048 fp32 / 4096 bf16 logits
NUM_WARPS = 8


@triton.jit
def _row_max_kernel(
    logits_ptr,  # [B, V] fp32 / bf16 / fp16, rows stride_row apart, unit stride
    partial_ptr,  # [B, NUM_SLICES] fp32 scratch (unused with one slice)
    counter_ptr,  # [B] int32, zero between calls (unused with one slice)
    out_ptr,  # [B] fp32: each row's max
    V,  # logits per row
    stride_row,  # elements between rows
    SLICE: tl.constexpr,  # logits per program, a multiple of BLOCK
    NUM_SLICES: tl.constexpr,  # programs per row: cdiv(V, SLICE)
    BLOCK: tl.constexpr,  # logits per loop step
    SLICES_P2: tl.constexpr,  # next_power_of_2(NUM_SLICES)
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    base = logits_ptr + row.to(tl.int64) * stride_row
    start = part * SLICE
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for k in range(0, SLICE, BLOCK):
        idx = start + k + offs
        x = tl.load(base + idx, mask=idx < V, other=float("-inf"))
        acc = tl.maximum(acc, x.to(tl.float32))
    m = tl.max(acc, axis=0)
    if NUM_SLICES == 1:
        tl.store(out_ptr + row, m)
    else:
        tl.store(partial_ptr + row * NUM_SLICES + part, m)
        tl.debug_barrier()  # the partial store is ordered before the counter's release
        arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel")
        if arrived == NUM_SLICES - 1:  # the row's last program: every partial is written
            p_offs = tl.arange(0, SLICES_P2)
            p = tl.load(partial_ptr + row * NUM_SLICES + p_offs, mask=p_offs < NUM_SLICES,
                        other=float("-inf"), cache_modifier=".cg")  # fmt: skip
            tl.store(out_ptr + row, tl.max(p, axis=0))
            tl.store(counter_ptr + row, 0)


def num_programs_target(device: torch.device) -> int:
    """About how many programs a launch should have to read at the device's bandwidth."""
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: a few slices, so the split path runs on the CPU too


def plan(B: int, V: int, element_size: int, target: int) -> tuple[int, int, int]:
    """(BLOCK, SLICE, NUM_SLICES) for [B, V] logits and `target` programs."""
    block = min(BLOCK_BYTES // element_size, triton.next_power_of_2(V))
    blocks = triton.cdiv(V, block)
    want = min(blocks, max(1, triton.cdiv(target, B)))  # slices per row
    slice_len = max(1, blocks // want) * block  # at least `want` slices
    return block, slice_len, triton.cdiv(V, slice_len)


class RowMax:
    """row_max = RowMax(B, V, dtype, device); row_max(logits) -> [B] fp32 row maxima, in
    one launch, on buffers allocated here (capturable: no allocation per call)."""

    def __init__(self, B: int, V: int, dtype: torch.dtype, device: torch.device,
                 target: int | None = None) -> None:  # fmt: skip
        self.B, self.V = B, V
        target = num_programs_target(device) if target is None else target
        self.block, self.slice, self.num_slices = plan(B, V, dtype.itemsize, target)
        self.partial = torch.empty(B, self.num_slices, dtype=torch.float32, device=device)
        self.counter = torch.zeros(B, dtype=torch.int32, device=device)
        self.out = torch.empty(B, dtype=torch.float32, device=device)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape == (self.B, self.V) and logits.stride(1) == 1, logits.shape
        _row_max_kernel[(self.B, self.num_slices)](
            logits_ptr=logits,
            partial_ptr=self.partial,
            counter_ptr=self.counter,
            out_ptr=self.out,
            V=self.V,
            stride_row=logits.stride(0),
            SLICE=self.slice,
            NUM_SLICES=self.num_slices,
            BLOCK=self.block,
            SLICES_P2=triton.next_power_of_2(self.num_slices),
            num_warps=NUM_WARPS,
        )
        return self.out


def row_max(logits: torch.Tensor, target: int | None = None) -> torch.Tensor:
    """[B] fp32 max of each row of [B, V] logits (a fresh RowMax: for tests)."""
    B, V = logits.shape
    return RowMax(B, V, logits.dtype, logits.device, target)(logits)
