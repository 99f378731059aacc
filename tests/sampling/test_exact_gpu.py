"""Triton backend on CUDA: chi-square tests of the draw and of each filter and route."""

from __future__ import annotations

import pytest
import torch

import graphexec as gx
from graphexec.sampling import reference
from graphexec.sampling.tensors import SamplingTensors

pytestmark = pytest.mark.gpu


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
