"""Shared inputs of the Triton sampler tests: mixed batches, logits of several shapes, and
one call of both backends with the Triton workspace kept for inspection."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import graphexec as gx
from graphexec.params import SamplerVariant
from graphexec.sampling import reference
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.sampling.triton import launch
from graphexec.sampling.triton.sampler_config import SamplerConfig, Workspace

P = gx.SamplingParams
# the interpreter preset with blocks of 16 tokens (a few hundred tokens make many blocks),
# and the GPU preset as it runs on a GPU but for the late passes' programs (GPU_LATE); the first two
# with the short route, the candidate's early decision and top-k first off, so that
# filtered rows reach the selection passes the tests of those passes look at
# The check pass launches B x min(tiles, check_programs / B) programs (2,048 on the GPU
# preset), select and kept min(late_programs, that) (512): the interpreter pays about 2 ms
# for each, even one that leaves at once. 128 still splits each listed row over many programs.
GPU_LATE = 128
CONFIGS = {
    "interp16": SamplerConfig.interpreter().replace(
        draw_block=16, short_blocks=0, check_blocks=0, top_k_first=0
    ),  # fmt: skip
    "gpu_preset": SamplerConfig.gpu().replace(short_blocks=0, check_blocks=0, top_k_first=0,
                                              check_programs=GPU_LATE,
                                              late_programs=GPU_LATE),  # fmt: skip
    "interp16_short": SamplerConfig.interpreter().replace(draw_block=16),
    "gpu_short": SamplerConfig.gpu().replace(check_programs=GPU_LATE, late_programs=GPU_LATE),
}


def mixed(n: int, seed: int = 0, V: int = 1000) -> list[gx.SamplingParams]:
    """n rows cycling through every filter, penalty, bias and logprobs combination."""
    kinds = [
        lambda i: P(
            seed=i, logit_bias={7: 3.0, V - 50: -2.0}, logprobs=3, logprobs_mode="processed"
        ),  # fmt: skip
        lambda i: P(temperature=0.0, seed=i, logprobs=2),
        lambda i: P(top_k=5, seed=i, temperature=0.8),
        lambda i: P(top_p=0.8, seed=i, presence_penalty=0.7, frequency_penalty=0.4),
        lambda i: P(top_k=20, top_p=0.5, seed=i, temperature=1e-30, logit_bias={1: 10.0}),
        lambda i: P(min_p=0.2, seed=i, repetition_penalty=1.5, logprobs=0),
        lambda i: P(top_k=3, min_p=0.1, top_p=0.9, seed=i, temperature=1.5),
        lambda i: P(seed=i, temperature=0.7),
        lambda i: P(top_k=300, top_p=0.97, seed=i, temperature=0.9),
        lambda i: P(top_p=0.95, min_p=0.02, seed=i, temperature=2.5),
    ]
    return [kinds[i % len(kinds)](seed * 100 + i) for i in range(n)]


def logits_of(shape: str, B: int, V: int, seed: int = 0) -> torch.Tensor:
    """[B, V] fp32 rows: "randn3" (randn * 3), "peaked" (-2 ln rank, ranks permuted per row,
    as a real model's), "flat" (randn * 0.3: the filters keep most tokens), "ties" (all
    equal), "mixed" (a mixture of those, with NaN, +inf, -inf rows)."""
    g = torch.Generator().manual_seed(seed)
    if shape == "randn3":
        return torch.randn(B, V, generator=g) * 3
    if shape == "peaked":
        ranks = torch.stack([torch.randperm(V, generator=g) for _ in range(B)]).float() + 1
        return -2.0 * torch.log(ranks)
    if shape == "flat":
        return torch.randn(B, V, generator=g) * 0.3
    if shape == "ties":
        return torch.full((B, V), 1.5)
    x = torch.randn(B, V, generator=g) * 3
    for r in range(B):
        kind = r % 5
        if kind == 1:
            x[r] = torch.randn(V, generator=g) * 0.3
        elif kind == 2:
            x[r] = -2.0 * torch.log(torch.randperm(V, generator=g).float() + 1)
    if B > 3:
        x[0, 5] = float("nan")
        x[3, 10:13] = float("inf")
    if B > 6:
        x[6, :] = float("-inf")
    if B > 8:
        x[8, :] = 0.25  # ties
    return x


def extras(B: int, V: int, seed: int = 0):
    """(token_counts, prompt_mask, bitmask) with sparse counts, ~5% prompt tokens, and a
    random bitmask on odd rows (even rows allow everything)."""
    g = torch.Generator().manual_seed(seed + 1)
    counts = torch.randint(0, 3, (B, V), generator=g, dtype=torch.int32)
    counts[torch.rand(B, V, generator=g) < 0.9] = 0
    prompt = torch.rand(B, V, generator=g) < 0.05
    bitmask = torch.randint(-(2**31), 2**31 - 1, (B, (V + 31) // 32), generator=g,
                            dtype=torch.int32)  # fmt: skip
    bitmask[::2] = -1
    return counts, prompt, bitmask


@dataclass
class Both:
    ref: SamplerOutput
    tri: SamplerOutput
    ws: Workspace
    table: SamplingTensors

    @property
    def routes(self) -> list[int]:
        return self.ws.rowi[:, 0].tolist()


def run_both(
    params,
    logits,
    config: SamplerConfig,
    *,
    counts=None,
    prompt=None,
    bitmask=None,
    variant=SamplerVariant.DEFAULT,
    slots=None,
    positions=None,
    num_top=None,
    ref_variant=None,
) -> Both:
    """The torch reference (in `ref_variant`, None: the same variant) and the Triton
    backend on the same inputs."""
    B, V = logits.shape
    table = SamplingTensors.from_params(params, V, "cpu", counts, prompt)
    slot_ids = torch.arange(B) if slots is None else slots
    pos = torch.arange(B) * 7 + 3 if positions is None else positions
    ref = SamplerOutput.allocate(B, "cpu", num_top)
    tri = SamplerOutput.allocate(B, "cpu", num_top)
    reference.sample(logits, slot_ids, pos, table, ref, bitmask, ref_variant or variant,
                     draw_block=config.draw_block)  # fmt: skip
    ws = Workspace.allocate(B, V, "cpu", config, num_top is not None)
    launch.sample(logits, slot_ids, pos, table, tri, bitmask, variant, config=config,
                  workspace=ws)  # fmt: skip
    return Both(ref, tri, ws, table)


def assert_same(ref: SamplerOutput, tri: SamplerOutput) -> None:
    assert torch.equal(ref.valid, tri.valid)
    bad = (ref.token_ids != tri.token_ids).nonzero().flatten().tolist()
    assert not bad, (
        f"rows {bad}: reference {ref.token_ids[bad].tolist()}, triton {tri.token_ids[bad].tolist()}"
    )
    if ref.logprobs is not None:
        torch.testing.assert_close(tri.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5,
                                   equal_nan=True)  # fmt: skip
        assert torch.equal(tri.ranks, ref.ranks)
        assert torch.equal(tri.top_token_ids, ref.top_token_ids)
        torch.testing.assert_close(tri.top_logprobs, ref.top_logprobs, rtol=1e-5, atol=1e-5,
                                   equal_nan=True)  # fmt: skip
