"""Tuning aid: CUDA-graph time of the no-filter sampler for a few tile shapes.

python benchmarks/tune_two_level.py   # prints one line per (B, V, block, warps)
"""

from __future__ import annotations

import functools

import torch
import triton

import graphexec as gx
from graphexec.params import SamplerVariant
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.sampling.triton import launch


def graph_us(fn, reps: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    for B, V in [(256, 128256), (32, 128256), (1, 128256)]:
        logits = torch.randn(B, V, device="cuda") * 3
        params = [gx.SamplingParams(temperature=0.8, seed=i) for i in range(B)]
        table = SamplingTensors.from_params(params, V, "cuda")
        slots = torch.arange(B, device="cuda")
        pos = torch.arange(B, device="cuda")
        out = SamplerOutput.allocate(B, "cuda", None)
        base = min(64, triton.next_power_of_2(triton.cdiv(1024, B)))
        for block, warps, mult in ((512, 4, 1), (512, 2, 2), (512, 1, 4), (512, 2, 4),
                                   (512, 4, 2), (1024, 4, 2), (512, 1, 8)):  # fmt: skip
            launch.ROW_WARPS = warps
            sp = min(64 * mult, base * mult)
            fn = functools.partial(launch.sample, logits, slots, pos, table, out, None,
                                   SamplerVariant.NO_FILTER, block=block, split=sp)  # fmt: skip
            us = graph_us(fn)
            print(f"B={B} V={V} block={block} warps={warps} split={sp}: {us:.1f} us")


if __name__ == "__main__":
    main()
