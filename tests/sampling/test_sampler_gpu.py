"""Triton backend on CUDA: equal to the torch reference, graph-capturable, batch invariant,
the same tokens under any config."""

from __future__ import annotations

import pytest
import torch

import graphexec as gx
from graphexec.params import SamplerVariant
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from tests.sampling.gpu_cases import (
    BENCH_PARAMS,
    P,
    make_inputs,
    mixed_params,
    near_tie_ok,
    shape_logits,
)

pytestmark = pytest.mark.gpu


# every block-vector width (V) in fp32; each 16-bit dtype (its load and widening) at one
# width: a case compiles a whole set of kernels of its own (minutes on a fresh host)
@pytest.mark.parametrize(
    "dtype, V",
    [(torch.float32, 32000), (torch.float32, 128256), (torch.float32, 151936),
     (torch.bfloat16, 128256), (torch.float16, 151936)],
)  # fmt: skip
def test_triton_matches_torch(V, dtype):
    B = 256 if V != 151936 else 97
    logits, counts, prompt, bitmask = make_inputs(B, V, dtype, seed=V)
    params = mixed_params(B, V)
    pos = list(range(3, 3 + B))
    kw = dict(token_counts=counts, prompt_mask=prompt, bitmask=bitmask)
    ref = gx.sample_logits(logits, params, pos, backend="torch", **kw)
    tri = gx.sample_logits(logits, params, pos, backend="triton", **kw)
    assert torch.equal(ref.valid, tri.valid)
    bad = (ref.token_ids != tri.token_ids).nonzero().flatten().tolist()
    not_ties = [
        r
        for r in bad
        if not near_tie_ok(
            logits,
            params,
            pos,
            counts,
            prompt,
            bitmask,
            r,
            ref.token_ids[r].item(),
            tri.token_ids[r].item(),
        )
    ]
    print(f"V={V} {dtype}: {len(bad)} near-tie mismatches of {B}")
    assert not not_ties, f"rows {not_ties} differ beyond near-ties"
    same = ref.token_ids == tri.token_ids
    torch.testing.assert_close(tri.logprobs[same], ref.logprobs[same], rtol=1e-5, atol=1e-5)
    assert torch.equal(tri.ranks[same], ref.ranks[same])
    torch.testing.assert_close(tri.top_logprobs, ref.top_logprobs, rtol=1e-5, atol=1e-5)
    assert (tri.top_token_ids == ref.top_token_ids).float().mean() > 0.999


@pytest.mark.parametrize("V", [32000, 128256])
@pytest.mark.parametrize("variant", list(SamplerVariant))
def test_cuda_graph_replay_equals_eager(V, variant):
    B = 64
    logits, counts, prompt, bitmask = make_inputs(B, V, torch.float32, seed=1)
    params = [p for p in mixed_params(4 * B, V) if variant.serves(p)][:B]
    B = len(params)
    logits, counts, prompt, bitmask = logits[:B], counts[:B], prompt[:B], bitmask[:B]
    table = SamplingTensors.from_params(params, V, "cuda", counts, prompt)
    slots = torch.arange(B, device="cuda")
    pos = torch.zeros(B, dtype=torch.int64, device="cuda")
    static_logits = logits.clone()
    out = SamplerOutput.allocate(B, "cuda", 20)

    def step():
        gx.sample_step(static_logits, slots, pos, table, out, bitmask, variant, "triton")

    step()  # JIT warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator(device="cuda").manual_seed(5)
    for t in range(40):
        static_logits.copy_(torch.randn(B, V, device="cuda", generator=gen) * 3)
        pos.fill_(t)
        graph.replay()
        replay = [
            o.clone()
            for o in (out.token_ids, out.logprobs, out.ranks, out.top_logprobs, out.top_token_ids)
        ]
        step()
        eager = (out.token_ids, out.logprobs, out.ranks, out.top_logprobs, out.top_token_ids)
        for a, b in zip(replay, eager, strict=True):
            assert torch.equal(a, b), f"step {t}: replay != eager"


def test_batch_invariance_on_gpu():
    V = 128256
    logits, counts, prompt, bitmask = make_inputs(64, V, torch.bfloat16, seed=2)
    params = mixed_params(64, V)
    pos = list(range(64))
    full = gx.sample_logits(logits, params, pos, backend="triton")
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = gx.sample_logits(
        logits[perm], [params[i] for i in perm], [pos[i] for i in perm], backend="triton"
    )
    assert torch.equal(shuffled.token_ids, full.token_ids[perm])
    assert torch.equal(shuffled.logprobs, full.logprobs[perm])
    # alone and in a small batch (the stats pass's small-batch tiles): the same tokens and
    # logprobs, to the bit (row 63 asks for none: alone, it gets no logprobs at all)
    for rows in ([0], [17], [3], [63], [5, 40, 63]):
        alone = gx.sample_logits(
            logits[rows], [params[i] for i in rows], [pos[i] for i in rows], backend="triton"
        )
        assert torch.equal(alone.token_ids, full.token_ids[rows])
        if rows != [63]:
            assert torch.equal(alone.logprobs, full.logprobs[rows])


def preset_tokens_and(knobs: dict, logits: torch.Tensor, params: list,
                      variant: SamplerVariant = SamplerVariant.DEFAULT) -> list[torch.Tensor]:
    """The tokens of the GPU preset and of the preset with `knobs`, rows at positions 0..B-1."""
    from graphexec.sampling.triton.sampler_config import SamplerConfig

    B, V = logits.shape
    table = SamplingTensors.from_params(params, V, "cuda")
    rows = torch.arange(B, device="cuda")
    outs = []
    for cfg in (SamplerConfig.gpu(), SamplerConfig.gpu().replace(**knobs)):
        out = SamplerOutput.allocate(B, "cuda", None)
        gx.sample_step(logits, rows, rows, table, out, None, variant, "triton", config=cfg)
        outs.append(out.token_ids)
    return outs


