"""The FlashInfer backend (`backend="flashinfer"`, CUDA only): it runs, its tokens are valid
ids inside the filtered support, greedy / invalid rows follow the reference, and its draws
have the filtered distribution. It is not batch-position invariant and not bit-compatible
with the other backends, so nothing here compares its tokens with theirs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import graphexec as gx
from graphexec.sampling import processing, reference
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors


def _flashinfer_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        import flashinfer.sampling  # noqa: F401
    except Exception as e:  # not installed, or broken on this host
        return f"flashinfer.sampling not importable: {type(e).__name__}: {e}"
    return None


_MISSING = _flashinfer_missing()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]

DEV = "cuda"
V = 50257  # not a multiple of 32: exercises the bitmask tail


def _rows(variant: str) -> list[gx.SamplingParams]:
    """A mixed batch the variant can serve: greedy, unfiltered and filtered rows."""
    base = [
        dict(temperature=0.0),
        dict(temperature=0.8),
        dict(temperature=1.3),
    ]
    if variant in ("top_k_top_p", "default"):
        base += [
            dict(temperature=0.8, top_k=50),
            dict(temperature=0.7, top_k=200, top_p=0.9),
            dict(temperature=0.8, top_k=50, top_p=0.9),
            dict(temperature=1.0, top_k=1),
        ]
    if variant == "default":
        base += [
            dict(temperature=0.8, min_p=0.05),
            dict(temperature=0.7, top_p=0.9),
            dict(temperature=1.0, top_k=40, min_p=0.2),
            dict(temperature=0.9, top_k=100, top_p=0.8, min_p=0.02),
        ]
    rows = (base * 4)[:24]
    return [gx.SamplingParams(seed=100 + i, **kw) for i, kw in enumerate(rows)]


def _run(logits, params, positions, variant, bitmask=None, num_top=None, backend="flashinfer"):
    B = logits.shape[0]
    table = SamplingTensors.from_params(params, logits.shape[1], DEV)
    out = SamplerOutput.allocate(B, DEV, num_top)
    slot_ids = torch.arange(B, device=DEV)
    pos = torch.as_tensor(positions, device=DEV, dtype=torch.int64)
    gx.sample_step(logits, slot_ids, pos, table, out, bitmask, gx.SamplerVariant(variant), backend)
    return out, table


def _loose_support(logits, table, bitmask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's kept set, loosened by what the backend documents as approximate:
    top-p / min-p thresholds within float rounding, and ties at the boundary (every kept
    set is a prefix by value, so every token at least as large as the smallest kept one)."""
    B = logits.shape[0]
    slot_ids = torch.arange(B, device=DEV)
    x = processing.collapse_inf(processing.process_logits(logits, slot_ids, table, bitmask))
    loose = dataclasses.replace(
        table,
        top_p=torch.where(table.top_p < 1, table.top_p + 1e-3, table.top_p).clamp(max=1.0),
        min_p=(table.min_p - 1e-4).clamp(min=0.0),
    )
    kept = reference.filter_mask(x, slot_ids, loose)
    lowest = torch.where(kept, x, torch.inf).min(dim=1, keepdim=True).values
    return kept | ((x >= lowest) & (x > -torch.inf)), x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["no_filter", "top_k_top_p", "default"])
def test_tokens_valid_and_inside_filtered_support(variant, dtype):
    gen = torch.Generator(DEV).manual_seed(0)
    params = _rows(variant)
    B = len(params)
    logits = (torch.randn(B, V, device=DEV, generator=gen) * 3).to(dtype)
    greedy = torch.tensor([p.temperature == 0 for p in params], device=DEV)
    for step in range(6):
        out, table = _run(logits, params, [7 + step] * B, variant)
        tok = out.token_ids
        assert out.valid.all()
        assert bool(((tok >= 0) & (tok < V)).all()), tok
        kept, x = _loose_support(logits, table)
        assert bool(kept.gather(1, tok.unsqueeze(1)).all()), (variant, tok)
        top1 = reference.first_argmax(x)
        assert torch.equal(tok[greedy], top1[greedy])


