"""Which sampler variant's graph serves a batch, per backend, and which kernels a key runs.

The route map. `choose_variant` picks the cheapest variant that serves every row of a
chunk; the executor then replays the graph of the variant whose kernels serve that one on
its sampler backend (`served_by`), and captures only those (`distinct_variants`):

    backend      no_filter    top_k_top_p    default
    triton       no_filter    default        default
    torch        no_filter    default        default
    flashinfer   no_filter    top_k_top_p    default

Why: on the Triton and torch backends `top_k_top_p` and `default` run the same kernels
(`sampling/triton/launch.py` and `sampling/reference.py` branch only on `no_filter`), so
a `top_k_top_p` graph would repeat `default`'s: a third of the graphs, for nothing.
FlashInfer runs a different sampler for each. Tokens cannot change either way: a variant
is an optimisation, and every row gets the token `default` gives it.

When a backend gains a real `top_k_top_p` specialisation, drop its entry from ROUTES
(and give it its own kernels in TRITON_KERNELS).
"""

from __future__ import annotations

from collections.abc import Mapping

from graphexec.params import VARIANT_ORDER, SamplerVariant

NO_FILTER, TOP_K_TOP_P, DEFAULT = (SamplerVariant.NO_FILTER, SamplerVariant.TOP_K_TOP_P,
                                   SamplerVariant.DEFAULT)  # fmt: skip

# backend -> {chosen variant: the variant whose graph serves it}; a variant not named
# serves itself
ROUTES: dict[str, Mapping[SamplerVariant, SamplerVariant]] = {
    "triton": {TOP_K_TOP_P: DEFAULT},
    "torch": {TOP_K_TOP_P: DEFAULT},
    "flashinfer": {},
}


def served_by(variant: SamplerVariant, backend: str) -> SamplerVariant:
    """The variant whose graph serves a chunk for which `choose_variant` chose `variant`
    on sampler `backend` (it serves every row `variant` serves: see ROUTES)."""
    try:
        route = ROUTES[backend]
    except KeyError:
        raise ValueError(f"backend must be one of {tuple(ROUTES)}, got {backend!r}") from None
    return route.get(variant, variant)


def distinct_variants(backend: str) -> tuple[SamplerVariant, ...]:
    """The variants whose graphs the executor captures on `backend`, cheapest first."""
    return tuple(dict.fromkeys(served_by(v, backend) for v in VARIANT_ORDER))


def routed_to(variant: SamplerVariant, backend: str) -> tuple[SamplerVariant, ...]:
    """The chosen variants whose chunks `variant`'s graph serves on `backend`."""
    return tuple(v for v in VARIANT_ORDER if served_by(v, backend) is variant)


# The Triton kernels one `sample_step` call launches, per variant, in launch order: the
# one list of them (`sampling/triton/launch.py` `sample` launches them; its package
# docstring says why; _check_kernel only while SamplerConfig's check_blocks is on,
# _short_kernel while check_blocks or short_blocks is, as in both presets). Update it
# with the kernels; tests/engine/test_variants.py checks it against the launches in
# launch.py and against ROUTES (variants that share a graph launch the same kernels).
_SELECT_ROUND = ("_select_kernel", "_kept_kernel", "_finish_kernel")
_FILTERED = ("_stats_kernel", "_tail_kernel", "_check_kernel", "_short_kernel",
             *_SELECT_ROUND, *_SELECT_ROUND)  # fmt: skip
TRITON_KERNELS: dict[SamplerVariant, tuple[str, ...]] = {
    NO_FILTER: ("_stats_kernel", "_tail_kernel"),
    TOP_K_TOP_P: _FILTERED,
    DEFAULT: _FILTERED,
}
TRITON_LOGPROBS_KERNELS = ("_raw_logprobs_kernel", "_logprobs_kernel")  # keys with logprobs
TRITON_VERIFY_KERNELS = ("_flatten_kernel", "_emit_kernel")  # spec_k > 0, strict verify


def triton_kernels(variant: SamplerVariant, logprobs: bool, spec_k: int = 0) -> tuple[str, ...]:
    """The Triton kernels a key's sampler launches per `sample_step` call on CUDA (with
    spec_k, `verify_step`'s own too), in order; a name may repeat (round 2)."""
    out = TRITON_KERNELS[variant] + (TRITON_LOGPROBS_KERNELS if logprobs else ())
    return TRITON_VERIFY_KERNELS[:1] + out + TRITON_VERIFY_KERNELS[1:] if spec_k else out
