"""Which kernels each sampler variant's graph runs: the route map of the variants.

`choose_variant` picks the cheapest variant that serves every row of a chunk
(`SamplerVariant.serves`), and the executor replays that variant's graph. Each variant
runs kernels of its own on every backend:

    backend      no_filter          top_k_top_p                     default
    triton       stats, tail        stats, top-k first (`topk`)     the route map of
                                                                    `sampling/triton`
    torch        the two-level      top-k of the row, no sort        a sort of the row
                 draw               (`filter_top_k_first`)          (`filter_mask`)
    flashinfer   sampling from      top-k / top-p sampling from     top-k mask, top-p
                 logits             logits                          renorm, min-p sampling

Tokens cannot change with the variant: a variant is an optimisation, and every row gets
the token `default` gives it.
"""

from __future__ import annotations

from graphexec.params import SamplerVariant

NO_FILTER, TOP_K_TOP_P, DEFAULT = (SamplerVariant.NO_FILTER, SamplerVariant.TOP_K_TOP_P,
                                   SamplerVariant.DEFAULT)  # fmt: skip


# The Triton kernels one `sample_step` call launches, per variant, in launch order: the
# one list of them (`sampling/triton/launch.py` `sample` launches them; its package
# docstring says why; _check_kernel only while SamplerConfig's check_blocks is on,
# _short_kernel while check_blocks or short_blocks is, as in both presets; with
# SamplerConfig.topk_launch, default's _topk_kernel before its _tail_kernel; with
# SamplerConfig.late_queue at the batch's size, DEFAULT_QUEUED: one _late_kernel after the
# check). Update it with the kernels; tests/engine/test_variants.py checks it against the
# launches in launch.py.
_SELECT_ROUND = ("_select_kernel", "_kept_kernel", "_finish_kernel")
_FILTERED = ("_stats_kernel", "_tail_kernel", "_check_kernel", "_short_kernel",
             *_SELECT_ROUND, *_SELECT_ROUND)  # fmt: skip
TRITON_KERNELS: dict[SamplerVariant, tuple[str, ...]] = {
    NO_FILTER: ("_stats_kernel", "_tail_kernel"),
    TOP_K_TOP_P: ("_stats_kernel", "_topk_kernel"),
    DEFAULT: _FILTERED,
}
DEFAULT_QUEUED = ("_stats_kernel", "_tail_kernel", "_check_kernel", "_late_kernel")
TRITON_LOGPROBS_KERNELS = ("_raw_logprobs_kernel", "_logprobs_kernel")  # keys with logprobs
TRITON_VERIFY_KERNELS = ("_flatten_kernel", "_emit_kernel")  # spec_k > 0, strict verify


def triton_kernels(variant: SamplerVariant, logprobs: bool, spec_k: int = 0) -> tuple[str, ...]:
    """The Triton kernels a key's sampler launches per `sample_step` call on CUDA (with
    spec_k, `verify_step`'s own too), in order; a name may repeat (round 2)."""
    out = TRITON_KERNELS[variant] + (TRITON_LOGPROBS_KERNELS if logprobs else ())
    return TRITON_VERIFY_KERNELS[:1] + out + TRITON_VERIFY_KERNELS[1:] if spec_k else out
