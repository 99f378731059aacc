"""Triton backend on CUDA: equal to the torch reference, graph-capturable, batch invariant."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import graphexec as gx
from graphexec.params import SamplerVariant
from graphexec.rng import Stream
from graphexec.sampling import processing, reference
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors

pytestmark = pytest.mark.gpu
P = gx.SamplingParams
NEAR_TIE = 1e-5


def mixed_params(B: int, V: int, seed: int = 0) -> list[gx.SamplingParams]:
    g = torch.Generator().manual_seed(seed)
    kinds = [
        lambda i: P(temperature=0.8, top_k=50, top_p=0.9, seed=i, logprobs=5),
        lambda i: P(temperature=0.0, seed=i, logprobs=0),
        lambda i: P(temperature=1.0, seed=i),
        lambda i: P(temperature=0.7, top_p=0.95, seed=i, logprobs=20, logprobs_mode="processed"),
        lambda i: P(temperature=1.3, min_p=0.05, seed=i),
        lambda i: P(
            temperature=0.9,
            top_k=1000,
            seed=i,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
        ),
        lambda i: P(
            temperature=1.0,
            top_k=5,
            min_p=0.1,
            top_p=0.8,
            seed=i,
            logit_bias={int(torch.randint(V, (1,), generator=g)): 5.0, 3: -100.0},
        ),
        lambda i: P(temperature=0.5, top_k=2000, top_p=0.99, seed=i),
    ]
    return [kinds[i % len(kinds)](1000 + i) for i in range(B)]


def make_inputs(B: int, V: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(B, V, device="cuda", generator=g) * 4).to(dtype)
    counts = torch.randint(0, 3, (B, V), device="cuda", generator=g, dtype=torch.int32)
    counts = counts * (torch.rand(B, V, device="cuda", generator=g) < 0.001)
    prompt = torch.rand(B, V, device="cuda", generator=g) < 0.001
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (B, (V + 31) // 32), device="cuda", generator=g, dtype=torch.int32
    )
    bitmask[::3] = -1  # every third row unconstrained
    return logits, counts.to(torch.int32), prompt, bitmask


def near_tie_ok(logits, params, pos, counts, prompt, bitmask, row, tok_ref, tok_tri) -> bool:
    """Whether two backends' tokens for a row may differ by rounding alone (exp and log
    differ in their last bits between torch and Triton): the reference scores of the two
    blocks (two-level draw) or tokens lie within NEAR_TIE relative, or the row's top-p cut
    lies within NEAR_TIE of a token's boundary (the kept sets may differ by that token)."""
    V = logits.shape[1]
    table = SamplingTensors.from_params(
        [params[row]], V, "cuda", counts[row : row + 1], prompt[row : row + 1]
    )
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    x = processing.collapse_inf(
        processing.process_logits(logits[row : row + 1], slots, table, bitmask[row : row + 1])
    )
    posr = torch.tensor([pos[row]], device="cuda")

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= NEAR_TIE * max(1.0, abs(a))

    if params[row].temperature == 0:
        return close(x[0, tok_ref].item(), x[0, tok_tri].item())
    y = processing.scale(x, slots, table)
    s = reference.effective_inv_t(slots, table)
    kept = reference.filter_mask(y, slots, table, reference.row_mass(x, s, reference.DRAW_BLOCK))
    p = float(table.top_p[0])
    if p < 1.0:  # the boundary of the top-p cut: the mass before some token near p * total
        sv = torch.sort(y[0], descending=True, stable=True).values
        q = (torch.exp(sv) * 2.0**32).to(torch.int64).double()
        before = torch.cumsum(q, 0) - q
        k = int(table.top_k[0])
        total = q[:k].sum() if k > 0 else reference.row_mass(x, s, reference.DRAW_BLOCK)[0]
        if ((before - p * total).abs() <= NEAR_TIE * p * total).any():
            return True
    db = reference.DRAW_BLOCK
    xm, qb = reference.block_stats(x, s, db)
    ym = torch.where(xm > -torch.inf, (xm - processing.row_max(x)) * s, -torch.inf)
    plain = bool(reference.plain_rows(slots, table)[0])
    mass = qb if plain else reference.block_stats(x, s, db, kept)[1]
    lb = ym + torch.log(mass.float()) + reference.row_gumbel_stream(
        table.seed, posr, ym.shape[1], Stream.BLOCK)  # fmt: skip
    if tok_ref // db != tok_tri // db:
        return close(lb[0, tok_ref // db].item(), lb[0, tok_tri // db].item())
    sc = y[0] + reference.row_gumbel_stream(table.seed, posr, V, Stream.TOKEN)[0]
    return close(sc[tok_ref].item(), sc[tok_tri].item())


def assert_equal_up_to_near_ties(logits, params, pos, ref, got) -> None:
    """Token ids ref and got [B] are equal but at near-ties (rows without penalties or a
    bitmask)."""
    B, V = logits.shape
    counts = torch.zeros(B, V, dtype=torch.int32, device=logits.device)
    prompt = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
    ones = torch.full((B, (V + 31) // 32), -1, dtype=torch.int32, device=logits.device)
    for r in (ref != got).nonzero().flatten().tolist():
        tie = near_tie_ok(logits, params, pos, counts, prompt, ones, r, ref[r].item(),
                          got[r].item())  # fmt: skip
        assert tie, f"row {r} differs from the torch reference beyond a near-tie"


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


def shape_logits(shape: str, B: int, V: int, seed: int) -> torch.Tensor:
    """The benchmark's shapes (`benchmarks/bench_sampler.py`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sampler_methods import make_logits

    return make_logits(shape, B, V, torch.float32, torch.device("cuda"), seed)


BENCH_PARAMS = [dict(), dict(top_k=50, top_p=0.9), dict(top_p=0.9), dict(min_p=0.05)]


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


@pytest.mark.parametrize("knobs", [dict(programs=64), dict(gather_cap=16, short_tokens=16),
                                   dict(bins=128), dict(num_warps=8, tail_warps=4),
                                   dict(short_blocks=0), dict(check_blocks=0),
                                   dict(check_blocks=1), dict(top_k_first=0),
                                   dict(stats_registers=0),
                                   dict(pdl=False)])  # fmt: skip
def test_config_changes_no_token(knobs):
    """Another split, a gather cap that sends rows to the exact search, other bins or warps,
    the short route off, every candidate decided by the cut or by the check pass, the
    unfiltered stats pass without its register cap, the passes with one, plain launches
    (no kernel reading its row's parameters before the wait for the one before it): the
    same tokens as the GPU preset, on every shape and filter."""
    from graphexec.sampling.triton.sampler_config import SamplerConfig

    V, B = 128256, 48
    logits = torch.cat([shape_logits(s, B // 4, V, seed=22) for s in
                        ("peaked", "randn3", "flat", "ties")])  # fmt: skip
    params = [P(seed=i, temperature=0.8, **[*BENCH_PARAMS, dict(top_k=1000, top_p=0.95)][i % 5])
              for i in range(B)]  # fmt: skip
    pos = list(range(B))
    table = SamplingTensors.from_params(params, V, "cuda")
    slots = torch.arange(B, device="cuda")
    posd = torch.tensor(pos, device="cuda")
    outs = []
    for cfg in (SamplerConfig.gpu(), SamplerConfig.gpu().replace(**knobs)):
        out = SamplerOutput.allocate(B, "cuda", None)
        gx.sample_step(logits, slots, posd, table, out, backend="triton", config=cfg)
        outs.append(out.token_ids)
    assert torch.equal(outs[0], outs[1])


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


@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_top_k_first_parts_leave_the_total_bits(shape):
    """The top_k_top_p row launch serves a row alone by 16 programs (one draws the
    candidate, the others gather) and a row of a batch past the SM count by one, under the
    register cap of such a batch (`SamplerConfig.wide_registers`): the same token, and the
    same bits of the row's one float sum, the top-p total of rows with top-k off
    (`tail.tail_row`: neither the parts' code nor the cap may change its reduction)."""
    from graphexec.sampling.triton import launch
    from graphexec.sampling.triton.sampler_config import (
        SamplerConfig,
        Workspace,
        row_registers,
        topk_parts,
    )

    sms = launch.sm_count(torch.device("cuda"))
    V, B = 128256, max(128, sms + 8)
    logits = shape_logits(shape, B, V, seed=29)
    params = [P(seed=i, temperature=0.8, top_k=(0, 50, 0, 1000)[i % 4],
                top_p=(0.9, 0.9, 0.5, 0.95)[i % 4]) for i in range(B)]  # fmt: skip
    table = SamplingTensors.from_params(params, V, "cuda")
    cfg = SamplerConfig.gpu()
    assert topk_parts(cfg, 1) == 16 and topk_parts(cfg, B) == 1
    assert row_registers(cfg, 16, sms) == 0 < row_registers(cfg, B, sms)

    def run(rows):
        n = len(rows)
        out, ws = SamplerOutput.allocate(n, "cuda", None), Workspace.allocate(n, V, "cuda", cfg)
        launch.sample(logits[rows], torch.tensor(rows, device="cuda"),
                      torch.tensor(rows, device="cuda"), table, out, None,
                      SamplerVariant.TOP_K_TOP_P, config=cfg, workspace=ws)  # fmt: skip
        return out.token_ids, ws.total[:n].clone()

    tok_all, total_all = run(list(range(B)))
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


def chi_square_gpu(row: torch.Tensor, params: gx.SamplingParams, probs, n: int) -> None:
    import numpy as np

    chunk = 25_000
    toks = []
    for start in range(0, n, chunk):
        logits = row.cuda().expand(chunk, -1).contiguous()
        out = gx.sample_logits(logits, [params] * chunk, torch.arange(start, start + chunk))
        assert out.valid.all()
        toks.append(out.token_ids.cpu().numpy())
    assert_chi_square(np.concatenate(toks), probs, "")


def assert_chi_square(tokens, probs, name: str) -> None:
    """Chi-square (alpha 1e-6) of tokens against probabilities (bins of expected count < 5
    pooled), none outside the support."""
    import numpy as np
    import scipy.stats

    counts = np.bincount(tokens, minlength=probs.shape[0])
    assert not (counts * (probs == 0)).any(), f"{name}: a token outside the support"
    exp = probs * len(tokens)
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    ex = np.append(exp[big], exp[~big].sum())
    keep = ex > 0
    pval = scipy.stats.chisquare(obs[keep], ex[keep] * obs.sum() / ex[keep].sum()).pvalue
    assert pval > 1e-6, f"{name} chi-square p = {pval:.3g}"


def test_two_level_draw_is_exact_on_gpu():
    """Chi-square (alpha 1e-6) of the Triton two-level draw at the library's DRAW_BLOCK:
    100,000 draws of one row of 8 blocks, against float64 softmax probabilities."""
    V = 8 * reference.DRAW_BLOCK
    g = torch.Generator().manual_seed(11)
    row = torch.randn(V, generator=g) * 2.5
    row[: reference.DRAW_BLOCK] -= 4.0  # blocks of unequal mass
    row[5 * reference.DRAW_BLOCK + 7] = float("nan")  # never drawn
    probs = torch.softmax(torch.nan_to_num(row.double(), nan=-torch.inf) / 0.9, 0).numpy()
    chi_square_gpu(row, gx.SamplingParams(temperature=0.9, seed=123), probs, 100_000)


FILTERS = {"top_k": dict(top_k=20), "top_p": dict(top_p=0.9),
           "top_k_top_p": dict(top_k=50, top_p=0.9), "min_p": dict(min_p=0.05),
           "all": dict(top_k=200, top_p=0.95, min_p=0.02)}  # fmt: skip


def kept_probs(row: torch.Tensor, T: float, filt: dict):
    """float64 probabilities of the filtered row (top-k, then top-p on the kept mass, then
    min-p), with every filter's boundary at least 1e-4 (relative mass) from a token."""
    y = row.double() / T
    w = torch.exp(y - y.max())
    order = torch.argsort(-y, stable=True)
    keep = torch.ones(row.shape[0], dtype=torch.bool)
    ws = w[order]
    k = filt.get("top_k", 0)
    if k:
        keep[order[k:]] = False
        ws = torch.where(torch.arange(len(ws)) < k, ws, 0.0)
    if "top_p" in filt:
        cum = torch.cumsum(ws, 0) - ws
        total = ws.sum()
        live = ws > 0
        gap = ((cum[live] - filt["top_p"] * total).abs() / total).min().item()
        assert gap > 1e-4, "top-p boundary too close to a token"
        keep[order[cum >= filt["top_p"] * total]] = False
    if "min_p" in filt:
        assert ((w - filt["min_p"]).abs() > 1e-4).all()
        keep &= w >= filt["min_p"]
    probs = torch.where(keep, w, 0.0)
    return (probs / probs.sum()).numpy(), int(keep.sum())


@pytest.mark.parametrize("shape", ["flat", "peaked"])
@pytest.mark.parametrize("name", list(FILTERS))
def test_every_filter_is_exact_on_gpu(name, shape):
    """Chi-square (alpha 1e-6) of each filter on a flat row of 12 blocks (top-p and min-p
    keep most of it: the selection passes at work) and a peaked one (-2 ln rank, ranks
    permuted: a few tokens kept, by the short route), 200,000 draws, against float64
    probabilities of the kept set."""
    V = 12 * reference.DRAW_BLOCK
    g = torch.Generator().manual_seed(12 if shape == "flat" else 13)
    if shape == "flat":
        row = torch.randn(V, generator=g) * 0.4
    else:
        row = -2.0 * torch.log(torch.randperm(V, generator=g).float() + 1)
    filt = FILTERS[name]
    probs, kept = kept_probs(row, 0.8, filt)
    assert kept >= 3
    chi_square_gpu(row, gx.SamplingParams(temperature=0.8, seed=77, **filt), probs, 200_000)


@pytest.mark.parametrize("shape,filt", [("flat", dict(top_p=0.7)),
                                        ("peaked", dict(top_k=6, top_p=0.8)),
                                        ("flat", dict(min_p=0.4))])  # fmt: skip
def test_candidate_and_fallback_routes_are_exact_on_gpu(shape, filt):
    """Chi-square (alpha 1e-6) of the Triton tokens of 200,000 draws of one row, split by
    the route the reference says each draw took (candidate kept, or the fallback draw),
    and of all of them: each follows the filtered distribution. The Triton tokens equal
    the reference's, so its routes are theirs."""
    import numpy as np

    V, n, chunk = 12 * reference.DRAW_BLOCK, 200_000, 25_000
    g = torch.Generator().manual_seed(31)
    if shape == "flat":
        row = torch.randn(V, generator=g) * 0.4
    else:
        row = -2.0 * torch.log(torch.randperm(V, generator=g).float() + 1)
    probs, _ = kept_probs(row, 0.8, filt)
    params = gx.SamplingParams(temperature=0.8, seed=91, **filt)
    toks, took = [], []
    for start in range(0, n, chunk):
        logits = row.cuda().expand(chunk, -1).contiguous()
        pos = torch.arange(start, start + chunk)
        out = gx.sample_logits(logits, [params] * chunk, pos, backend="triton")
        table = SamplingTensors.from_params([params], V, "cuda")
        slots = torch.zeros(chunk, dtype=torch.int64, device="cuda")
        d, _ = reference.draw_batch(logits, slots, pos.cuda(), table)
        same = (d.token_ids == out.token_ids).float().mean().item()
        assert same > 0.9999, f"Triton and reference tokens agree on {same:.5f} of draws"
        toks.append(out.token_ids.cpu().numpy())
        took.append(d.kept.cpu().numpy())
    toks, took = np.concatenate(toks), np.concatenate(took)
    assert took.sum() > 10_000 and (~took).sum() > 10_000, "both routes must be taken"
    for name, sel in (("candidate", took), ("fallback", ~took), ("all", took | ~took)):
        assert_chi_square(toks[sel], probs, f"{name} route")
