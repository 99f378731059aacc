"""Triton backend on CUDA: equal to the torch reference, graph-capturable, batch invariant."""

from __future__ import annotations

import pytest
import torch

import graphexec as gx
from graphexec.params import SamplerVariant
from graphexec.rng import Stream
from graphexec.sampling import reference
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
    """True when the two tokens' reference scores x + g are within NEAR_TIE relative."""
    V = logits.shape[1]
    table = SamplingTensors.from_params(
        [params[row]], V, "cuda", counts[row : row + 1], prompt[row : row + 1]
    )
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    x = reference.collapse_inf(
        reference.process_logits(logits[row : row + 1], slots, table, bitmask[row : row + 1])
    )
    p = params[row]
    posr = torch.tensor([pos[row]], device="cuda")
    if p.temperature == 0:
        s = x[0]
    else:
        y = reference.scale(x, slots, table)
        s = y[0] + reference.row_gumbel(table.seed, posr, V)[0]
        db = reference.DRAW_BLOCK
        plain = bool(reference.plain_rows(slots, table)[0])
        if plain and tok_ref // db != tok_tri // db:
            # two-level draw: the blocks differ, so compare the block scores
            lm = reference.block_logmass(x, table.inv_temperature, db)
            g = reference.row_gumbel_stream(table.seed, posr, lm.shape[1], Stream.BLOCK)
            s = torch.repeat_interleave((lm + g)[0], db)[:V]
    a, b = s[tok_ref].item(), s[tok_tri].item()
    return abs(a - b) <= NEAR_TIE * max(1.0, abs(a))


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


