"""Stores from a tensor's own layout. `tl.store` first moves a tensor whose pointers are not
contiguous (a scatter, or a reduction's [R] result held by a whole warp) to a layout of one
owner an element, through shared memory and a barrier for the pointers, the values and the
mask each; a tile's scatter of a few candidates paid more in those moves than in the
stores. `put_here` stores each element from the thread that holds it (a value a warp holds
is stored by each of its lanes: one value to one address)."""

from __future__ import annotations

import triton
import triton.language as tl

from graphexec.sampling.triton.keys import _INTERP


@triton.jit
def put_here(ptrs, v, ok=None):
    """tl.store(ptrs, v, mask=ok) for 32- and 64-bit v, without a layout move on the GPU
    (the interpreter runs no PTX: tl.store there)."""
    if _INTERP:
        tl.store(ptrs, v, mask=ok)
    else:
        wide: tl.constexpr = v.dtype.primitive_bitwidth == 64
        bits = v.to(tl.int64 if wide else tl.int32, bitcast=True)
        st: tl.constexpr = "st.global.b64 [$1], $2;" if wide else "st.global.b32 [$1], $2;"
        reg: tl.constexpr = "l" if wide else "r"
        if ok is None:
            tl.inline_asm_elementwise(st + " mov.b32 $0, 0;", "=r,l," + reg, [ptrs, bits],
                                      dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p " + st + " } mov.b32 $0, 0;",
                "=r,l," + reg + ",r", [ptrs, bits, ok.to(tl.int32)], dtype=tl.int32,
                is_pure=False, pack=1)  # fmt: skip
