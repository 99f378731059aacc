"""The Triton backend of `sample_step`: launches only (the route map is the package
docstring). No host sync and no branch on tensor values: every data-dependent decision
is made inside the kernels, so the launches can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton

from graphexec.kernels import dependent_launch
from graphexec.params import SamplerVariant
from graphexec.runtime.triton_env import interpreter_enabled
from graphexec.runtime.triton_keys import settle
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.sampling.triton import kept, late, logprobs, select, short, stats, tail
from graphexec.sampling.triton.kept import _finish_kernel, _kept_kernel
from graphexec.sampling.triton.late import _late_kernel
from graphexec.sampling.triton.logprobs import _raw_logprobs_kernel, write_logprobs
from graphexec.sampling.triton.process import proc_args
from graphexec.sampling.triton.sampler_config import (
    SamplerConfig,
    Workspace,
    row_registers,
    row_warps,
    slices,
    split,
    stats_tile,
    topk_parts,
)
from graphexec.sampling.triton.select import _select_kernel
from graphexec.sampling.triton.short import _short_kernel
from graphexec.sampling.triton.stats import _check_kernel, _stats_kernel
from graphexec.sampling.triton.tail import _tail_kernel, _topk_kernel

# the kernels' Triton cache keys, each after its callees' (`triton_keys`: the same keys
# whichever kernel a process launches or compiles first)
settle(kept, logprobs, select, short, stats, tail, late)


def sm_count(device: torch.device) -> int | None:
    """The device's SMs (None: not a GPU, or the interpreter)."""
    if device.type != "cuda" or interpreter_enabled():
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def maxnreg(cap: int) -> dict:
    """A launch's register cap as its keyword (none for 0: the compiler's choice)."""
    return {"maxnreg": cap} if cap else {}


def row_options(config: SamplerConfig, nblk_p2: int, cap: int) -> dict:
    """A row launch's warps and register cap (`row_registers`): its warps follow the cap."""
    return dict(num_warps=row_warps(config, nblk_p2, cap > 0), **maxnreg(cap))


