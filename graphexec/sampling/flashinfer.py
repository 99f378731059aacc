"""Optional FlashInfer backend of `sample_step` (`backend="flashinfer"`, CUDA only).

It runs the same processors as the torch reference (`processing.process_logits`: grammar
bitmask, logit bias, penalties, temperature; then the +inf collapse), hands the processed
rows to FlashInfer's fused samplers and writes logprobs with `reference.write_logprobs`:

    no_filter      flashinfer.sampling.sampling_from_logits (Gumbel-max over the row)
    top_k_top_p    flashinfer.sampling.top_k_top_p_sampling_from_logits with per-row top_k /
                   top_p tensors, filter_apply_order="top_k_first" (a row with no filter
                   gets k = V and p = 1, which filter nothing)
    default        top_k_mask_logits -> softmax -> top_p_renorm_probs ->
                   min_p_sampling_from_probs (min-p relative to the max probability is
                   unchanged by renormalisation, so this is the reference's order)
    greedy rows    first argmax of the processed row (ties to the lower id), as the reference

The variant picks the sampler for the whole batch (dispatching per row would need a host
sync); every row the variant serves gets its own filters through the per-row tensors.

Randomness: each row passes its own seed (`table.seed[slot_ids]`) and a Philox offset of
`positions * OFFSET_STRIDE` as [B] int64 tensors. FlashInfer 0.7.2 reads element `row` of
such tensors (element 0 when the tensor has length 1), but it derives the Philox
subsequence from the row index (`curand_init(seed, row, offset)`; sampling_from_logits uses
`row * V + token`). **So this backend is NOT batch-position invariant**: the same request
with the same seed and position draws a different token at a different row of the batch.
It is also **not bit-compatible with the torch and triton backends** (different generator,
different draw method), and its tokens are not reproducible across FlashInfer versions.

What it lacks compared with `graphexec.sampling.reference` (where it is approximate):
- Exact tie rules. Ties at the top-k boundary may keep more or fewer than k tokens
  (FlashInfer's radix select), and draws do not break ties by the lower token id.
- Fixed-point top-p. The top-p threshold is decided from float32 sums (rejection
  sampling with pivots / float renormalisation), so a token whose cumulative mass lies
  within float rounding of p may be kept or dropped differently than the reference's
  exact integer fixed-point rule.
- min-p compares float32 probabilities against `min_p * max_prob`; the reference keeps
  y >= log_min_p (y = (x - max) / T). Tokens at the boundary may differ by rounding.
- Draw semantics: top-k/top-p and min-p draws are inverse-CDF / rejection sampling from
  float32 probabilities, which is the right distribution up to float rounding, not an
  exact Gumbel-max over the filtered logits.
- A sampled token that falls outside [0, V) or on a -inf processed logit (FlashInfer falls
  back to its "last valid index" when u is within rounding of the total mass) is replaced
  by the row's argmax. This should never happen for a row with samplable tokens; it is
  there so the backend never emits an id outside the row's support.
- Not CUDA-graph capturable as written: `processing.process_logits` reads a device flag on
  the host (logit-bias check). Use it eagerly (tests, comparisons, benchmarks).
Logprobs are the reference's (`write_logprobs`), so they match the torch backend exactly
for the same sampled token.
"""

from __future__ import annotations

import torch

from graphexec.params import SamplerVariant
from graphexec.sampling import processing, reference
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors

# Philox draws reserved per output position and row: the offset of position `pos` is
# pos * OFFSET_STRIDE. sampling_from_logits takes one draw per subsequence, the rejection
# samplers one per round (a handful; 32 is FlashInfer's own reservation), so consecutive
# positions never reuse a draw. pos < 2**32, so the offset stays below 2**48.
OFFSET_STRIDE = 1 << 16


def _flashinfer_sampling():
    """Import `flashinfer.sampling` or raise an ImportError that says what to install."""
    try:
        import flashinfer.sampling as fs
    except ImportError as e:
        raise ImportError(
            "backend='flashinfer' needs FlashInfer (pip install 'graphexec[flashinfer]', i.e. "
            f"flashinfer-python); importing flashinfer.sampling failed: {e}"
        ) from e
    return fs


def sample(
    logits: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTensors,
    out: SamplerOutput,
    bitmask: torch.Tensor | None = None,
    variant: SamplerVariant = SamplerVariant.DEFAULT,
) -> SamplerOutput:
    """The FlashInfer backend of `graphexec.sampling.pipeline.sample_step` (see module doc)."""
    if logits.device.type != "cuda":
        raise ValueError(f"backend='flashinfer' needs CUDA tensors, got logits on {logits.device}")
    fs = _flashinfer_sampling()
    B, V = logits.shape
    if B == 0:
        return out
    variant = SamplerVariant(variant)
    x = processing.process_logits(logits, slot_ids, table, bitmask)
    xc = processing.collapse_inf(x)
    valid = xc.max(dim=-1).values > -torch.inf
    # FlashInfer needs a finite distribution: rows with nothing samplable become all-zero
    # (uniform) rows; their token is discarded below.
    rows = torch.where(valid.unsqueeze(1), xc, torch.zeros((), device=xc.device))

    seed = table.seed[slot_ids].to(torch.int64).contiguous()
    offset = (positions.to(torch.int64) * OFFSET_STRIDE).contiguous()
    rng = dict(deterministic=True, seed=seed, offset=offset)
    top_k = table.top_k[slot_ids]
    top_k = torch.where(top_k > 0, top_k, V).to(torch.int32).contiguous()
    top_p = table.top_p[slot_ids].to(torch.float32).contiguous()

    if variant is SamplerVariant.NO_FILTER:
        tok = fs.sampling_from_logits(rows, **rng)
    elif variant is SamplerVariant.TOP_K_TOP_P:
        tok = fs.top_k_top_p_sampling_from_logits(
            rows, top_k, top_p, filter_apply_order="top_k_first", **rng
        )
    else:
        probs = torch.softmax(fs.top_k_mask_logits(rows, top_k), dim=-1)
        # p >= 1 rows: plain renormalisation; is_deterministic: integer accumulation, so the
        # same inputs give the same threshold on every call
        probs = fs.top_p_renorm_probs(probs, top_p, is_deterministic=True)
        min_p = table.min_p[slot_ids].to(torch.float32).contiguous()
        tok = fs.min_p_sampling_from_probs(probs, min_p, **rng)

    tok = tok.to(torch.int64)
    top1 = reference.first_argmax(xc)
    in_support = (tok >= 0) & (tok < V)
    picked = xc.gather(1, tok.clamp(0, V - 1).unsqueeze(1)).squeeze(1)
    in_support &= picked > -torch.inf
    greedy = table.temperature[slot_ids] == 0
    tok = torch.where(greedy | ~in_support, top1, tok)
    tok = torch.where(valid, tok, -1)
    out.token_ids.copy_(tok)
    out.valid.copy_(valid)
    if out.logprobs is not None:
        reference.write_logprobs(processing.sanitize(logits), x, slot_ids, table, tok, out)
    return out


__all__ = ["OFFSET_STRIDE", "sample"]
