"""A code-heavy kernel that evicts every SM's instruction cache (benchmarks only).

The L2 flush before each timed call (a 256 MiB memset) leaves each SM's instruction cache
as the previous call left it, so a method timed back to back runs with its code warm. In a
serving engine the model forward runs between two sampler steps, and the sampler's code
is cold each time. On an H100 the row program of graphexec.top_k_top_p at B = 1 took
16 us warm and 23 us after this kernel (benchmarks/probes/icache.py), which also explains
why it had looked slower whenever another large kernel ran in the same step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

STEPS = 4000  # about 330 KB of straight-line code (sm_90)


@triton.jit
def _evict_kernel(x_ptr, STEPS: tl.constexpr):
    """Straight-line code, one multiply-add per step with its own constants."""
    v = tl.load(x_ptr + tl.program_id(0))
    for i in tl.static_range(STEPS):
        v = v * (1.0 + i * 1e-7) + i * 1e-3
    tl.store(x_ptr + tl.program_id(0), v)


class ICacheEvictor:
    """Call it to run the kernel on every SM (4 one-warp programs per SM); it touches
    only its own 4 bytes per program."""

    def __init__(self, device: torch.device) -> None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.scratch = torch.ones(4 * sms, device=device)
        self()  # compiled here, not in a timed call

    def __call__(self) -> None:
        _evict_kernel[(self.scratch.numel(),)](self.scratch, STEPS=STEPS, num_warps=1)
