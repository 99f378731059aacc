"""Optional FlashInfer backend of `sample_step` (`backend="flashinfer"`, CUDA only).

It runs the torch reference's processing (`processing.process_logits`, then the +inf
collapse), hands the processed rows to FlashInfer's fused samplers and writes logprobs
with `reference.write_logprobs` (so they match the torch backend's for the same token):

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
Each row passes its own seed and a Philox offset of `positions * OFFSET_STRIDE`, but
FlashInfer 0.7.2 derives the Philox subsequence from the row index (`curand_init(seed,
row, offset)`; sampling_from_logits uses `row * V + token`). **So this backend is NOT
batch-position invariant**, nor bit-compatible with the torch and triton backends, nor
reproducible across FlashInfer versions. Where it is approximate:
- Ties at the top-k boundary may keep more or fewer than k tokens (FlashInfer's radix
  select), and draws do not break ties by the lower token id.
- The top-p threshold comes from float32 sums (rejection sampling with pivots / float
  renormalisation), not the reference's exact integer fixed point; min-p compares float32
  probabilities against `min_p * max_prob`, not y >= log_min_p. Tokens at either boundary
  may differ by rounding.
- top-k/top-p and min-p draws are inverse-CDF / rejection sampling from float32
  probabilities: the right distribution up to float rounding, not an exact Gumbel-max.
- A sampled token outside [0, V) or on a -inf processed logit (FlashInfer's "last valid
  index" fallback when u is within rounding of the total mass) is replaced by the row's
  argmax, so the backend never emits an id outside the row's support.
- Not CUDA-graph capturable as written: `processing.process_logits` reads a device flag on
  the host (logit-bias check). Use it eagerly (tests, comparisons, benchmarks).
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


def sample(logits: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
           table: SamplingTensors, out: SamplerOutput, bitmask: torch.Tensor | None = None,
           variant: SamplerVariant = SamplerVariant.DEFAULT) -> SamplerOutput:  # fmt: skip
    """The FlashInfer backend of `graphexec.sampling.pipeline.sample_step` (see module doc)."""
    if logits.device.type != "cuda":
        raise ValueError(f"backend='flashinfer' needs CUDA tensors, got logits on {logits.device}")
    try:
        import flashinfer.sampling as fs
    except ImportError as e:  # say what to install
        raise ImportError(
            "backend='flashinfer' needs FlashInfer (pip install 'graphexec[flashinfer]', i.e. "
            f"flashinfer-python); importing flashinfer.sampling failed: {e}"
        ) from e
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