@pytest.mark.parametrize("V", [32000, 128256, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
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
    for r in (0, 17, 63):
        alone = gx.sample_logits(
            logits[r : r + 1], params[r : r + 1], pos[r : r + 1], backend="triton"
        )
        assert alone.token_ids.item() == full.token_ids[r].item()


def test_register_cap_changes_no_token():
    """Row programs get a register cap only when rows outnumber the SMs (launch.py): the
    same rows in batches of 64 (no cap) give the same tokens as one large batch."""
    from graphexec.sampling.triton import launch

    V = 128256
    B = launch._sm_count(torch.device("cuda")) + 8
    assert launch.ROW_MAXNREG > 0
    logits, counts, prompt, bitmask = make_inputs(B, V, torch.float32, seed=3)
    params = mixed_params(B, V, seed=3)
    pos = [5 * i for i in range(B)]
    full = gx.sample_logits(logits, params, pos, backend="triton")
    for lo in range(0, B, 64):
        hi = min(B, lo + 64)
        part = gx.sample_logits(logits[lo:hi], params[lo:hi], pos[lo:hi], backend="triton")
        assert torch.equal(part.token_ids, full.token_ids[lo:hi])
        assert torch.allclose(
            part.logprobs, full.logprobs[lo:hi], rtol=1e-6, atol=0, equal_nan=True
        )


def test_top_p_first_step_changes_no_token(monkeypatch):
    """How far below its guess top-p's first gather reads (launch.TOP_P_STEP) changes the
    rounds and the candidates, never a token: flat rows (most need a second round at 1)
    and peaked ones, top-p alone and with min-p, against the torch reference."""
    from graphexec.sampling.triton import launch

    V, B = 128256, 48
    g = torch.Generator(device="cuda").manual_seed(11)
    scale = torch.tensor([3.0, 1.0, 8.0], device="cuda").repeat(B // 3)[:, None]
    logits = torch.randn(B, V, device="cuda", generator=g) * scale
    params = [P(seed=40 + i, top_p=(0.9, 0.5, 0.99)[i % 3], temperature=0.8,
                min_p=0.02 if i % 4 == 0 else 0.0) for i in range(B)]  # fmt: skip
    pos = [3 * i for i in range(B)]
    ref = gx.sample_logits(logits, params, pos, backend="torch").token_ids
    outs = []
    for step in (1, 2, 4):
        monkeypatch.setattr(launch, "TOP_P_STEP", step)
        outs.append(gx.sample_logits(logits, params, pos, backend="triton").token_ids)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert_equal_up_to_near_ties(logits, params, pos, ref, outs[1])


def test_gather_limit_changes_no_token(monkeypatch):
    """Rows without top-k may gather CAP x GATHER_MULT candidates (band) where the others
    stop at CAP (exact path): randn * 2.5 rows at p = 0.9, whose kept sets pass CAP, and
    min-p rows give the same tokens at GATHER_MULT 1 and 4, as the torch reference's."""
    from graphexec.sampling.triton import launch

    V, B = 128256, 16
    g = torch.Generator(device="cuda").manual_seed(12)
    logits = torch.randn(B, V, device="cuda", generator=g) * 2.5
    params = [P(seed=60 + i, temperature=0.8, top_p=0.9 if i % 2 else 1.0,
                min_p=0.0 if i % 2 else 0.01) for i in range(B)]  # fmt: skip
    pos = [7 * i for i in range(B)]
    ref = gx.sample_logits(logits, params, pos, backend="torch").token_ids
    outs = []
    for mult in (1, 4):
        monkeypatch.setattr(launch, "GATHER_MULT", mult)
        outs.append(gx.sample_logits(logits, params, pos, backend="triton").token_ids)
    assert torch.equal(outs[0], outs[1])
    assert_equal_up_to_near_ties(logits, params, pos, ref, outs[1])


def test_split_gather_changes_no_token(monkeypatch):
    """Top-p rows without top-k take their first gather from `split_gather` (B x SPLIT
    programs, slots by atomic adds) in batches up to SPLIT_MAX_B, from their own program
    above it: flat and peaked rows, top-p with and without min-p, beside top-k and min-p
    rows, give the same tokens with the split gather on (two splits) and off, as the torch
    reference's (up to near ties)."""
    from graphexec.sampling.triton import launch

    V, B = 128256, 48
    g = torch.Generator(device="cuda").manual_seed(13)
    scale = torch.tensor([3.0, 1.0, 8.0, 2.5], device="cuda").repeat(B // 4)[:, None]
    logits = torch.randn(B, V, device="cuda", generator=g) * scale
    kinds = [
        lambda i: P(seed=i, temperature=0.8, top_p=0.9),
        lambda i: P(seed=i, top_p=0.5, min_p=0.02),
        lambda i: P(seed=i, temperature=0.8, top_k=50, top_p=0.9),
        lambda i: P(seed=i, temperature=1.2, top_p=0.99),
        lambda i: P(seed=i, min_p=0.05),
        lambda i: P(seed=i, temperature=0.7, top_p=0.7, logit_bias={5: 12.0, 77000: 9.0}),
    ]
    params = [kinds[i % len(kinds)](90 + i) for i in range(B)]
    pos = [5 * i + 1 for i in range(B)]
    ref = gx.sample_logits(logits, params, pos, backend="torch").token_ids
    outs = []
    for max_b, programs in ((B, 2048), (B, 64), (0, 2048)):
        monkeypatch.setattr(launch, "SPLIT_MAX_B", max_b)
        monkeypatch.setattr(launch, "SPLIT_PROGRAMS", programs)
        outs.append(gx.sample_logits(logits, params, pos, backend="triton").token_ids)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
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


def test_two_level_draw_is_exact_on_gpu():
    """Chi-square (alpha 1e-6) of the Triton two-level draw at the library's DRAW_BLOCK:
    100,000 draws of one row of 8 blocks, against float64 softmax probabilities."""
    import numpy as np
    import scipy.stats

    V, N, chunk = 8 * reference.DRAW_BLOCK, 100_000, 20_000
    g = torch.Generator().manual_seed(11)
    row = torch.randn(V, generator=g) * 2.5
    row[: reference.DRAW_BLOCK] -= 4.0  # blocks of unequal mass
    row[5 * reference.DRAW_BLOCK + 7] = float("inf") * 0  # a NaN, never drawn
    probs = torch.softmax(torch.nan_to_num(row.double(), nan=-torch.inf) / 0.9, 0).numpy()
    p = gx.SamplingParams(temperature=0.9, seed=123)
    toks = []
    for start in range(0, N, chunk):
        logits = row.cuda().expand(chunk, -1).contiguous()
        out = gx.sample_logits(logits, [p] * chunk, torch.arange(start, start + chunk))
        assert out.valid.all()
        toks.append(out.token_ids.cpu().numpy())
    counts = np.bincount(np.concatenate(toks), minlength=V)
    assert counts[5 * reference.DRAW_BLOCK + 7] == 0
    exp = probs * N
    big = exp >= 5
    obs_b, exp_b = counts[big], exp[big]
    obs = np.append(obs_b, counts[~big].sum())
    ex = np.append(exp_b, exp[~big].sum())
    pval = scipy.stats.chisquare(obs, ex * obs.sum() / ex.sum()).pvalue
    assert pval > 1e-6, f"chi-square p = {pval:.3g}"