def sample(logits: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
           table: SamplingTensors, out: SamplerOutput, bitmask: torch.Tensor | None = None,
           variant: SamplerVariant = SamplerVariant.DEFAULT, *, config: SamplerConfig | None = None,
           workspace: Workspace | None = None,
           count_ids: torch.Tensor | None = None) -> SamplerOutput:  # fmt: skip
    """The Triton backend of `pipeline.sample_step` (`workspace`: for at least B rows of
    this V and config, or None to allocate one)."""
    cfg = config or SamplerConfig.default()
    B, V = logits.shape
    if B == 0:
        return out
    need_lp = out.logprobs is not None
    if workspace is None:
        workspace = Workspace.allocate(B, V, logits.device, cfg, need_lp)
    elif not workspace.fits(B, V, cfg, need_lp):
        raise ValueError("workspace was allocated for another batch, vocabulary or config")
    W = workspace.rows(B)
    slot_ids, positions = slot_ids.contiguous(), positions.contiguous()  # indexed by row
    P, fl = proc_args(logits, slot_ids, positions, table, bitmask, count_ids)
    db, r = cfg.draw_block, cfg.tile_blocks
    nblk = triton.cdiv(V, db)
    filters = variant is not SamplerVariant.NO_FILTER
    # the register cap is measured for the unfiltered pass only (the filtered ones slow down
    # at it), and so is its split
    capped = cfg.stats_registers and not (filters or need_lp or interpreter_enabled())
    rs = stats_tile(cfg, B, nblk, need_lp)
    S, per = slices(cfg.unfiltered_programs if capped else cfg.programs, rs, B, nblk)
    S2 = split(cfg.check_programs, r, B, nblk)
    nb_p2 = max(16, triton.next_power_of_2(table.bias_ids.shape[1]))  # one compile up to 16
    nblk_p2 = max(16, triton.next_power_of_2(nblk))
    # every launch's constants: the passes' (common) and the row kernels' (rows)
    pdl = dependent_launch.enabled(cfg.pdl, logits.device)
    base = dict(NB_P2=nb_p2, DB=db, FL=fl, enable_fp_fusion=False, PDL=pdl,
                **dependent_launch.launch_options(pdl))  # fmt: skip
    common = dict(base, R=r, NBINS=cfg.bins, num_warps=cfg.num_warps)
    rows = dict(base, NBLK_P2=nblk_p2)
    regs = maxnreg(cfg.stats_registers if capped else 0)
    _stats_kernel[(B * S,)](P, W, B, S, per, nblk, XN=filters, RAW_LP=need_lp, R=rs,
                            num_warps=cfg.num_warps, **regs, **base)  # fmt: skip
    bits = int(math.log2(cfg.search_ways))
    search = dict(WAYS=cfg.search_ways, SB=cfg.search_blocks, ITA=-(-32 // bits) + 1,
                  ITB=-(-max(1, (V - 1).bit_length()) // bits) + 1)  # fmt: skip
    # top-k first's short sort, within the gather buffer (short_tokens may pass gather_cap
    # where the short route is off)
    tkst = min(cfg.short_tokens, cfg.gather_cap)
    tkmt = min(cfg.mid_tokens, cfg.gather_cap)
    sorts = dict(ST=tkst, MT=tkmt if tkst < tkmt < cfg.gather_cap else tkst)
    # the row tail's constants, in each launch that runs it (`tail.tail_row`)
    tails = dict(NBINS=cfg.bins, R=r, **sorts, WCAP=cfg.gather_cap, INTERP=interpreter_enabled(),
                 PROF=cfg.phase_clock, **search)  # fmt: skip
    # the filtered row launches' register cap past the SM count (`wide_registers`)
    sms = sm_count(logits.device)
    row_cap = row_registers(cfg, B, sms, nblk_p2) if variant is SamplerVariant.DEFAULT else 0
    wrows = dict(rows, **row_options(cfg, nblk_p2, row_cap))
    # the default variant's passes after the check as one queue, behind its gate (`late`)
    queue = variant is SamplerVariant.DEFAULT and B <= cfg.late_queue
    if variant is SamplerVariant.TOP_K_TOP_P:  # top-k first: the whole row in this launch
        parts = topk_parts(cfg, B)
        tk_cap = row_registers(cfg, B * parts, sms)
        _topk_kernel[(B * parts,)](P, W, out.token_ids, out.valid, nblk, PARTS=parts,
                                   MULTI=parts > 1, **tails, **rows,
                                   **row_options(cfg, nblk_p2, tk_cap))  # fmt: skip
    else:
        tkf = cfg.top_k_first if filters else 0
        # the default variant's top-k-first rows in a launch of their own, so that the row
        # tail is compiled without that code (`SamplerConfig.topk_launch`)
        own = tkf if variant is SamplerVariant.DEFAULT and cfg.topk_launch else 0
        if own:
            _topk_kernel[(B,)](P, W, out.token_ids, out.valid, nblk, TKF=own, CB=cfg.check_blocks,
                               **tails, **wrows)  # fmt: skip
        _tail_kernel[(B,)](P, W, out.token_ids, out.valid, nblk, FILTERS=filters,
                           CB=cfg.check_blocks, TKF=0 if own else tkf, SKIP=own, QUEUE=queue,
                           **tails, **wrows)  # fmt: skip
    if variant is SamplerVariant.DEFAULT:
        if cfg.check_blocks:
            _check_kernel[(B * S2,)](P, W, out.token_ids, out.valid, S2, nblk, NBLK_P2=nblk_p2,
                                     QUEUE=queue, **common)  # fmt: skip
        # the programs each round's listed rows share (round 1's: never fewer than its rows)
        G2 = min(cfg.late_programs, B * S2)
        rsh, rk = min(r, cfg.short_blocks or r), max(1, r // 2)  # kept: half tiles
        if queue:  # the seven launches below as one launch, one wave of its programs (at B
            # = 1 on an H200, 132 programs rather than 149 took 1.3 us off top_p)
            G1 = max(G2, B)
            _late_kernel[(min(G1, sms or G1),)](
                P, W, out.token_ids, out.valid, B, G1, G2, nblk, RSH=rsh, RS=r, RK=rk,
                SB=cfg.short_blocks, ST=cfg.short_tokens, NBINS=cfg.bins, WCAP=cfg.gather_cap,
                WAYS=search["WAYS"], ITA=search["ITA"], ITB=search["ITB"], SSB=search["SB"],
                INTERP=interpreter_enabled(), **wrows)  # fmt: skip
        else:
            # the short route, the check's plans, and round 1's row list
            _short_kernel[(B,)](P, W, out.token_ids, out.valid, nblk, R=rsh,
                                SB=cfg.short_blocks, ST=cfg.short_tokens, WCAP=cfg.gather_cap,
                                INTERP=interpreter_enabled(), NBINS=cfg.bins, **wrows)  # fmt: skip
            passes = dict(common, WCAP=cfg.gather_cap)
            finish = dict(passes, NBLK_P2=nblk_p2, **search, **row_options(cfg, nblk_p2, row_cap))
            for round2, grid in ((False, max(G2, B)), (True, G2)):
                _select_kernel[(grid,)](P, W, grid, nblk, ROUND2=round2, **passes)
                _kept_kernel[(grid,)](P, W, grid, nblk, ROUND2=round2, **dict(passes, R=rk))
                _finish_kernel[(B,)](P, W, out.token_ids, out.valid, nblk, ROUND2=round2,
                                     **finish)  # fmt: skip
    return _logprobs(logits, slot_ids, table, out, P, W, nblk, nblk_p2, cfg, sms, base)


def _logprobs(logits, slot_ids, table, out, P, W, nblk, nblk_p2, cfg, sms, base) -> SamplerOutput:
    """The logprobs writers, last (out.logprobs None: none): the raw-mode one, then the
    general one for the rows it leaves (`logprobs`)."""
    if out.logprobs is None:
        return out
    B, V = logits.shape
    n = out.num_top or 0
    cap = cfg.logprobs_cap
    interp = interpreter_enabled()
    y = torch.empty((B, V), dtype=torch.float32, device=logits.device)
    done = torch.empty(B, dtype=torch.int32, device=logits.device)
    _raw_logprobs_kernel[(B,)](
        P, W, y, torch.empty((B, cap), dtype=torch.int64, device=logits.device),
        out.token_ids, out.logprobs, out.ranks, out.top_logprobs if n else out.logprobs,
        out.top_token_ids if n else out.ranks, done, nblk, N=n,
        N_POW2=max(1, triton.next_power_of_2(n)), NBLK_P2=nblk_p2, GR=2 if interp else 32,
        CAP=cap, YB=256 if interp else 2048, INTERP=interp, num_warps=8, **base,
        **maxnreg(row_registers(cfg, B, sms, nblk_p2)),  # (184 registers on sm_90)
    )  # fmt: skip
    write_logprobs(logits, y, slot_ids, table, out, cap=cap, done=done, pdl=base["PDL"])
    return out
