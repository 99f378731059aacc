"""Shared cases and checks of the `verify_drafts` tests (test_verify_*.py): a mixed batch
of every sampling feature, ordinary sequential sampling to compare strict mode with, the
filtered target distribution in float64, chi-square checks at ALPHA."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import numpy as np
import scipy.stats
import torch

import graphexec as gx
from graphexec.speculative import VerifyOutput, verify_drafts

P = gx.SamplingParams
ALPHA = 1e-6
METHODS = ("strict", "rejection")
NINF, NAN = float("-inf"), float("nan")



def bits(allowed: torch.Tensor) -> torch.Tensor:
    """[..., V] bool -> [..., ceil(V/32)] int32 xgrammar bitmask words."""
    *lead, V = allowed.shape
    W = (V + 31) // 32
    padded = torch.zeros((*lead, W * 32), dtype=torch.int64)
    padded[..., :V] = allowed.to(torch.int64)
    words = (padded.view(*lead, W, 32) << torch.arange(32)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def sequential(logits, params, positions, token_counts=None, prompt_mask=None, allowed=None,
               backend="torch"):  # fmt: skip
    """Ordinary sampling of the K+1 offsets one after the other: offset j at positions + j,
    with the tokens drawn before j counted. Returns ([B, T] tokens, T `SamplerOutput`s)."""
    B, T, V = logits.shape
    counts = torch.zeros((B, V), dtype=torch.int32) if token_counts is None else token_counts
    counts = counts.clone()
    pos = torch.as_tensor(positions, dtype=torch.int64)
    outs = []
    for j in range(T):
        bm = None if allowed is None else bits(allowed[:, j])
        o = gx.sample_logits(logits[:, j], params, pos + j, token_counts=counts,
                             prompt_mask=prompt_mask, bitmask=bm, backend=backend)  # fmt: skip
        outs.append(o)
        ok = o.token_ids >= 0
        counts[ok.nonzero().flatten(), o.token_ids[ok]] += 1
    return torch.stack([o.token_ids for o in outs], dim=1), outs


def filtered_dist(x, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, margin=1e-3) -> np.ndarray:
    """float64 probabilities of the processed row x under DESIGN.md's filters: order by
    (value desc, id asc); top-k; top-p on the top-k mass (keep j iff the mass before j is
    below p times the total); min-p relative to the max. Asserts every decision lies at
    least `margin` (relative) from its threshold, so float32 rounding cannot flip it."""
    x = np.asarray(x, dtype=np.float64)
    V = x.shape[0]
    order = np.lexsort((np.arange(V), -x))
    y = (x - x.max()) / temperature
    w = np.exp(y)
    k = top_k if 0 < top_k < V else V
    pref = order[:k]
    if k < V:
        assert x[order[k - 1]] - x[order[k]] > margin
    if top_p < 1.0:
        mass = w[pref]
        before = np.cumsum(mass) - mass
        cut = top_p * mass.sum()
        assert np.abs(before - cut).min() > margin * mass.sum()
        pref = pref[before < cut]
    keep = np.zeros(V, dtype=bool)
    keep[pref] = True
    if min_p > 0.0:
        fin = np.isfinite(y)
        assert np.abs(y[fin] - np.log(min_p)).min() > margin
        keep &= y >= np.log(min_p)
    p = np.where(keep, w, 0.0)
    return p / p.sum()


def assert_follows(tokens, p: np.ndarray, what: str = "tokens") -> float:
    """Chi-square of the token histogram against p (no token where p is 0); the p-value."""
    tokens = np.asarray(tokens)
    assert (tokens >= 0).all()
    counts = np.bincount(tokens, minlength=len(p))
    assert counts[p == 0].sum() == 0, f"{what}: drawn outside the support {np.flatnonzero(p)}"
    sup = p > 0
    expected = p[sup] * len(tokens)
    assert expected.min() >= 5, "too few samples per bin for a chi-square"
    pval = scipy.stats.chisquare(counts[sup], expected).pvalue
    assert pval > ALPHA, f"{what}: chi-square p = {pval:.3g}\n{counts}\n{expected.round(1)}"
    return pval


def rejects(tokens, p: np.ndarray) -> bool:
    """Whether the chi-square rejects p for these tokens (the power check of a test)."""
    counts = np.bincount(np.asarray(tokens), minlength=len(p))
    if counts[p == 0].sum():
        return True
    sup = p > 0
    return scipy.stats.chisquare(counts[sup], p[sup] * len(tokens)).pvalue < ALPHA


def assert_rate(successes: int, n: int, rate: float, what: str) -> None:
    pval = scipy.stats.binomtest(int(successes), int(n), rate).pvalue
    assert pval > ALPHA, f"{what}: {successes}/{n} vs rate {rate:.5f}, p = {pval:.3g}"


def verify(logits, drafts, params, positions, **kw) -> VerifyOutput:
    kw.setdefault("backend", "torch")
    return verify_drafts(logits, drafts, params, positions, **kw)


def assert_same_output(a, b) -> None:
    """Two VerifyOutputs equal token for token (logprobs of emitted tokens close)."""
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.num_tokens, b.num_tokens)
    assert torch.equal(a.valid, b.valid)
    assert (a.logprobs is None) == (b.logprobs is None)
    if a.logprobs is not None:
        emitted = a.token_ids >= 0
        torch.testing.assert_close(a.logprobs[emitted], b.logprobs[emitted], rtol=0, atol=1e-6)
        assert torch.equal(a.ranks[emitted], b.ranks[emitted])
        assert torch.equal(a.top_token_ids[emitted], b.top_token_ids[emitted])
        torch.testing.assert_close(a.top_logprobs[emitted], b.top_logprobs[emitted], rtol=0,
                                   atol=1e-6)  # fmt: skip


# ------------------------------------------------------------ a mixed batch (tests 1, 7, 10)

MIXED = [
    P(temperature=0.0, seed=1, logprobs=2),
    P(top_k=10, temperature=0.8, seed=2),
    P(top_p=0.9, seed=3, logprobs=4, logprobs_mode="processed"),
    P(min_p=0.1, temperature=1.2, seed=4),
    P(top_k=20, top_p=0.8, seed=5),
    P(
        temperature=0.9,
        presence_penalty=1.2,
        frequency_penalty=0.6,
        repetition_penalty=1.3,
        seed=6,
        logprobs=3,
        logprobs_mode="processed",
    ),
    P(temperature=0.7, logit_bias={3: 2.5, 40: -1.0, 77: 4.0}, seed=7, logprobs=0),
    P(temperature=0.0, frequency_penalty=2.0, seed=8, logprobs=1, logprobs_mode="processed"),
    P(seed=2**62 + 9),
    P(
        top_k=15,
        top_p=0.9,
        min_p=0.02,
        presence_penalty=-0.5,
        frequency_penalty=0.9,
        logit_bias={5: 1.5},
        temperature=0.6,
        seed=10,
    ),
    P(repetition_penalty=1.8, temperature=0.5, seed=11, logprobs=5),
    P(top_k=3, presence_penalty=2.0, seed=12),
]


def mixed_inputs(B: int, K: int, V: int, seed: int):
    """(logits [B, K+1, V], positions [B], token_counts, prompt_mask): each row's offsets
    share most of their logits, so the same tokens come back and the penalties bite."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, 1, V, generator=g) * 1.5
    logits = (base + 0.3 * torch.randn(B, K + 1, V, generator=g)).contiguous()
    positions = torch.randint(0, 2**31, (B,), generator=g)
    positions[0] = 0
    counts = torch.randint(0, 3, (B, V), generator=g, dtype=torch.int32)
    counts[torch.rand(B, V, generator=g) < 0.9] = 0
    prompt = torch.rand(B, V, generator=g) < 0.1
    return logits, positions, counts, prompt