@pytest.mark.parametrize("knobs", [dict(programs=64), dict(gather_cap=16, short_tokens=16),
                                   dict(bins=128), dict(num_warps=8, tail_warps=4),
                                   dict(row_elems=2),
                                   dict(short_blocks=0), dict(check_blocks=0),
                                   dict(check_blocks=1), dict(top_k_first=0),
                                   dict(topk_launch=True), dict(pdl=False),
                                   dict(late_queue=64),
                                   dict(late_queue=64, gather_cap=16, short_tokens=16),
                                   dict(late_queue=64, late_programs=8,
                                        check_blocks=0)])  # fmt: skip
def test_config_changes_no_token(knobs):
    """Another split, a gather cap that sends rows to the exact search, other bins or warps
    (row_elems 2: the row launches at 16 warps, the top-p total summed in another layout),
    the short route off, every candidate decided by the cut or by the check pass, top-k
    rows in a launch before the tail, plain launches (no kernel reading its row's
    parameters before the wait for the one before it), the passes after the check as one
    queue (with round 2 and the exact search; with more listed rows than programs): the
    same tokens as the GPU preset, on every shape and filter."""
    V, B = 128256, 48
    logits = torch.cat([shape_logits(s, B // 4, V, seed=22) for s in
                        ("peaked", "randn3", "flat", "ties")])  # fmt: skip
    params = [P(seed=i, temperature=0.8, **[*BENCH_PARAMS, dict(top_k=1000, top_p=0.95)][i % 5])
              for i in range(B)]  # fmt: skip
    preset, other = preset_tokens_and(knobs, logits, params)
    assert torch.equal(preset, other)


@pytest.mark.parametrize("B", [1, 48])
def test_late_queue_replayed_gives_the_launches_tokens(B):
    """The late queue captured once on a persistent workspace and replayed on new logits
    (flat, randn * 3 and peaked rows: round 1, round 2 and rows done at the check) gives
    the seven launches' tokens every time, and leaves its counters at zero."""
    from graphexec.sampling.triton.sampler_config import SamplerConfig, Workspace

    V = 151936
    params = [P(seed=i, temperature=0.8, **[*BENCH_PARAMS, dict(top_k=1000, top_p=0.95)][i % 5])
              for i in range(B)]  # fmt: skip
    table = SamplingTensors.from_params(params, V, "cuda")
    rows = torch.arange(B, device="cuda")
    pos = torch.zeros(B, dtype=torch.int64, device="cuda")
    cfg = SamplerConfig.gpu().replace(gather_cap=64, short_tokens=64)  # more rows in round 2
    queue, seven = (Workspace.allocate(B, V, "cuda", cfg) for _ in range(2))
    logits = torch.empty(B, V, device="cuda")
    out, ref = SamplerOutput.allocate(B, "cuda", None), SamplerOutput.allocate(B, "cuda", None)

    def step():
        gx.sample_step(logits, rows, pos, table, out, None, SamplerVariant.DEFAULT, "triton",
                       config=cfg.replace(late_queue=B), workspace=queue)  # fmt: skip

    logits.copy_(shape_logits("flat", B, V, seed=1))
    step()  # JIT warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in range(12):
        logits.copy_(shape_logits(("flat", "randn3", "peaked")[t % 3], B, V, seed=30 + t))
        pos.fill_(t)
        graph.replay()
        gx.sample_step(logits, rows, pos, table, ref, None, SamplerVariant.DEFAULT, "triton",
                       config=cfg, workspace=seven)  # fmt: skip
        assert torch.equal(out.token_ids, ref.token_ids), f"replay {t}"
        assert not queue.queue.any(), f"replay {t}: {queue.queue.nonzero().flatten().tolist()}"


@pytest.mark.parametrize("knobs", [dict(unfiltered_programs=64), dict(stats_registers=0)])
def test_unfiltered_pass_config_changes_no_token(knobs):
    """The no_filter variant's stats pass (its own split, unfiltered_programs, at its register
    cap, stats_registers: neither applies to a filtered variant): another split, or no cap,
    gives the GPU preset's tokens at B = 1 (a split of one tile a program either way), 48
    and 256, on every shape."""
    V = 128256
    for B in (1, 48, 256):
        logits = torch.cat([shape_logits(s, max(1, B // 4), V, seed=23) for s in
                            ("peaked", "randn3", "flat", "ties")])[:B]  # fmt: skip
        params = [P(seed=i, temperature=0.8) for i in range(B)]
        preset, other = preset_tokens_and(knobs, logits, params, SamplerVariant.NO_FILTER)
        assert torch.equal(preset, other), f"B = {B}"


def test_bad_rows_on_gpu():
    V = 32000
    logits = torch.randn(5, V, device="cuda")
    logits[1] = float("nan")
    logits[2] = float("-inf")
    logits[3, 100:110] = float("inf")
    logits[4, ::2] = float("nan")
    params = [P(seed=i, top_p=0.9) for i in range(5)]
    out = gx.sample_logits(logits, params, [0] * 5, backend="triton")
    assert out.valid.tolist() == [True, False, False, True, True]
    assert out.token_ids[1].item() == -1 and out.token_ids[2].item() == -1
    assert 100 <= out.token_ids[3].item() < 110
    assert out.token_ids[4].item() % 2 == 1
    alone = gx.sample_logits(logits[:1], params[:1], [0], backend="triton")
    assert alone.token_ids.item() == out.token_ids[0].item()