def test_bitmask_respected_and_empty_rows_invalid():
    gen = torch.Generator(DEV).manual_seed(1)
    params = _rows("top_k_top_p")
    B = len(params)
    logits = torch.randn(B, V, device=DEV, generator=gen) * 3
    words = torch.randint(0, 2**32, (B, (V + 31) // 32), generator=torch.Generator().manual_seed(2))
    bitmask = words.to(torch.int32).to(DEV)
    bitmask[3] = 0  # nothing allowed: valid=False, token -1
    logits[5] = float("nan")  # all NaN: nothing samplable
    out, table = _run(logits, params, list(range(B)), "top_k_top_p", bitmask=bitmask)
    assert not out.valid[3] and not out.valid[5]
    assert out.token_ids[3] == -1 and out.token_ids[5] == -1
    ok = torch.ones(B, dtype=torch.bool, device=DEV)
    ok[3] = ok[5] = False
    tok = out.token_ids[ok]
    assert out.valid[ok].all() and bool(((tok >= 0) & (tok < V)).all())
    allowed = processing.unpack_bitmask(bitmask, V)[ok]
    assert bool(allowed.gather(1, tok.unsqueeze(1)).all())
    kept, _ = _loose_support(logits, table, bitmask)
    assert bool(kept[ok].gather(1, tok.unsqueeze(1)).all())


def test_logprobs_are_the_reference_ones():
    gen = torch.Generator(DEV).manual_seed(3)
    params = [dataclasses.replace(p, logprobs=5) for p in _rows("top_k_top_p")]
    B = len(params)
    logits = torch.randn(B, V, device=DEV, generator=gen) * 3
    out, _ = _run(logits, params, [0] * B, "top_k_top_p", num_top=5)
    ref, _ = _run(logits, params, [0] * B, "top_k_top_p", num_top=5, backend="torch")
    assert torch.equal(out.top_token_ids, ref.top_token_ids)
    torch.testing.assert_close(out.top_logprobs, ref.top_logprobs, rtol=0, atol=0)
    lp = torch.log_softmax(logits.float(), dim=-1).gather(1, out.token_ids.unsqueeze(1))
    torch.testing.assert_close(out.logprobs, lp.squeeze(1), rtol=1e-5, atol=1e-5)
    assert bool((out.ranks >= 1).all())


def test_sample_logits_entry_point_and_repeatability():
    gen = torch.Generator(DEV).manual_seed(4)
    params = _rows("default")
    B = len(params)
    logits = torch.randn(B, V, device=DEV, generator=gen) * 3
    a = gx.sample_logits(logits, params, [3] * B, backend="flashinfer")
    b = gx.sample_logits(logits, params, [3] * B, backend="flashinfer")
    assert torch.equal(a.token_ids, b.token_ids)  # same row, seed and position: same token
    draws = {
        tuple(gx.sample_logits(logits, params, [p] * B, backend="flashinfer").token_ids.tolist())
        for p in range(8)
    }
    assert len(draws) > 1  # the position moves the noise


@pytest.mark.parametrize(
    "kw, expected",
    [
        (dict(), {0: 1 / 10, 1: 2 / 10, 2: 3 / 10, 3: 4 / 10}),
        (dict(top_k=3), {1: 2 / 9, 2: 3 / 9, 3: 4 / 9}),
        (dict(top_p=0.5), {2: 3 / 7, 3: 4 / 7}),
        (dict(top_k=3, top_p=0.6), {2: 3 / 7, 3: 4 / 7}),
        (dict(min_p=0.6), {2: 3 / 7, 3: 4 / 7}),
    ],
)
def test_draws_follow_the_filtered_distribution(kw, expected):
    B, v = 8192, 256
    logits = torch.full((B, v), -torch.inf, device=DEV)
    logits[:, :4] = torch.log(torch.tensor([1.0, 2.0, 3.0, 4.0], device=DEV))
    params = [gx.SamplingParams(temperature=1.0, seed=i, **kw) for i in range(B)]
    variant = gx.choose_variant(params).value
    out, _ = _run(logits, params, [11] * B, variant)
    counts = torch.bincount(out.token_ids, minlength=v).cpu()
    assert int(counts.sum()) == B
    for t in range(v):
        p = expected.get(t, 0.0)
        sigma = math.sqrt(B * p * (1 - p)) if 0 < p < 1 else 0.0
        assert abs(int(counts[t]) - B * p) <= 5 * sigma + 1e-9, (t, int(counts[t]), B * p)
