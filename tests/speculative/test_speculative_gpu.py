"""Speculative decoding on CUDA: Triton verification equal to torch, replay equal to eager
with speculation, rejection mode distribution-exact at the real vocabulary, and an equal
draft model accepted in full with TinyLM."""

from __future__ import annotations

import pytest
import torch
from scipy import stats as sps

import graphexec as gx
from graphexec.app import workload as wl
from tests.sampling.gpu_cases import make_inputs, mixed_params, near_tie_ok

pytestmark = pytest.mark.gpu
ALPHA = 1e-6


@pytest.fixture(scope="module")
def tok() -> gx.Tokenizer:
    return gx.Tokenizer.cl100k()


@pytest.mark.parametrize("V", [128256, 151936])
def test_triton_verify_matches_torch(V):
    B, K = 48, 3
    T = K + 1
    logits, counts, prompt, _ = make_inputs(B * T, V, torch.float32, seed=V)
    logits = logits.view(B, T, V)
    counts, prompt = counts[:B], prompt[:B]
    bitmask = torch.full((B, T, (V + 31) // 32), -1, dtype=torch.int32, device="cuda")
    bitmask[1::4, 2, :100] = 0  # some offsets forbid the first 3200 ids
    params = mixed_params(B, V)
    pos = torch.arange(5, 5 + B)
    kw = dict(token_counts=counts, prompt_mask=prompt, bitmask=bitmask)
    seq = gx.verify_drafts(logits, torch.full((B, K), -1, device="cuda"), params, pos,
                           backend="torch", **kw)  # fmt: skip
    # drafts: the reference's offset-0 token, then mostly its own continuation: draws
    # at offsets 1..K count these drafts, so compare the flattened draws row by row
    drafts = torch.randint(0, V, (B, K), device="cuda")
    drafts[:, 0] = seq.token_ids[:, 0]
    ref = gx.verify_drafts(logits, drafts, params, pos, backend="torch", **kw)
    drafts[:, 1:] = ref.sampled.token_ids.view(B, T)[:, 1:K]
    ref = gx.verify_drafts(logits, drafts, params, pos, backend="torch", **kw)
    got = gx.verify_drafts(logits, drafts, params, pos, backend="triton", **kw)
    a, b = ref.sampled.token_ids, got.sampled.token_ids
    flat_counts = counts.repeat_interleave(T, 0).clone()
    for j in range(1, T):
        for k in range(j):
            rows = torch.arange(B, device="cuda") * T + j
            flat_counts[rows, drafts[:, k]] += 1
    flat_params = [p for p in params for _ in range(T)]
    flat_pos = (pos.unsqueeze(1) + torch.arange(T)).reshape(-1).tolist()
    for r in (a != b).nonzero().flatten().tolist():
        assert near_tie_ok(logits.view(B * T, V), flat_params, flat_pos, flat_counts,
                           prompt.repeat_interleave(T, 0), bitmask.view(B * T, -1), r,
                           a[r].item(), b[r].item()), f"flattened row {r} differs"  # fmt: skip
    assert (a != b).sum() <= 2
    same = (ref.token_ids == got.token_ids).all(dim=1)
    assert same.sum() >= B - 2
    assert torch.equal(ref.num_tokens[same], got.num_tokens[same])
    assert int(ref.num_accepted.sum()) > B  # the drafts were mostly accepted


@pytest.mark.parametrize("B", [1, 64])
def test_verify_step_replays_in_a_cuda_graph(B):
    K, V = 3, 128256
    T = K + 1
    logits = make_inputs(B * T, V, torch.float32, seed=1)[0].view(B, T, V)
    params = mixed_params(B, V)
    table = gx.SamplingTensors.from_params(params, V, "cuda")
    drafts = torch.randint(0, V, (B, K), device="cuda")
    slots = torch.arange(B, device="cuda")
    pos = torch.arange(B, device="cuda")
    from graphexec.sampling.triton.sampler_config import SamplerConfig, Workspace

    cfg = SamplerConfig.default()
    ws = Workspace.allocate(B * T, V, "cuda", cfg, logprobs=True)
    out = gx.VerifyOutput.allocate(B, K, "cuda", 20)

    def call():
        gx.verify_step(logits, drafts, slots, pos, table, out, config=cfg, workspace=ws)

    call()
    eager = out.token_ids.clone(), out.logprobs.clone()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        call()
    out.token_ids.fill_(-7)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.token_ids, eager[0])
    assert torch.equal(out.logprobs.nan_to_num(), eager[1].nan_to_num())


def test_rejection_is_distribution_exact_at_the_real_vocabulary():
    V, R, B = 128256, 20, 500
    g = torch.Generator(device="cuda").manual_seed(3)
    row = torch.randn(V, device="cuda", generator=g) * 0.5
    row[:8] += torch.tensor([6.0, 5.5, 5.0, 4.5, 4.0, 3.5, 3.0, 2.5], device="cuda")
    logits = row.expand(B, 2, V).contiguous()
    draft = 2  # a one-hot draft: accepted with probability p(2)
    p = gx.SamplingParams(temperature=0.9, top_p=0.95)
    probs = torch.softmax(row.double() / torch.tensor(0.9, dtype=torch.float32).double(), 0)
    sv, si = torch.sort(probs, descending=True)
    keep = torch.cumsum(sv, 0) - sv < 0.95
    target = torch.zeros_like(probs)
    target[si[keep]] = sv[keep]
    target /= target.sum()
    firsts, accepted = [], 0
    for r in range(R):
        ps = [p.with_seed(1000 * r + i) for i in range(B)]
        out = gx.verify_drafts(logits, torch.full((B, 1), draft, device="cuda"), ps,
                               [7] * B, method="rejection")  # fmt: skip
        firsts.append(out.token_ids[:, 0])
        accepted += int(out.num_accepted.sum())
    first = torch.cat(firsts)
    n = first.numel()
    top = si[:8].tolist()
    obs = [int((first == t).sum()) for t in top] + [int((~torch.isin(first, si[:8])).sum())]
    exp = [float(target[t]) * n for t in top] + [float(1 - target[si[:8]].sum()) * n]
    assert sps.chisquare(obs, exp).pvalue > ALPHA
    assert bool(target[first].gt(0).all())  # never outside the top-p set
    pa = float(target[draft])
    z = (accepted - n * pa) / (n * pa * (1 - pa)) ** 0.5
    assert abs(z) < 5.3  # two-sided alpha ~ 1e-7


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_replay_equals_eager_with_speculation(tok, drafter):
    V = tok.vocab_size
    model = gx.models.TinyLM(V, seed=0, max_seq_len=512)
    draft = "ngram" if drafter == "ngram" else gx.models.TinyLM(V, seed=0, layers=1,
                                                                  max_seq_len=512)  # fmt: skip
    ex = gx.DecodeExecutor(model, max_batch_size=32, device="cuda", tokenizer=tok, seed=0,
                           speculative=gx.SpeculativeConfig(3, drafter=draft))  # fmt: skip
    ex.capture(progress=False)
    assert ex.stats.failed == {}
    items = wl.mixed_workload(64, V, seed=1, grammars=True, spread=100)
    a, b = wl.replay_and_eager(ex, items)
    assert wl.compare(a, b) == []
    assert any(k.spec_k == 3 for k, n in ex.stats.replays.items() if n)
    plain = gx.DecodeExecutor(gx.models.TinyLM(V, seed=0, max_seq_len=512), max_batch_size=32,
                              device="cuda", tokenizer=tok, seed=0)  # fmt: skip
    plain.capture(progress=False)
    c = wl.run(plain, wl.with_reported_seeds(items, a))
    assert [m for m in wl.compare(c, a) if m.what in ("token", "length", "finish")] == []


def test_equal_draft_model_emits_k_plus_1_tokens_per_row(tok):
    V, K, B = tok.vocab_size, 3, 16
    spec = gx.SpeculativeConfig(K, drafter=gx.models.TinyLM(V, seed=0))
    ex = gx.DecodeExecutor(gx.models.TinyLM(V, seed=0), max_batch_size=B, device="cuda",
                           tokenizer=tok, seed=0, speculative=spec)  # fmt: skip
    ex.capture(progress=False)
    for i in range(B):
        p = gx.SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=10 * (K + 1))
        ex.add_request(f"q{i}", [i + 1, 7, 9], p)
    steps = []  # the first step prefills, then runs from the last prompt token
    for _ in range(30):  # (with overlap, each step's outputs come a call after its launch)
        if ex.idle:
            break
        outs = list(ex.step())
        if outs:
            steps.append(outs)
    assert ex.idle, f"not idle after 30 calls: {[len(s) for s in steps]} outputs a step"
    assert len(steps) == 10
    for outs in steps:
        per_row = {o.request_id: 0 for o in outs}
        for o in outs:
            per_row[o.request_id] += 1
        assert len(per_row) == B and set(per_row.values()) == {K + 1}
    assert ex.stats.accepted == ex.stats.drafted == B * 10 * K
