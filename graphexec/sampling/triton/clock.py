"""Phase clocks of the row tail, for profiling only (`SamplerConfig.phase_clock`,
`benchmarks/sampler_phases.py`): where a row's one program spends its time, which a
kernel-level profile cannot show. A stamp waits for the program's warps, then writes the
SM's cycle counter (%clock64) into the row's W.clock column i; the first and last stamps
also write %globaltimer (ns) into columns CLOCK_NS and CLOCK_NS + 1, which converts
cycles to time. Off (the default), and always under the interpreter (no inline PTX), a
stamp compiles to nothing. Stamps change no result."""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.keys import _INTERP

CLOCK_COLS = tl.constexpr(16)  # W.clock's columns (`Workspace.clock`)
CLOCK_NS = tl.constexpr(14)  # stamps 0 .. CLOCK_NS - 1, then the two globaltimer reads


@triton.jit
def read(asm: tl.constexpr):
    """A 64-bit PTX special register (`asm`: "mov.u64 $0, %clock64;" or %globaltimer); 0
    under the interpreter, which runs no PTX."""
    if _INTERP:
        r = tl.zeros([], dtype=tl.int64)
    else:
        r = tl.inline_asm_elementwise(asm, "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    return r


@triton.jit
def stamp(W, row, i: tl.constexpr, PROF: tl.constexpr, NS: tl.constexpr = -1):
    """Stamp i of row `row` (NS >= 0: also the global timer into column CLOCK_NS + NS)."""
    if PROF and not _INTERP:
        tl.debug_barrier()
        tl.store(W.clock + row * CLOCK_COLS + i, read("mov.u64 $0, %clock64;"))
        if NS >= 0:
            tl.store(W.clock + row * CLOCK_COLS + CLOCK_NS + NS,
                     read("mov.u64 $0, %globaltimer;"))  # fmt: skip
