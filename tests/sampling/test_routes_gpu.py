"""Triton backend on CUDA: the routes rows take (the benchmark's rows, rows past the SM
count, top-k first's parts) give the reference's tokens and bits."""

from __future__ import annotations

import pytest
import torch
import triton

import graphexec as gx
from graphexec.params import SamplerVariant
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from tests.sampling.gpu_cases import (
    BENCH_PARAMS,
    P,
    assert_equal_up_to_near_ties,
    shape_logits,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", ["peaked", "randn3", "flat", "ties"])
def test_bench_shapes_take_the_fast_routes(shape):
    """Every row of the benchmark's methods on every shape, at the verification benchmark's
    temperatures (0.7 to 1.0: randn3 rows at 1.0 with top-p alone missed their first
    bracket, 1 in about 30), is served without the exact search, and equals the reference
    (up to near ties)."""
    from graphexec.sampling.triton import launch
    from graphexec.sampling.triton.sampler_config import R_EXACT, SamplerConfig, Workspace

    V, B = 128256, 256
    logits = shape_logits(shape, B, V, seed=21)
    params = [P(seed=i, temperature=(0.7, 0.8, 0.9, 1.0)[i // 4 % 4], **BENCH_PARAMS[i % 4])
              for i in range(B)]  # fmt: skip
    pos = list(range(B))
    table = SamplingTensors.from_params(params, V, "cuda")
    out = SamplerOutput.allocate(B, "cuda", None)
    cfg = SamplerConfig.gpu()
    ws = Workspace.allocate(B, V, "cuda", cfg)
    launch.sample(logits, torch.arange(B, device="cuda"), torch.tensor(pos, device="cuda"), table,
                  out, config=cfg, workspace=ws)  # fmt: skip
    routes = ws.rowi[:, 0].tolist()
    assert int(R_EXACT) not in routes, f"{shape}: rows {routes}"
    ref = gx.sample_logits(logits, params, pos, backend="torch").token_ids
    assert_equal_up_to_near_ties(logits, params, pos, ref, out.token_ids)


@pytest.mark.parametrize("shape, num_top", [("peaked", None), ("flat", 2)])
def test_default_rows_past_the_sm_count_equal_each_row_alone(shape, num_top):
    """The default variant's row launches (tail, short route, finish; the raw logprobs
    writer) under the register cap of a batch past the SM count
    (`SamplerConfig.wide_registers`) against the same rows alone, uncapped: the same tokens,
    on rows of each route (unfiltered, top-k first, the candidate's check, the short route,
    the selection passes, min-p's cut), and the same logprobs to the bit."""
    from graphexec.sampling.triton import launch
    from graphexec.sampling.triton.sampler_config import SamplerConfig, Workspace, row_registers

    sms = launch.sm_count(torch.device("cuda"))
    V, B = 128256, sms + 8
    cfg = SamplerConfig.gpu()
    assert row_registers(cfg, B, sms, 1024) > 0 == row_registers(cfg, 1, sms, 1024)
    logits = shape_logits(shape, B, V, seed=31)
    kinds = BENCH_PARAMS + [dict(top_k=1000, top_p=0.95)]
    params = [P(seed=i, temperature=(0.7, 1.0)[i % 2], logprobs=num_top,
                **kinds[i % len(kinds)]) for i in range(B)]  # fmt: skip
    table = SamplingTensors.from_params(params, V, "cuda")

    def run(rows):
        n = len(rows)
        out = SamplerOutput.allocate(n, "cuda", num_top)
        ws = Workspace.allocate(n, V, "cuda", cfg, num_top is not None)
        launch.sample(logits[rows], torch.tensor(rows, device="cuda"),
                      torch.tensor(rows, device="cuda"), table, out, config=cfg,
                      workspace=ws)  # fmt: skip
        assert out.valid.all()
        if num_top is None:
            return (out.token_ids,)
        return out.token_ids, out.logprobs, out.ranks, out.top_logprobs, out.top_token_ids

    full = run(list(range(B)))
    for r in range(0, B, 7):
        for a, b in zip(run([r]), full, strict=True):
            assert torch.equal(a[0], b[r]), r


@pytest.mark.parametrize("shape", ["peaked", "flat"])
@pytest.mark.parametrize("filt", [dict(top_p=0.9), dict(min_p=0.05)])
def test_benchmark_rows_of_the_default_variant(shape, filt):
    """The benchmark's own top_p and min_p rows (its logits, seed 0; T 0.8; B = 128), twice
    on one workspace: the short kernel resolves peaked rows' select routes, and its build
    once faulted there on an H200 (the append to round 1's row list). Both calls equal the
    reference up to near ties and each other; the list holds distinct rows of the batch."""
    from graphexec.sampling.triton import launch
    from graphexec.sampling.triton.sampler_config import SamplerConfig, Workspace

    V, B = 128256, 128
    logits = shape_logits(shape, B, V, seed=0)
    params = [P(seed=1000 + b, temperature=0.8, **filt) for b in range(B)]
    table = SamplingTensors.from_params(params, V, "cuda")
    cfg = SamplerConfig.gpu()
    ws = Workspace.allocate(B, V, "cuda", cfg)
    rows, pos = torch.arange(B, device="cuda"), torch.arange(B, device="cuda") + 7
    ref = gx.sample_logits(logits, params, pos.tolist(), backend="torch").token_ids
    toks = []
    for _ in range(2):
        out = SamplerOutput.allocate(B, "cuda", None)
        launch.sample(logits, rows, pos, table, out, config=cfg, workspace=ws)
        torch.cuda.synchronize()
        n = ws.listed[0].item()
        listed = ws.listed[1:1 + n].tolist()
        assert 0 <= n <= B and len(set(listed)) == n and all(0 <= r < B for r in listed)
        assert_equal_up_to_near_ties(logits, params, pos.tolist(), ref, out.token_ids)
        toks.append(out.token_ids)
    assert torch.equal(toks[0], toks[1])


@pytest.mark.parametrize("shape, V", [("peaked", 128256), ("flat", 151936)])
def test_top_k_first_parts_leave_the_total_bits(shape, V):
    """The top_k_top_p row launch serves a row alone by 16 programs (one draws the
    candidate, the others gather) and a row of a batch past the SM count by one, under the
    register cap of such a batch (`SamplerConfig.wide_registers`; at V = 151,936 with
    fewer warps, `row_warps`): the same token, and the same bits of the row's one float
    sum, the top-p total of rows with top-k off (`tail.tail_row`, fixed point: neither the
    parts' code, the cap nor the warps may change it), as the default variant's."""
    from graphexec.sampling.triton import launch
    from graphexec.sampling.triton.sampler_config import (
        SamplerConfig,
        Workspace,
        row_registers,
        row_warps,
        topk_parts,
    )

    sms = launch.sm_count(torch.device("cuda"))
    B = max(128, sms + 8)
    logits = shape_logits(shape, B, V, seed=29)
    params = [P(seed=i, temperature=0.8, top_k=(0, 50, 0, 1000)[i % 4],
                top_p=(0.9, 0.9, 0.5, 0.95)[i % 4]) for i in range(B)]  # fmt: skip
    table = SamplingTensors.from_params(params, V, "cuda")
    cfg = SamplerConfig.gpu()
    assert topk_parts(cfg, 1) == 16 and topk_parts(cfg, B) == 1
    assert row_registers(cfg, 16, sms) == 0 < row_registers(cfg, B, sms)
    nblk_p2 = triton.next_power_of_2(triton.cdiv(V, cfg.draw_block))
    if V > 131072:
        assert row_warps(cfg, nblk_p2, False) > row_warps(cfg, nblk_p2, True)

    def run(rows, variant=SamplerVariant.TOP_K_TOP_P):
        n = len(rows)
        out, ws = SamplerOutput.allocate(n, "cuda", None), Workspace.allocate(n, V, "cuda", cfg)
        launch.sample(logits[rows], torch.tensor(rows, device="cuda"),
                      torch.tensor(rows, device="cuda"), table, out, None, variant,
                      config=cfg, workspace=ws)  # fmt: skip
        return out.token_ids, ws.total[:n].clone()

    tok_all, total_all = run(list(range(B)))
    tok_def, total_def = run(list(range(B)), SamplerVariant.DEFAULT)
    assert torch.equal(tok_all, tok_def)
    off = torch.tensor([p.top_k == 0 for p in params], device="cuda")
    assert torch.equal(total_all[off].view(torch.int64), total_def[off].view(torch.int64))
    for r in range(0, B, 7):
        tok, total = run([r])
        assert tok.item() == tok_all[r].item(), r
        if params[r].top_k == 0:
            assert total.view(torch.int64).item() == total_all[r:r + 1].view(torch.int64).item()


@pytest.mark.parametrize("shape", ["peaked", "randn3", "flat", "ties"])
def test_top_k_first_gives_defaults_tokens_on_gpu(shape):
    """The top_k_top_p variant (stats, then `topk`'s row kernel) against default's kernels
    on the same GPU: the same token in every row, k from 1 to TOP_K_FIRST_MAX, none by the
    exact search (flat rows with a large k narrowed by the histogram); and the reference's,
    up to near ties."""
    from graphexec.params import TOP_K_FIRST_MAX
    from graphexec.sampling.triton import launch
    from graphexec.sampling.triton.sampler_config import R_EXACT, SamplerConfig, Workspace

    V, B = 128256, 96
    logits = shape_logits(shape, B, V, seed=23)
    ks = (1, 2, 20, 50, 200, TOP_K_FIRST_MAX)
    params = [P(seed=i, temperature=(0.7, 1.0, 1.5)[i % 3], top_k=ks[i // 3 % 6],
                top_p=(1.0, 0.9, 0.5, 0.99)[i // 18 % 4]) if i % 16 else P(seed=i)
              for i in range(B)]  # fmt: skip
    assert gx.choose_variant(params) is SamplerVariant.TOP_K_TOP_P
    pos = list(range(B))
    table = SamplingTensors.from_params(params, V, "cuda")
    cfg = SamplerConfig.gpu()
    slots, posd = torch.arange(B, device="cuda"), torch.tensor(pos, device="cuda")
    outs, routes = [], None
    for variant in (SamplerVariant.TOP_K_TOP_P, SamplerVariant.DEFAULT):
        out = SamplerOutput.allocate(B, "cuda", None)
        ws = Workspace.allocate(B, V, "cuda", cfg)
        launch.sample(logits, slots, posd, table, out, None, variant, config=cfg, workspace=ws)
        outs.append(out.token_ids)
        routes = routes or ws.rowi[:, 0].tolist()
    assert torch.equal(outs[0], outs[1])
    assert int(R_EXACT) not in routes
    ref = gx.sample_logits(logits, params, pos, backend="torch").token_ids
    assert_equal_up_to_near_ties(logits, params, pos, ref, outs[0])
