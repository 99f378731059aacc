"""The Triton backend of `sample_step`: launches only.

Large V: `blocks._block_pass_kernel` reads the logits once (B x SPLIT programs) and
stores per-block stats; for filtered variants and batches up to SPLIT_MAX_B,
`split_gather` computes the thresholds of top-p rows without top-k (B programs) and
gathers their first candidates (B x SPLIT programs); `rowdraw._row_draw_kernel` (one
program per row) draws, reading again only the blocks that can hold the token. Small V
(one block): `sample._sample_tile_kernel` holds whole rows. Then the logprobs writer.

Buffers are allocated per call with shapes fixed by (B, V); under CUDA-graph capture they
come from the graph's pool, so replays reuse them. No host sync and no branch on tensor
values: everything data-dependent happens inside the kernels.
"""

from __future__ import annotations

import functools

import torch
import triton

from graphexec.params import SamplerVariant
from graphexec.rng import Stream
from graphexec.sampling.reference import DRAW_BLOCK
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.sampling.triton import interpreter_enabled
from graphexec.sampling.triton.blocks import _block_pass_kernel
from graphexec.sampling.triton.logprobs import write_logprobs
from graphexec.sampling.triton.process import process, process_args
from graphexec.sampling.triton.raw_logprobs import _raw_logprobs_kernel
from graphexec.sampling.triton.rowdraw import _row_draw_kernel
from graphexec.sampling.triton.sample import _sample_tile_kernel
from graphexec.sampling.triton.split_gather import _split_gather_kernel, _thresholds_kernel

_GPU = not interpreter_enabled()
TILE_V = 1024 if _GPU else 256  # rows this short are sorted whole
ROWS = 8  # blocks per tile of the block pass
GATHER_ROWS = 32 if _GPU else 2  # blocks per tile of the row program's gathers
SPLIT_ROWS = 8 if _GPU else 2  # blocks per tile of `split_gather`
SPLIT_PROGRAMS = 2048  # `split_gather` programs to aim for (rows x slices)
SPLIT_WARPS = 4
SPLIT_SLICE = 128  # most blocks of one `split_gather` program (their maxes load at once)
# `split_gather` runs for batches up to this size (top-p rows without top-k only); 0: never.
# H100, V = 128256 fp32, each step after a kernel that evicts the instruction caches (as a
# model forward does): top_p 134 / 140 / 190 -> 50 / 77 / 168 us at B = 1 / 32 / 128, and
# its two launches add 3-5 us to every other filtered batch (top_k_top_p 27 / 33 / 57 ->
# 30 / 38 / 62, min_p likewise; benchmarks/sampler_notes.md). Never changes a result.
SPLIT_MAX_B = 128
DENSE_DIV = 4  # a gather over more than NBLK / DENSE_DIV blocks reads in block order
TARGET_PROGRAMS = 2048  # block-pass programs to aim for (rows x slices)
# candidates a row may gather (sorted whole: most rows fit SMALL); the interpreter sorts
# in O(n^2), so it keeps fewer and leaves more rows to the exact path
CAP = 4096 if _GPU else 256
# candidates a row without top-k may gather, as a multiple of CAP: `band` draws over them
# without sorting them all, so flat rows whose kept set passes CAP stay off the exact path
# (about 3 ms on an H100). Scratch: B x (CAP x GATHER_MULT + SMALL) x 8 bytes, 34 MB at
# B = 256 on the GPU.
GATHER_MULT = 4 if _GPU else 1
SMALL = 256 if _GPU else 32
MID = 1024 if _GPU else 64
LP_CAP = 256 if _GPU else 64  # top-N candidates of the raw logprobs writer
BAND_CH = 512 if _GPU else 16  # candidates per step of `band`'s passes
ROUNDS = 4  # top-p guesses checked before a row takes the exact path
Y_BLOCK = 2048 if _GPU else 256  # chunk of the exact path's passes over a y row
PASS_WARPS = 4  # warps of a block-pass program (benchmarks/tune_sampler.py)
ROW_WARPS = 8  # warps of a row program
# Register cap of the row programs when they outnumber the SMs (0: never). Uncapped, a
# filtered row program takes about 250 registers x 256 threads, so one fits per SM and
# B = 256 runs in two waves; at 128 two fit (some spills on rare paths). H100, B = 256:
# top_k_top_p 94.8 -> 86.6 us, top_p 581 -> 437 us; at B <= 128 the cap only costs
# (benchmarks/results/tune-sampler-maxnreg-*). Registers never change a result.
ROW_MAXNREG = 128
# top-p without top-k: how far below its guess (in y, nats) the first gather reads, doubled
# each round. H100, randn * 3 rows, B = 256: 1.0 needed a second round in most rows
# (431 us), 2.0 none (272 us); a wider first round gathers more candidates
# (benchmarks/results/tune-sampler-topp-step-*). Never changes a result.
TOP_P_STEP = 2


