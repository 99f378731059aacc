"""The Triton sampler's knobs (`SamplerConfig`) and its per-call scratch (`Workspace`).

Knobs change how the work is cut, never a token: tests run the same rows under both
presets and compare them with the torch reference. The one exception is `draw_block`,
which is part of the definition (`reference`, step 6) and must equal the reference's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphexec.params import TOP_K_FIRST_MAX
from graphexec.runtime.triton_env import interpreter_enabled
from graphexec.sampling.reference import DRAW_BLOCK, TOTAL_SCALE

# the top-p total's fixed point (`reference.mass_total`) and its inverse, for the kernels
TOTAL_FIX, TOTAL_UNFIX = tl.constexpr(TOTAL_SCALE), tl.constexpr(1.0 / TOTAL_SCALE)

# Row routes (`Workspace.rowi[:, I_ROUTE]`), decided by the stats pass's row tail.
R_DONE = tl.constexpr(0)  # drawn by the stats pass: invalid, greedy, no filter, all ties
R_CUT = tl.constexpr(1)  # min-p only: the kept set is y >= log_min_p, masses in one pass
R_SELECT = tl.constexpr(2)  # top-k / top-p: histogram, then a bracket gathered, resolved
R_EXACT = tl.constexpr(3)  # neither bracket resolved: the serial exact search served it
R_REFINE = tl.constexpr(4)  # round 1's bracket is past the gather cap: go to round 2
R_ROUND2 = tl.constexpr(5)  # round 1 did not resolve: round 2's narrower bracket served it
R_CHECK = tl.constexpr(6)  # the candidate's membership needs the check pass (many blocks)
R_REPLAN = tl.constexpr(7)  # the check pass did not keep the candidate: `_short_kernel` plans

# Columns of Workspace.rowf (f32): the row max, 1/T, the bins' low and top ends (y), their
# scale, the lowest y whose block K_b the draw reads, the candidate's y
F_M, F_S, F_LO, F_INVW, F_KLO, F_TOP, F_YC = (tl.constexpr(i) for i in range(7))
# Columns of Workspace.rowi (i64): the route, the block list's length, the bracket's bin
# bounds (above: j < J_HI; bracket 1: J_HI..J_1; middle: J_1 < j < J_2; bracket 2:
# J_2..J_LO), whether no live token lies below lo; then what the kept pass sums: numbers
# of tokens above / above with y >= log_min_p, their exact mass, the same for the middle,
# numbers below the brackets (with y >= log_min_p / all), and the gathered tokens; round
# 2's count and exact mass above its bins; the coarse bins that surely hold every cut
I_ROUTE, I_NLIST, I_JHI, I_J1, I_J2, I_JLO, I_LOMIN = (tl.constexpr(i) for i in range(7))
I_NAB, I_NABM, I_MAB, I_NMID, I_NMIDM, I_MMID, I_NBELM, I_NBEL, I_NG = (
    tl.constexpr(i) for i in range(8, 17)
)
I_NTOP, I_MTOP, I_RA, I_RB = (tl.constexpr(i) for i in range(17, 21))
# the candidate (`candidate`): its token id (-1 once it is known to be outside the kept
# set), then the check pass's count and exact mass of the tokens ranked above it
I_CAND, I_CCNT, I_CMASS = (tl.constexpr(i) for i in range(24, 27))
NUM_I = tl.constexpr(32)
QUEUE_WORDS = tl.constexpr(80)  # Workspace.queue's counters (`late`)
Q_NEED = tl.constexpr(64)  # of them: rows the tail and check kernels left a pass to


@dataclass(frozen=True)
class SamplerConfig:
    """How the Triton sampler cuts its work. Pass one explicitly (`sample_step(config=)`)
    or take `SamplerConfig.default()`: the GPU preset, or the interpreter preset under
    TRITON_INTERPRET=1.

    draw_block: tokens per block of the two-level draw (part of the definition).
    tile_blocks: blocks per tile of a pass, one load (the kept pass: half, for its registers).
    programs: stats-pass programs to aim for over the batch (rows x slices), filtered or
        with logprobs (`slices`). That pass holds 72 registers (7 programs a SM on an
        H200); 1,386, 2,772 and 4,096 timed within 2 % (min-p and top-k/top-p, fp32, B =
        32 to 256): its split is not what limits it.
    unfiltered_programs: the same for the unfiltered pass at its register cap
        (stats_registers): about one wave of it on an H200 (132 SMs x 12 programs at 40
        registers). More, shorter programs (4,096) cost a second partial wave; over fp32
        and bf16, V = 49,152 / 151,936, B = 32 to 256, 1,536 had the best worst point
        (1.84x the read floor; 4,096 2.07x, 1,024 1.88x).
    stats_programs: at a batch whose tiles number fewer, the stats pass halves its tile
        (down to 2 blocks; never with logprobs) until they do (`stats_tile`): one program
        per 8-block tile of a single row leaves part of the device idle and each program's
        chain long.
    check_programs: the same for the check pass, which walks a row's block list (dependent
        loads, so a flat row needs many programs).
    late_programs: the programs that select and kept (rounds 1 and 2) share among the
        rows that need them (a row list; at most the check's B x S, round 1's at least
        B): a launch whose rows all leave at once costs about a program's start and wait
        per program (an H200: some 10 us over four launches of 2,048), while a flat row's
        passes want many.
    late_queue: batches of at most this many rows (0: none) run the default variant's
        passes after the check (the short route, rounds 1 and 2) in one persistent launch
        that drains a device-side queue of their items (`late`), instead of seven launches
        most of whose programs leave at once, behind a gate: a batch that the tail and
        check drew whole costs that launch alone (at small B, most batches). 0 by default:
        on an H200 (fp32, V = 151,936) the queue without its gate was slower everywhere (B
        = 1: top_p 28.4 -> 30.1 us at best; B >= 32: up to 1.7x, its passes at the row
        kernels' 16 warps); the seven launches replaced by one small one took B = 1 peaked
        rows' top_p from 28.4 to 22.7-24.0 us, min_p from 23.5 to 16.7-17.1. The gate is
        not yet timed, nor a batch that opens it (the real rows' first one does).
    bins: histogram bins of the selection pass.
    gather_cap: most bracket tokens a row gathers and resolves by counting.
    search_ways, search_blocks: candidates per pass of the exact search, and blocks per
        step of its passes (one keeps its registers, shared with the kept pass, low).
    short_blocks: most listed blocks of a row the short route serves (min-p alone: a
        quarter of it); 0 turns the short route off.
    short_tokens: most candidates of such a row (16 to gather_cap).
    mid_tokens: top-k first sorts a row of more candidates than short_tokens but at most
        this many at this width, not gather_cap's (0: off; clamped to gather_cap). Real
        rows at top-k 50 gather some 90-150 candidates: a 1,024-slot sort costs them
        about a third of the call, while peaked rows (~55) keep the short width.
    check_blocks: most blocks the row tail reads to decide a candidate (more: the check
        pass). 0 decides no candidate early: every filtered row takes the cut's passes and
        its candidate is tested against the cut (for tests of them).
    top_k_first: the largest top-k that the default variant's row tail serves top-k first,
        as the top_k_top_p variant does every row (`topk`); 0: every top-k row takes the
        candidate's check and the cut's passes (for tests of them).
    topk_launch: the default variant serves its top-k-first rows (top_k_first) in a launch
        of their own (`tail._topk_kernel`) before the row tail, which is then compiled
        without that code (sm_90, B = 1, V = 151,936: 21,616 -> 7,072 instructions, stack
        120 -> 64 B). Off: on an H200 (fp32, graph us, V = 151,936 and the real rows) it
        made top-p batches 3-12 % faster at B <= 128 on peaked and real rows, but batches
        with top-k rows 8-17 % slower at B = 32-128 (those rows no longer run beside the
        others) and min-p batches up to 6 % slower (the launch itself).
    logprobs_cap: most top-N candidates the raw logprobs writer sorts (more: the general one).
    topk_programs: programs the top_k_top_p variant's row launch aims for over a small
        batch: a row gets up to 16 (`topk_parts`), one drawing its candidate while the
        others gather slices of its top-k candidates; 1 a row from this many rows on.
    num_warps: warps of the passes' programs (stats, select, kept): a small program
        keeps more of them resident, hiding the loads' latency.
    tail_warps: warps of the row kernels (the filtered rows' tail, short route and finish,
        top_k_top_p's row launch), whose vectors span a row's blocks and gathered tokens.
    row_elems: most elements of a row's block vector a thread of an uncapped row launch
        holds: past it the launch doubles its warps (`row_warps`; sm_90, V = 151,936, 2,048
        blocks: 8 warps spill, 16 run 5-15 % faster; at 1,024 blocks 16 were slower).
    pdl: programmatic dependent launch where the device has it (`kernels.dependent_launch`):
        a launch whose rows all leave at once then costs little more than its wait.
    stats_registers: most registers a thread of the unfiltered stats pass holds (no_filter
        without logprobs; the compiler's maxnreg; 0: its own choice, 64 on sm_90): that pass
        waits on its loads, and at 40 more warps are resident while only code outside its
        loop spills (fp32 B = 128: 5 % faster on an H200); the filtered passes were slower.
    wide_registers: most registers a thread of a row launch holds (one program a row: a
        filtered variant's row tail, short route and finish, top_k_top_p's row launch, the
        raw logprobs writer) when its programs outnumber the device's SMs (0: the compiler's
        choice, 184 to 238 on sm_90 at 8 warps, where one program fills an SM's register
        file and such a batch runs its rows in two waves; at 128 two programs share an SM).
        Only registers change, not the code or its reductions' layout: the same bits.
    wide_blocks: the default variant's row launches and the raw logprobs writer take that
        cap only where a row's block vector (NBLK rounded up to a power of two) is at most
        this long: past it their capped code spills (sm_90, V = 151,936: 1,152 B a thread
        in the row tail against 112 B at V = 128,256) and runs slower. 0: always.
    phase_clock: profiling only: the row tail's programs stamp their phases' SM clocks into
        Workspace.clock (`clock`: a barrier a stamp, same tokens; no effect when interpreted).
    Powers of two: draw_block, tile_blocks, bins, gather_cap, search_ways, search_blocks,
    short_tokens, logprobs_cap, and short_blocks and mid_tokens unless 0.
    """

    draw_block: int = DRAW_BLOCK
    tile_blocks: int = 8
    programs: int = 4096
    unfiltered_programs: int = 1536
    stats_programs: int = 256
    check_programs: int = 2048
    late_programs: int = 512
    late_queue: int = 0
    bins: int = 512
    gather_cap: int = 1024
    search_ways: int = 16
    search_blocks: int = 4
    short_blocks: int = 128
    short_tokens: int = 128
    mid_tokens: int = 256
    check_blocks: int = 16
    top_k_first: int = TOP_K_FIRST_MAX
    topk_launch: bool = False
    logprobs_cap: int = 256
    topk_programs: int = 128
    num_warps: int = 4
    tail_warps: int = 8
    row_elems: int = 4
    pdl: bool = True
    stats_registers: int = 40
    wide_registers: int = 128
    wide_blocks: int = 1024
    phase_clock: bool = False

    def __post_init__(self) -> None:
        for name in ("draw_block", "tile_blocks", "bins", "gather_cap", "search_ways",
                     "search_blocks", "short_tokens", "logprobs_cap"):  # fmt: skip
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"SamplerConfig.{name} must be a power of two, got {v}")
        for name in ("short_blocks", "mid_tokens"):
            v = getattr(self, name)
            if v < 0 or v & (v - 1):
                raise ValueError(f"SamplerConfig.{name} must be 0 or a power of two, got {v}")
        if self.short_blocks and not 16 <= self.short_tokens <= self.gather_cap:
            raise ValueError("SamplerConfig.short_tokens must be between 16 and gather_cap "
                             f"({self.gather_cap}), got {self.short_tokens}")  # fmt: skip
        for name in ("check_blocks", "top_k_first", "late_queue"):
            if getattr(self, name) < 0:
                raise ValueError(f"SamplerConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("stats_registers", "wide_registers"):
            v = getattr(self, name)
            if v and not 16 <= v <= 255:
                raise ValueError(f"SamplerConfig.{name} must be 0 or in 16..255, got {v}")
        if self.draw_block < 4:
            raise ValueError(f"SamplerConfig.draw_block must be >= 4, got {self.draw_block}")
        for name in ("programs", "unfiltered_programs", "stats_programs", "check_programs",
                     "late_programs", "num_warps", "tail_warps", "row_elems",
                     "topk_programs"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"SamplerConfig.{name} must be positive")

    @classmethod
    def gpu(cls) -> SamplerConfig:
        return cls()

    @classmethod
    def interpreter(cls) -> SamplerConfig:
        """Fewer programs and a narrower gather: the CPU interpreter pays per program and
        per element, never per thread."""
        return cls(programs=16, stats_programs=1, check_programs=16, late_programs=16,
                   gather_cap=256, bins=128, search_blocks=4, short_blocks=8, short_tokens=64,
                   mid_tokens=128, check_blocks=8, logprobs_cap=64, num_warps=4, tail_warps=4,
                   topk_programs=3)  # fmt: skip

    @classmethod
    def default(cls) -> SamplerConfig:
        return cls.interpreter() if interpreter_enabled() else cls.gpu()

    def replace(self, **kw) -> SamplerConfig:
        return dataclasses.replace(self, **kw)


def stats_tile(config: SamplerConfig, B: int, nblk: int, logprobs: bool) -> int:
    """Blocks per tile of the stats pass: tile_blocks, halved (down to 2) while the batch's
    tiles number fewer than stats_programs; tile_blocks always for a logprobs launch, whose
    raw sums of exp are float sums along the tile's rows, added in an order that the tile's
    layout sets (the exact masses and maxima are the same in any tile)."""
    r = config.tile_blocks
    while not logprobs and r > 2 and B * triton.cdiv(nblk, r) < config.stats_programs:
        r //= 2
    return r


def topk_parts(config: SamplerConfig, B: int) -> int:
    """Programs a row of the top_k_top_p row launch (`SamplerConfig.topk_programs`): 1 to
    16; above 1, one draws the candidate and the others gather (`tail.tail_row`)."""
    return max(1, min(16, config.topk_programs // max(B, 1)))


def row_registers(config: SamplerConfig, programs: int, sms: int | None,
                  nblk_p2: int = 0) -> int:
    """A row launch's register cap (`SamplerConfig.wide_registers`) for this many programs
    on a device of `sms` SMs (None: not a GPU): 0, none, unless they outnumber the SMs and
    the row's block vector of `nblk_p2` (0: top_k_top_p's, none) fits `wide_blocks`."""
    if sms is None or programs <= sms:
        return 0
    if nblk_p2 and config.wide_blocks and nblk_p2 > config.wide_blocks:
        return 0
    return config.wide_registers


def row_warps(config: SamplerConfig, nblk_p2: int, capped: bool) -> int:
    """Warps of a row launch whose block vector is `nblk_p2` long: `tail_warps`, doubled
    (up to 32) while a thread would hold more than `row_elems`, unless the launch takes the
    register cap (`row_registers`: two programs an SM only at `tail_warps`). The batch may
    choose: every sum in a row launch is exact (the top-p total is fixed point)."""
    w = config.tail_warps
    while not capped and w < 32 and nblk_p2 > 32 * w * config.row_elems:
        w *= 2
    return w


def split(programs: int, tile_blocks: int, B: int, nblk: int) -> int:
    """Programs per row: about `programs` over the batch, at least a tile each. A block
    never straddles two programs, so no split changes a result."""
    tiles = triton.cdiv(nblk, tile_blocks)
    return max(1, min(tiles, triton.cdiv(programs, max(B, 1))))


def slices(programs: int, tile_blocks: int, B: int, nblk: int) -> tuple[int, int]:
    """The stats pass's programs per row and blocks per program: `split`'s slices of whole
    tiles, less those that would start past the row's end (the same partition: B = 32,
    V = 151,936 at 4,096 programs had 53 of 128 a row with no tile)."""
    tiles = triton.cdiv(nblk, tile_blocks)
    per = triton.cdiv(tiles, split(programs, tile_blocks, B, nblk))
    return triton.cdiv(tiles, per), per * tile_blocks


class Workspace(NamedTuple):
    """Scratch of one sampler call, B rows of NBLK blocks, as the kernels take it: one named
    tuple W (W.xm, W.q, ...). `arrive` must start at zero: each pass's last program of a row
    resets its counter, so a persistent workspace (the executor's) stays valid across calls
    and graph replays."""

    xm: torch.Tensor  # f32 [B, NBLK]: block max of x (+inf: holds +inf; -inf: none live)
    xn: torch.Tensor  # f32 [B, NBLK]: block min of the finite x (+inf: none)
    q: torch.Tensor  # i64 [B, NBLK]: Q_b (+inf blocks: 2**32 per +inf entry)
    kept: torch.Tensor  # i64 [B, NBLK]: K_b of the kept tokens above the bracket
    kept_mid: torch.Tensor  # i64 [B, NBLK]: K_b of the kept tokens between brackets
    blocks: torch.Tensor  # i32 [B, NBLK]: the blocks a filtered row reads again
    hist: torch.Tensor  # i32 [B, bins]
    gath: torch.Tensor  # i64 [B, gather_cap]: packs of the bracket tokens
    gath_x: torch.Tensor  # f32 [B, gather_cap]: their x (for their blocks' kept masses)
    rowf: torch.Tensor  # f32 [B, 8]: F_* columns
    rowi: torch.Tensor  # i64 [B, NUM_I]: I_* columns
    total: torch.Tensor  # f64 [B]: top-p total of rows with top-k off
    arrive: torch.Tensor  # i32 [B, 4]: programs of the row done, per pass (column 0: the
    # candidates top-k first's programs have gathered, when several serve a row)
    listed: torch.Tensor  # i32 [B + 1]: how many rows round 1's passes serve, then those rows
    refine: torch.Tensor  # i32 [B + 1]: how many rows round 2 serves, then those rows
    raw_max: torch.Tensor  # f32 [B, NBLK] (logprobs on; else [1, 1]) raw logits' block max
    raw_sum: torch.Tensor  # f32 [B, NBLK] (likewise) their block sum of exp(v - raw_max)
    clock: torch.Tensor  # i64 [B, 16]: the row tail's phase clocks (`clock`; profiling only)
    queue: torch.Tensor  # i64 [QUEUE_WORDS]: the late queue's counters (zero between calls)

    @classmethod
    def allocate(cls, B: int, V: int, device, config: SamplerConfig, logprobs: bool = False):
        d = torch.device(device)
        nblk = triton.cdiv(V, config.draw_block)

        def e(*shape, dtype=torch.float32):
            return torch.empty(shape, dtype=dtype, device=d)

        i64 = torch.int64
        raw = (B, nblk) if logprobs else (1, 1)
        return cls(
            xm=e(B, nblk), xn=e(B, nblk), q=e(B, nblk, dtype=i64), kept=e(B, nblk, dtype=i64),
            kept_mid=e(B, nblk, dtype=i64), blocks=e(B, nblk, dtype=torch.int32),
            hist=e(B, config.bins, dtype=torch.int32), gath=e(B, config.gather_cap, dtype=i64),
            gath_x=e(B, config.gather_cap),
            rowf=e(B, 8), rowi=e(B, int(NUM_I), dtype=i64), total=e(B, dtype=torch.float64),
            arrive=torch.zeros((B, 4), dtype=torch.int32, device=d),
            listed=e(B + 1, dtype=torch.int32), refine=e(B + 1, dtype=torch.int32),
            raw_max=e(*raw), raw_sum=e(*raw),
            clock=torch.zeros((B, 16), dtype=i64, device=d),
            queue=torch.zeros(int(QUEUE_WORDS), dtype=i64, device=d),
        )  # fmt: skip

    def fits(self, B: int, V: int, config: SamplerConfig, logprobs: bool) -> bool:
        nblk = triton.cdiv(V, config.draw_block)
        return (
            self.xm.shape[0] >= B and self.xm.shape[1] == nblk
            and self.hist.shape[1] == config.bins and self.gath.shape[1] == config.gather_cap
            and (not logprobs or self.raw_max.shape[0] >= B)
        )  # fmt: skip

    def rows(self, B: int) -> Workspace:
        """The first B rows (views: a persistent workspace serves every bucket)."""
        cut = {name: t[:B] for name, t in self._asdict().items()}
        return Workspace(**{**cut, "listed": self.listed[: B + 1], "refine": self.refine[: B + 1],
                            "queue": self.queue})  # fmt: skip