@functools.cache
def _sm_count(dev: torch.device) -> int:
    """SMs of a CUDA device (a large number elsewhere: no cap off the GPU)."""
    if dev.type != "cuda":
        return 1 << 30
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _split_blocks(nblk: int, B: int) -> int:
    """Blocks per `split_gather` program: about SPLIT_PROGRAMS programs in all, at least
    a tile's worth each and at most SPLIT_SLICE. The split changes no result, so it may
    follow B."""
    programs = min(triton.cdiv(nblk, SPLIT_ROWS),
                   triton.next_power_of_2(triton.cdiv(SPLIT_PROGRAMS, B)))  # fmt: skip
    return min(triton.cdiv(nblk, programs), SPLIT_SLICE)


def draw_large(
    logits: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTensors,
    out: SamplerOutput,
    bitmask: torch.Tensor | None,
    variant: SamplerVariant,
    *,
    cap: int = CAP,
    gather_cap: int | None = None,
    small: int = SMALL,
    mid: int = MID,
    split: int | None = None,
    rows: int | None = None,
    gather_rows: int | None = None,
    dense_div: int | None = None,
    split_blocks: int | None = None,
    draw_block: int = DRAW_BLOCK,
    y_block: int = Y_BLOCK,
    lp_cap: int = LP_CAP,
) -> None:
    """Block pass, row draw and (when out has logprob fields) the logprobs writers.
    `cap`, `gather_cap` (default cap x GATHER_MULT), `small`, `mid`, `split`, `rows`,
    `gather_rows`, `dense_div`, `split_blocks` (blocks per `split_gather` program, up to
    SPLIT_SLICE), `y_block`, `lp_cap` are for tests (`dense_div` 0: gathers always use the
    packed block list)."""
    B, V = logits.shape
    if split_blocks is not None and not 1 <= split_blocks <= SPLIT_SLICE:
        raise ValueError(f"split_blocks must lie in [1, {SPLIT_SLICE}], got {split_blocks}")
    for name, width in (("cap", cap), ("small", small), ("mid", mid), ("lp_cap", lp_cap)):
        if width < 1 or width & (width - 1):
            raise ValueError(f"{name} must be a power of two, got {width}")
    gcap = cap * GATHER_MULT if gather_cap is None else gather_cap
    if gcap < cap:
        raise ValueError(f"gather_cap must be at least cap ({cap}), got {gcap}")
    dev = logits.device
    filters = variant is not SamplerVariant.NO_FILTER
    need_lp = out.logprobs is not None
    rows = rows or ROWS
    tile = rows * draw_block
    ntiles = triton.cdiv(V, tile)
    # partials are per block and a block never straddles two programs, so the split
    # changes no result and may follow B
    sp = split or min(ntiles, triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, B)))
    per = triton.cdiv(ntiles, sp)
    sp = triton.cdiv(ntiles, per)
    nblk = triton.cdiv(V, draw_block)
    nblk_p2 = max(4, triton.next_power_of_2(nblk))
    xm = torch.empty((B, nblk), dtype=torch.float32, device=dev)
    q = torch.empty((B, nblk), dtype=torch.int64, device=dev)
    raw = torch.empty((2, B, nblk) if need_lp else (2, 1, 1), dtype=torch.float32, device=dev)
    common, flags = process_args(logits, slot_ids, table, bitmask, dummy=xm)
    nb = table.bias_ids.shape[1]
    bias = (table.bias_ids, table.bias_values, table.bias_ids.stride(0),
            table.bias_values.stride(0))  # fmt: skip
    nbias_p2 = triton.next_power_of_2(nb)
    _block_pass_kernel[(B, sp)](
        *common, *bias, table.temperature, table.inv_temperature, table.logprobs_processed, xm,
        q, raw[0], raw[1], B, V, nb, nblk, per * tile, **flags, RAW_LP=need_lp, NB_P2=nbias_p2,
        R=rows, DB=draw_block, enable_fp_fusion=False, num_warps=PASS_WARPS,
    )  # fmt: skip
    y = torch.empty((B, V) if (filters or need_lp) else (1, 1), dtype=torch.float32, device=dev)
    cblk = torch.empty((B, nblk_p2) if filters or need_lp else (1, 1), dtype=torch.int32,
                       device=dev)  # fmt: skip
    small = min(small, cap)
    cand = torch.empty((B, gcap + small) if filters else (1, 1), dtype=torch.int64, device=dev)
    split_on = filters and B <= SPLIT_MAX_B
    # read by the row program only where the split ran
    thr = torch.empty((B if split_on else 1, 4), dtype=torch.float32, device=dev)
    cnt = torch.empty(B if split_on else 1, dtype=torch.int32, device=dev)
    if split_on:
        _thresholds_kernel[(B,)](
            slot_ids, table.temperature, table.inv_temperature, table.top_k, table.top_p,
            table.min_p, xm, q, thr, cnt, nblk, NBLK_P2=nblk_p2, GCAP=gcap,
            P_STEP=float(TOP_P_STEP), enable_fp_fusion=False, num_warps=ROW_WARPS,
        )  # fmt: skip
        per_s = split_blocks or _split_blocks(nblk, B)
        _split_gather_kernel[(B, triton.cdiv(nblk, per_s))](
            *common, *bias, table.temperature, table.inv_temperature, xm, thr, cnt, cand, B, V,
            nb, nblk, per_s, cand.stride(0), **flags, NBIAS_P2=nbias_p2, GR=SPLIT_ROWS,
            DB=draw_block, SLICE=SPLIT_SLICE, GCAP=gcap, enable_fp_fusion=False,
            num_warps=SPLIT_WARPS,
        )  # fmt: skip
    _row_draw_kernel[(B,)](
        *common, *bias, table.temperature, table.inv_temperature, table.top_k, table.top_p,
        table.min_p, table.seed, positions, xm, q, thr, cnt, cblk, cand, y, out.token_ids,
        out.valid, B, V, nb, nblk, int(split_on), **flags, FILTERS=filters, NBIAS_P2=nbias_p2,
        NBLK_P2=nblk_p2, GR=gather_rows or GATHER_ROWS, DB=draw_block, CAP=cap, GCAP=gcap,
        SMALL=small, MID=min(mid, cap), ROUNDS=ROUNDS, BAND_CH=BAND_CH, YB=y_block,
        DENSE_DIV=DENSE_DIV if dense_div is None else dense_div,
        TOKEN_STREAM=int(Stream.TOKEN), BLOCK_STREAM=int(Stream.BLOCK),
        INTERP=interpreter_enabled(), P_STEP=float(TOP_P_STEP), enable_fp_fusion=False,
        num_warps=ROW_WARPS,
        **({"maxnreg": ROW_MAXNREG} if ROW_MAXNREG and B > _sm_count(dev) else {}),
    )  # fmt: skip
    if need_lp:
        n = out.num_top or 0
        lp_cand = torch.empty((B, lp_cap), dtype=torch.int64, device=dev)
        done = torch.empty(B, dtype=torch.int32, device=dev)
        top_lp = out.top_logprobs if n else out.logprobs
        top_id = out.top_token_ids if n else out.ranks
        _raw_logprobs_kernel[(B,)](
            *common, *bias, table.temperature, table.inv_temperature, table.logprobs_processed,
            out.token_ids, xm, raw[0], raw[1], y, cblk, lp_cand, out.logprobs, out.ranks, top_lp,
            top_id, done, B, V, nb, nblk, **flags, N=n, N_POW2=max(1, triton.next_power_of_2(n)),
            NBLK_P2=nblk_p2, NBIAS_P2=nbias_p2, GR=gather_rows or GATHER_ROWS, DB=draw_block,
            CAP=lp_cap, YB=y_block,
            INTERP=interpreter_enabled(), enable_fp_fusion=False, num_warps=ROW_WARPS,
        )  # fmt: skip
        write_logprobs(logits, y, slot_ids, table, out, done=done)


def draw_tile(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTensors,
    out: SamplerOutput,
    variant: SamplerVariant,
) -> None:
    """Whole rows in registers, for V <= TILE_V; x [B, V] is overwritten with y."""
    B, V = x.shape
    bv = max(16, triton.next_power_of_2(V))
    br = max(1, min(triton.next_power_of_2(B), (16384 if interpreter_enabled() else 2048) // bv))
    _sample_tile_kernel[(triton.cdiv(B, br),)](
        x, x.stride(0), slot_ids, positions, table.temperature, table.inv_temperature,
        table.top_k, table.top_p,
        table.min_p, table.seed, out.token_ids, out.valid, B, V,
        FILTERS=variant is not SamplerVariant.NO_FILTER, STREAM=int(Stream.TOKEN),
        BLOCK_R=br, BLOCK_V=bv, INTERP=interpreter_enabled(),
    )  # fmt: skip


def sample(
    logits: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTensors,
    out: SamplerOutput,
    bitmask: torch.Tensor | None = None,
    variant: SamplerVariant = SamplerVariant.DEFAULT,
    *,
    tile_v: int = TILE_V,
    draw_block: int = DRAW_BLOCK,
    **large_kw,
) -> SamplerOutput:
    B, V = logits.shape
    # the tile kernel draws over the whole row: exact only where the row is one block
    if V <= min(tile_v, draw_block):
        y = process(logits, slot_ids, table, bitmask)
        draw_tile(y, slot_ids, positions, table, out, variant)
        if out.logprobs is not None:
            write_logprobs(logits, y, slot_ids, table, out)
    else:
        draw_large(logits, slot_ids, positions, table, out, bitmask, variant,
                   draw_block=draw_block, **large_kw)  # fmt: skip
    return out
